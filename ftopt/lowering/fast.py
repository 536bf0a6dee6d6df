"""The donated step over the memory of the last one: a :class:`PreparedStep` whose tables
still point at the caller's tensors (every pointer, shape, stride, dtype and device checked
in one native pass) launches with this step's counts and scalars, nothing re-planned."""

from __future__ import annotations

import optree

from ftopt.lowering.counts import advance_counts, advance_running
from ftopt.lowering.execute import PreparedStep, running_targets, uses_tensors
from ftopt.lowering.flat import flat_dict_leaves
from ftopt.lowering.plan import ChainPlan, planned_states
from ftopt.lowering.scalars import host_hparams, kernel_scalars


def _flat_dict_leaves(tree, prepared) -> tuple | None:
    return flat_dict_leaves(prepared.flat_getter, prepared.flat_len, tree)


def fast_step(plan: ChainPlan, params, grads, state):
    """The donated step over the same memory as the prepared one, or ``None``."""
    prepared = plan.prepared
    if prepared is None or not prepared.donate:
        return None
    p_flat = _flat_dict_leaves(params, prepared)
    if p_flat is None and prepared.list_getter is not None:
        p_flat = prepared.list_getter(params)
    if p_flat is None:
        p_flat = optree.tree_leaves(params, none_is_leaf=False, namespace="ftopt")
    s_flat = prepared.state_tensors(state)
    if s_flat is None:
        return None
    g_flat = _flat_dict_leaves(grads, prepared)
    if g_flat is None and prepared.list_getter is not None:
        g_flat = prepared.list_getter(grads, drop_none=False)
    if g_flat is None:
        try:
            g_flat = prepared.spec.flatten_up_to(grads)
        except (ValueError, TypeError):
            return None
    if not prepared.still_valid(p_flat, s_flat, g_flat):
        return None
    launch_prepared(plan, prepared, state)
    return params, state


def launch_prepared(plan: ChainPlan, prepared: PreparedStep, state, before_device=None
                    ) -> None:
    """The donated step over tables that :meth:`PreparedStep.still_valid` has just
    accepted: counts, this step's scalars, the (bound) launches. ``before_device``:
    called before the step reads a hyperparameter tensor on its device (the scalars
    computed there, or a rule's running scalars), where the kernel's host numbers do
    not do."""
    hparams = host_hparams(plan, prepared.device)
    if before_device is not None and (hparams is None or plan.running):
        before_device()
        hparams = host_hparams(plan, prepared.device)
    steps, _, pairs = advance_counts(plan, prepared.counts, True,
                                     uses_tensors(plan, hparams), prepared.device,
                                     prepared.counts_in_kernel)
    carried = None
    running = ()
    if plan.running:
        states = planned_states(plan, state)
        carried, _ = advance_running(plan, states, steps, True)
        running = running_targets(plan, prepared.traced, states, None, True)
    prepared.launch(kernel_scalars(plan, prepared.traced, steps, prepared.device, hparams,
                                   carried), pairs, running)



__all__ = ["fast_step", "launch_prepared"]
