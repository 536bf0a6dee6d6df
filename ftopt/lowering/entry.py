"""The fused backend's entry points (installed in :mod:`ftopt.dispatch` as ``fused``).

``step`` and ``update`` return ``(result, None)``, or ``(None, reason)`` when a call
cannot fuse (the reason is declared by the planner, :mod:`ftopt.lowering.plan`). A call
takes the first path that fits: the donated step over the tables of the last one
(:func:`ftopt.lowering.fast.fast_step`), the non-donated one over trees shaped like the
last call's (:mod:`ftopt.lowering.functional`), or the full path: every check, new
tables, the kernels (:func:`ftopt.lowering.execute.execute`).
"""

from __future__ import annotations

import optree
import torch

from ftopt import tree as tree_lib
from ftopt.combine import owner
from ftopt.lowering import bound, fast, functional, segments
from ftopt.lowering.calls import checked_call, launch_call, with_stage_states
from ftopt.lowering.plan import (
    SEPARATE_OUTPUTS,
    ChainPlan,
    fast_path_allowed,
    plan_chain,
)
from ftopt.stages import check_state_tree, state_at, with_state_at

__all__ = ["step", "update", "cached_step", "cached_update", "has_prepared_step", "bind_step"]


def cached_step(tx, params, grads, state, donate: bool, backend: str):
    """The step over the tables of an earlier call (donated: the same memory; else trees
    shaped like the last call's), or ``None``.

    A result proves that every leaf is a plain tensor: the tables were built from plain
    tensors only (a ``DTensor`` is refused there), and a ``DTensor`` never passes their
    check (it has no storage and its ``data_ptr()`` is 0). :func:`ftopt.step` tries this
    before it looks for ``DTensor`` leaves, so a cached step pays for no such scan.
    """
    plan = plan_chain(tx)
    if plan.reason:
        return None
    if donate and (plan.prepared is None or not fast_path_allowed(plan.prepared, backend)):
        return None
    if plan.injected:
        return _around_injected(plan, tx, state, donate,
                                lambda: (_cached_step(plan, params, grads, state, donate,
                                                      backend), None))[0]
    return _cached_step(plan, params, grads, state, donate, backend)


def _cached_step(plan: ChainPlan, params, grads, state, donate: bool, backend: str):
    if donate:
        return fast.fast_step(plan, params, grads, state)
    return _functional(plan, params, grads, state, "p", backend)


def has_prepared_step(tx, backend: str) -> bool:
    """Whether :func:`cached_step` may take a donated step of ``tx`` (tables built by
    an earlier donated step, for this ``backend``)."""
    plan = plan_chain(tx)
    prepared = plan.prepared
    return (not plan.reason and prepared is not None and prepared.donate
            and fast_path_allowed(prepared, backend))


def bind_step(tx, params, state, backend: str) -> bound.BoundStep | None:
    """The donated step of ``tx`` bound to the tensors of ``params`` and ``state``
    (:mod:`ftopt.lowering.bound`), or ``None``."""
    return bound.bind(tx, params, state, backend)


def step(tx, params, grads, state, donate: bool, backend: str, *, cached: bool = True):
    """Run the step fused and return ``(result, None)``, or ``(None, reason)``.
    ``cached=False``: the caller has tried :func:`cached_step` already."""
    plan = plan_chain(tx)
    if plan.reason:
        return None, plan.reason
    if cached:
        result = cached_step(tx, params, grads, state, donate, backend)
        if result is not None:
            return result, None

    def full():
        paths, p_flat, spec = tree_lib.flatten_with_paths(params)
        g_flat = tree_lib.flatten_like(spec, grads, "grads", paths)
        return _full_call(plan, params, state, spec, paths, p_flat, g_flat, backend,
                          donate, "p", tx)

    if plan.injected:
        return _around_injected(plan, tx, state, donate, full)
    return full()


def _around_injected(plan: ChainPlan, tx, state, donate: bool, run):
    """``run()`` (``(result, reason)``) with the ``inject_hyperparams`` wrappers inside
    the chain doing what their ``update`` does around the inner one: their state's
    hyperparameters loaded into the tensors the plan's stages hold (checked first, as
    their eager update checks them), then, after a step, their counts advanced and
    schedules called (donated: in place). Nothing is written where ``run`` does not
    step (it returns ``(None, reason)``), and the eager update then loads the same
    values again."""
    check_state_tree(owner(tx), state)
    for wrapper, path, inner in plan.injected:
        if wrapper.load(state_at(state, path)) is not inner:
            return None, ("inject_hyperparams: its state is on another device than the one "
                          "its transform was first made for")
    result, reason = run()
    if result is None:
        return None, reason
    new, new_state = result
    # The deepest wrappers first: an outer one's new state holds the inner ones'.
    for wrapper, path, _ in sorted(plan.injected, key=lambda hook: -len(hook[1])):
        inner_state = state_at(new_state, path).inner_state
        new_state = with_state_at(new_state, path,
                                  wrapper.advance(state_at(state, path), inner_state, donate))
    return (new, new_state), None


def _full_call(plan: ChainPlan, params, state, spec, paths, p_flat, g_flat, backend: str,
               donate: bool, output: str, tx=None):
    """Every check, new tables, the kernels: a step (``output="p"``) or an update
    (``"u"``; ``params`` may be ``None``, ``p_flat`` then holds stand-ins).
    ``((new params or updates, new state), None)``, or ``(None, reason)``. ``tx``: the
    transform, whose state containers are checked as its eager update checks them."""
    if tx is not None:
        check_state_tree(owner(tx), state)
    if plan.segments is not None:
        return segments.run(plan, params, state, spec, paths, p_flat, g_flat, backend,
                            donate, output)
    checked, reason = checked_call(plan, params, state, paths, p_flat, g_flat, backend,
                                   donate, output, spec)
    if reason is not None:
        return None, reason
    new, new_state = launch_call(plan, checked, params, state, spec, paths, p_flat, g_flat,
                                 donate, output)
    return (new, new_state), None


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
    return new, with_stage_states(plan, state, stage_states)


def cached_update(tx, updates, state, params, backend: str):
    """``tx.update`` over the tables of an earlier call with trees shaped like this one's,
    or ``None`` (a result proves plain tensors, as for :func:`cached_step`)."""
    plan = plan_chain(tx)
    if plan.reason or plan.injected:
        return None
    return _functional(plan, params, updates, state, "u", backend)


def update(tx, updates, state, params, backend: str, *, cached: bool = True):
    """``tx.update`` as one fused kernel per group: ``((updates, new_state), None)``, or
    ``(None, reason)``. Pure: new update and state tensors (updates in fp32).
    ``cached=False``: the caller has tried :func:`cached_update` already."""
    plan = plan_chain(tx)
    if plan.reason:
        return None, plan.reason
    if plan.injected:
        return None, ("inject_hyperparams inside a chain fuses in ftopt.step; an update runs "
                      "the wrapper eagerly, its inner update fused")
    if cached:
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
    for part in plan.segments or () if params is None else ():
        if not isinstance(part, ChainPlan) and getattr(part[0], "uses_params", False):
            raise ValueError(f"{part[0].name} needs params: call update(updates, state, "
                             "params)")
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
