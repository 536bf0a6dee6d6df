"""The fused backend's entry points (installed in :mod:`ftopt.dispatch` as ``fused``).

``step`` and ``update`` return ``(result, None)``, or ``(None, reason)`` when a call
cannot fuse (the reason is declared by the planner, :mod:`ftopt.lowering.plan`). A call
takes the first path that fits: the donated step over the tables of the last one
(:func:`ftopt.lowering.execute.fast_step`), the non-donated one over trees shaped like the
last call's (:mod:`ftopt.lowering.functional`), or the full path: every check, new
tables, the kernels (:func:`ftopt.lowering.execute.execute`).
"""

from __future__ import annotations

import optree
import torch

from ftopt import tree as tree_lib
from ftopt.combine import owner
from ftopt.lowering import execute, functional
from ftopt.lowering.plan import (
    SEPARATE_OUTPUTS,
    ChainPlan,
    call_reason,
    fast_path_allowed,
    get_checked,
    plan_chain,
    slot_reason,
)
from ftopt.stages import check_state_tree, with_state_at
from ftopt.validate import check_count, check_leaf, check_slots

__all__ = ["step", "update"]


def step(tx, params, grads, state, donate: bool, backend: str):
    """Run the step fused and return ``(result, None)``, or ``(None, reason)``."""
    plan = plan_chain(tx)
    if plan.reason:
        return None, plan.reason
    if donate and plan.prepared is not None and fast_path_allowed(plan.prepared, backend):
        result = execute.fast_step(plan, params, grads, state)
        if result is not None:
            return result, None
    if not donate:
        result = _functional(plan, params, grads, state, "p", backend)
        if result is not None:
            return result, None
    paths, p_flat, spec = tree_lib.flatten_with_paths(params)
    g_flat = tree_lib.flatten_like(spec, grads, "grads", paths)
    return _full_call(plan, params, state, spec, paths, p_flat, g_flat, backend, donate,
                      "p", tx)


def _full_call(plan: ChainPlan, params, state, spec, paths, p_flat, g_flat, backend: str,
               donate: bool, output: str, tx=None):
    """Every check, new tables, the kernels: a step (``output="p"``) or an update
    (``"u"``; ``params`` may be ``None``, ``p_flat`` then holds stand-ins).
    ``((new params or updates, new state), None)``, or ``(None, reason)``. ``tx``: the
    transform, whose state containers are checked as its eager update checks them."""
    if tx is not None:
        check_state_tree(owner(tx), state)
    stage_states = [get_checked(state, path, stage) for path, stage in
                    zip(plan.state_paths, plan.stages)]
    slot_flat = [
        {s.name: tree_lib.flatten_like(spec, getattr(st, s.name), f"state {s.name}", paths)
         for s in stage.rule.slots}
        for stage, st in zip(plan.stages, stage_states)
    ]
    active = [i for i, g in enumerate(g_flat) if g is not None]
    # The checks of the eager path (the same functions), before anything is written.
    for i in active:
        p = p_flat[i] if params is not None else None
        check_leaf(paths[i], g_flat[i], p, params is not None)
        for stage, slots in zip(plan.stages, slot_flat):
            check_slots(stage, paths[i], g_flat[i], p, {k: v[i] for k, v in slots.items()})
    for stage, st in zip(plan.stages, stage_states):
        if stage.rule.counted:
            check_count(stage.rule.name, st.count)
    reason = call_reason(plan, p_flat, g_flat, active, backend, grads_too=output == "u",
                         donate=donate, paths=paths)
    if reason is None:
        reason = slot_reason(plan, slot_flat, active, paths)
    if reason is not None:
        return None, reason
    new, new_stage_states, prepared = execute.execute(
        plan, spec, paths, p_flat, g_flat, stage_states, slot_flat, active, params, state,
        donate, output)
    if not donate and prepared is not None:
        functional.remember(plan, output, prepared, spec, params, g_flat, slot_flat, p_flat)
    new_state = _with_stage_states(plan, state, new_stage_states)
    return (new, new_state), None


def _with_stage_states(plan: ChainPlan, state, stage_states):
    for path, st in zip(plan.state_paths, stage_states):
        state = with_state_at(state, path, st)
    return state


def _functional(plan: ChainPlan, params, grads, state, output: str, backend: str):
    """The cached non-donated path (see :mod:`ftopt.lowering.functional`), or ``None``."""
    cache = plan.functional.get(output)
    if (cache is None or SEPARATE_OUTPUTS.get()
            or not fast_path_allowed(cache.prepared, backend)):
        return None
    got = functional.fast_functional(plan, params, grads, state, output)
    if got is None:
        return None
    new, stage_states = got
    return new, _with_stage_states(plan, state, stage_states)


def update(tx, updates, state, params, backend: str):
    """``tx.update`` as one fused kernel per group: ``((updates, new_state), None)``, or
    ``(None, reason)``. Pure: new update and state tensors (updates in fp32)."""
    plan = plan_chain(tx)
    if plan.reason:
        return None, plan.reason
    result = _functional(plan, params, updates, state, "u", backend)
    if result is not None:
        return result, None
    first = next(iter(optree.tree_leaves(updates, none_is_leaf=False, namespace="ftopt")),
                 None)
    if (backend == "auto" and isinstance(first, torch.Tensor) and first.device.type == "cpu"):
        return None, "tensors are on the CPU"
    for stage in plan.stages if params is None else ():
        # The eager path's errors, before anything runs.
        if stage.rule.uses_params:
            raise ValueError(f"{stage.rule.name} needs params: call update(updates, state, "
                             "params)")
        if callable(stage.rule.leaf_mask):
            raise ValueError(f"{stage.rule.name}: a callable mask needs params")
    if params is not None:
        paths, p_flat, spec = tree_lib.flatten_with_paths(params)
        g_flat = tree_lib.flatten_like(spec, updates, "updates", paths)
    else:
        spec = optree.tree_structure(updates, none_is_leaf=True, namespace="ftopt")
        paths = [tree_lib.path_str(p) for p in optree.tree_paths(
            updates, none_is_leaf=True, namespace="ftopt")]
        g_flat = spec.flatten_up_to(updates)
        p_flat = list(g_flat)  # stand-ins: no rule reads them
    return _full_call(plan, params, state, spec, paths, p_flat, g_flat, backend, False, "u",
                      tx)
