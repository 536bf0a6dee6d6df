"""One fused call of a plan, in two parts: the checks (before anything is written) and
the kernels. :mod:`ftopt.lowering.entry` runs them back to back; a chain with matrix stages
(:mod:`ftopt.lowering.segments`) checks every segment before it runs the first."""

from __future__ import annotations

from ftopt import tree as tree_lib
from ftopt.lowering import branches, execute, functional
from ftopt.lowering.plan import ChainPlan, call_reason, get_checked, slot_reason
from ftopt.stages import with_state_at
from ftopt.validate import check_count, check_leaf, check_running, check_slots

__all__ = ["checked_call", "launch_call", "passed_through", "with_stage_states"]


def checked_call(plan: ChainPlan, params, state, paths, p_flat, g_flat, backend: str,
                 donate: bool, output: str, spec, selection=None):
    """The eager path's checks of a call (the same functions, before anything is
    written) and the fused path's conditions: ``((stage states, slots, active,
    selection), None)``, or ``(None, reason)``. ``selection``: the plan's
    (:func:`branches.select`), if the caller has it."""
    stage_states = [get_checked(state, path, stage) for path, stage in
                    zip(plan.state_paths, plan.stages)]
    slot_flat = [
        {s.name: tree_lib.flatten_like(spec, getattr(st, s.name), f"state {s.name}", paths)
         for s in stage.rule.slots}
        for stage, st in zip(plan.stages, stage_states)
    ]
    active = [i for i, g in enumerate(g_flat) if g is not None]
    if selection is None:
        selection = branches.select(plan, spec, params, p_flat, paths)
    runs = [set() for _ in plan.stages]  # the leaves each stage runs on
    for owners in selection.stage_of:
        for i, s in enumerate(owners):
            if s is not None:
                runs[s].add(i)
    for i in active:
        p = p_flat[i] if params is not None else None
        check_leaf(paths[i], g_flat[i], p, params is not None)
        for stage, slots, mine in zip(plan.stages, slot_flat, runs):
            if stage.rule.slots and i in mine:
                check_slots(stage, paths[i], g_flat[i], p,
                            {k: v[i] for k, v in slots.items()})
    for stage, st in zip(plan.stages, stage_states):
        if stage.rule.counted:
            check_count(stage.rule.name, st.count)
        if stage.rule.running:
            check_running(stage.rule, st)
    reason = call_reason(plan, p_flat, g_flat, active, backend, grads_too=output == "u",
                         donate=donate, paths=paths)
    if reason is None:
        reason = slot_reason(plan, slot_flat, active, paths)
    if reason is not None:
        return None, reason
    return (stage_states, slot_flat, active, selection), None


def launch_call(plan: ChainPlan, checked, params, state, spec, paths, p_flat, g_flat,
                donate: bool, output: str, x_flat=None, remember: bool = True,
                through_dtypes: list | None = None):
    """The kernels of a checked call: ``(new params or updates, new state)``.
    ``remember``: keep the tables for the next non-donated call (a whole chain's).
    ``through_dtypes``: per leaf, the dtype of its update where no position applies to it
    (by default its input's, as the eager path passes it through; a segment's: the dtype
    its input has on the eager path, which may not be ``x``'s, read as fp32)."""
    stage_states, slot_flat, active, selection = checked
    new, new_stage_states, prepared = execute.execute(
        plan, spec, paths, p_flat, g_flat, stage_states, slot_flat, active, params, state,
        donate, output, x_flat, selection)
    through = passed_through(plan, selection, active) if output == "u" else []
    if through:
        # The update of a leaf that no position applies to is its input, in its input's
        # dtype, as the eager path passes it through (the kernels write fp32 updates).
        flat = tree_lib.flatten_like(spec, new, "updates", paths)
        for i in through:
            if through_dtypes is not None:
                flat[i] = flat[i].to(through_dtypes[i])
                continue
            source = x_flat[i] if x_flat is not None and x_flat[i] is not None else g_flat[i]
            flat[i] = flat[i].to(source.dtype)
        new = tree_lib.unflatten(spec, flat)
    if (remember and not donate and prepared is not None and not plan.branched
            and not through):
        functional.remember(plan, output, prepared, spec, params, g_flat, slot_flat, p_flat)
    return new, with_stage_states(plan, state, new_stage_states)


def passed_through(plan: ChainPlan, selection, active: list) -> list:
    """The active leaves that no position of ``plan`` applies to (a mask's others)."""
    masks = [selection.values[(k, "mask")] for k in range(len(plan.positions))]
    return [i for i in active if not any(m[i] for m in masks)]


def with_stage_states(plan: ChainPlan, state, stage_states):
    for path, st in zip(plan.state_paths, stage_states):
        state = with_state_at(state, path, st)
    return state
