"""A donated fused step bound to the tensors of its caller's params and state.

:func:`ftopt.lowering.fast.fast_step` re-reads a donated step's trees on every call:
the params and the state's slots flattened through cached getters, the gradients' tree
the same way. A caller that owns its params and state and keeps them as the same objects
from one step to the next (:class:`ftopt.Optimizer`, whose param groups hold the params
and whose state trees no one else sees) can hold those lists instead: :func:`bind`
flattens them once, after a step that built or reused the tables, and each later step
hands only the gradients, in leaf order. The tensor check stays whole: every param,
state and gradient tensor's pointer, shape, strides, dtype and device is checked against
the tables on every step (:meth:`ftopt.lowering.execute.PreparedStep.still_valid`), and a
step that fails it is not launched: the caller then takes its full path.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import optree
import torch

from ftopt.lowering import execute, fast, native
from ftopt.lowering.plan import ChainPlan, fast_path_allowed, plan_chain

__all__ = ["BoundStep", "bind"]

_grad_of = operator.attrgetter("grad")
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # (no ``grad`` getter of their own)


class BoundStep:
    """The tables of ``tx``'s last donated step and the param and state tensors they
    point at. ``params``: the params in leaf order (the order :meth:`fits` wants the
    gradients in)."""

    __slots__ = ("plan", "prepared", "params", "states", "state", "backend", "plain",
                 "reader")

    def __init__(self, plan: ChainPlan, prepared: execute.PreparedStep, params: tuple,
                 states: list, state: Any, backend: str):
        self.plan, self.prepared = plan, prepared
        self.params, self.states, self.state = params, states, state
        self.backend = backend
        self.plain = all(type(p) in _PLAIN for p in params)
        self.reader = None  # the native ``grads`` (see grads)

    def grads(self) -> list:
        """The params' gradients in leaf order (``None`` where a param has none): read in
        one native call where the extension is loaded and every param is a plain tensor
        or ``nn.Parameter`` (~15 ns a param, against ~70 ns for ``p.grad`` from Python),
        else from Python."""
        reader = self.reader
        if reader is None and self.plain:
            reader = self.reader = getattr(native.module(start=False), "grads", None)
        return reader(self.params) if reader is not None else list(map(_grad_of,
                                                                        self.params))

    def fits(self, grads: list) -> bool:
        """Whether a step may launch with ``grads`` (one per param, in leaf order; ``None``
        where a param has none): the tables are still the plan's, the backend still
        allows the cached path, and every tensor passes the check (the gradients'
        addresses are then the tables')."""
        prepared = self.prepared
        return (self.plan.prepared is prepared and fast_path_allowed(prepared, self.backend)
                and prepared.still_valid(self.params, self.states, grads))

    def refuse(self) -> None:
        """The caller's tensors did not fit these tables right after a step over them
        (a ``DTensor``'s shards are stepped through their local tensors): :func:`bind`
        gives ``None`` for these tables from now on, so that each step does not flatten
        the trees again to find that out."""
        self.prepared.bind_refused = True

    def launch(self, before_device: Callable[[], None] | None = None) -> None:
        """The step, after :meth:`fits` accepted this step's gradients.
        ``before_device``: called first where the step reads a hyperparameter tensor on
        its device (see :func:`ftopt.lowering.fast.launch_prepared`)."""
        fast.launch_prepared(self.plan, self.prepared, self.state, before_device)


def bind(tx: Any, params: Any, state: Any, backend: str) -> BoundStep | None:
    """The donated step of ``tx`` over the tables its last step used, bound to the
    tensors of ``params`` and ``state`` (the trees that step was given), or ``None``
    where there are no such tables (a step that did not fuse, or that fused on a path
    that keeps none)."""
    plan = plan_chain(tx)
    prepared = plan.prepared
    # (Nested inject_hyperparams wrappers load and advance their state around each step:
    # ftopt.lowering.entry does that, so such a step is not bound.)
    if (plan.reason or plan.injected or prepared is None or not prepared.donate
            or prepared.check is None
            or getattr(prepared, "bind_refused", False)
            or not fast_path_allowed(prepared, backend)):
        return None
    states = prepared.state_tensors(state)
    if states is None:
        return None
    leaves = tuple(optree.tree_leaves(params, none_is_leaf=False, namespace="ftopt"))
    return BoundStep(plan, prepared, leaves, states, state, backend)
