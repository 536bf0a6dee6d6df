"""The one trace of a chain: every backend's per-element program comes from here.

A chain of elementwise rules is, per element, one program: the raw gradient ``g`` enters
as the first stage's ``u``, each stage's body maps ``(u, p, its slots, its scalars)`` to
``(u, new slots)``, and the last ``u`` is the update (or ``p + u`` the new param). What a
backend evaluates is that program over its own values, an :class:`Algebra`: tensors per
leaf (:mod:`ftopt.eager`), a traced chunk program (:mod:`ftopt.chunked`) or Triton
symbols (:mod:`ftopt.lowering`). The algebra says how values come in and go out; this
module decides what the chain computes, and so ``skip_zeros`` is written once, here
(SPEC §3): in a skip-aware stage, where the raw gradient is zero, the stage's update is
``-0.0`` (so ``p + u`` keeps ``p``, a ``-0.0`` one too) and each slot keeps its old value.
The same rule on whole tensors (:func:`skip_updates`) serves the eager chain for
transforms without a rule and for leaves a mask passes through.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ftopt import tree as tree_lib
from ftopt.rules import Env, Rule

__all__ = ["Algebra", "trace_chain", "zero_mask_of", "skip_updates", "skip_update"]


class Algebra(Protocol):
    """The values of one backend, as :func:`trace_chain` uses them."""

    def ops(self) -> Any:
        """The ``o`` namespace a rule body calls (``sqrt``, ``where``, ``lerp``, ...)."""

    def zero_mask(self, g: Any) -> Any:
        """Where the raw gradient is +-0.0 (NaN is not zero)."""

    def neg_zero(self, g: Any) -> Any:
        """The value ``-0.0`` (the skipped update), as this algebra spells it."""

    def select(self, mask: Any, a: Any, b: Any) -> Any:
        """``a`` where ``mask``, else ``b``."""

    def elem(self, value: Any, like: Any) -> Any:
        """``value`` (a body's result: an element value, a per-leaf or global scalar, a
        number) as an element value shaped like ``like``, in the compute dtype."""

    def stage_inputs(self, index: int, rule: Rule, u: Any) -> dict | None:
        """The body's inputs of stage ``index`` besides ``u``: ``p`` (where the rule reads
        it), each slot's old value, the per-step scalars. ``None``: the stage does not run
        here (a leaf its mask leaves out), and ``u`` passes through."""

    def leaf_flag(self, index: int) -> Any:
        """A per-element value true on the leaves stage ``index`` applies to, where this
        algebra keeps leaf masks in the values (``None`` where it selects leaves itself)."""

    def slot_out(self, index: int, name: str, value: Any) -> None:
        """Stage ``index``'s new value of slot ``name``."""

    def running_out(self, index: int, name: str, value: Any) -> None:
        """Stage ``index``'s new value of its running scalar ``name`` (a global value the
        body computed: :attr:`ftopt.rules.Rule.running`)."""


def trace_chain(stages: Sequence[Any], skips: Sequence[bool], algebra: Algebra, g: Any,
                *, selects: bool = True, zero_from: Any = None,
                owner_skips: Sequence[bool] | None = None) -> Any:
    """Runs the chain's rules on ``algebra``'s values from the raw gradient ``g``; the
    slots go out through ``algebra.slot_out``; returns the chain's update.

    ``zero_from``: the raw gradient where ``g`` is not it (a segment of a chain after a
    matrix stage: ``g`` is that stage's output, and ``skip_zeros`` still follows the raw
    gradient).

    ``stages``: rules, or objects with a ``rule``; ``skips[i]``: stage ``i`` is
    skip-aware.
    ``selects=False``: the caller keeps zero-gradient elements itself (a kernel that
    neither loads nor stores them), so no skip selects are traced.
    ``owner_skips[i]``: stage ``i``'s ``skip_zeros`` is its branch's own (inside a
    ``masked``/``partition``): the leaves its flag passes through keep their update, as
    :class:`ftopt.combine.Masked` passes them through without the mask.
    """
    skipping = selects and any(skips)
    raw = g if zero_from is None else zero_from
    zero = algebra.zero_mask(raw) if skipping else None
    neg_zero = algebra.neg_zero(raw) if skipping else None
    u = g
    all_zero = None
    for index, (stage, skip) in enumerate(zip(stages, skips)):
        rule = stage if isinstance(stage, Rule) else stage.rule
        skip_u = skip
        inputs = algebra.stage_inputs(index, rule, u)
        if inputs is None:  # the leaf is not this stage's: u passes through
            u_new, slots = u, {}
        else:
            skipped = zero if skip and zero is not None else None
            body_u, body_slots = rule.body(algebra.ops(), Env({"u": inputs.pop("u", u),
                                                                "skip": skipped, **inputs}))
            for name in rule.running:
                if name in body_slots:
                    algebra.running_out(index, name, body_slots[name])
            u_new = algebra.elem(body_u, u)
            flag = algebra.leaf_flag(index)
            if flag is not None:
                if skip and zero is not None and owner_skips and owner_skips[index]:
                    u_new = algebra.select(zero, neg_zero, u_new)
                    skip_u = False
                u_new = algebra.select(flag, u_new, u)
            # (A per-leaf slot stays a per-leaf value: one per leaf, not per element.)
            slots = {s.name: (body_slots[s.name] if s.per_leaf
                              else algebra.elem(body_slots[s.name], u), inputs[s.name],
                              s.per_leaf) for s in rule.slots}
        if skip_u and zero is not None:
            u_new = algebra.select(zero, neg_zero, u_new)
        for name, (new, old, per_leaf) in slots.items():
            if skip and zero is not None:
                if per_leaf:  # kept where the leaf's raw gradient is all zero
                    if all_zero is None:
                        all_zero = leaf_all_zero(algebra, zero)
                    new = algebra.select(all_zero, old, new)
                else:
                    new = algebra.select(zero, old, new)
            algebra.slot_out(index, name, new)
        u = u_new
    return u


def leaf_all_zero(algebra: Algebra, zero: Any) -> Any:
    """Per leaf, whether its raw gradient is all zero (``zero`` everywhere): the norm of
    the non-zero indicator is 0. A norm, so a leaf split over ranks counts every shard
    (each backend sums a norm's squares over the mesh)."""
    return algebra.ops().leaf_norm(algebra.select(zero, 0.0, 1.0)) == 0.0


# -- skip_zeros on whole tensors (transforms without a rule, leaves a mask passes through)


def skip_update(u: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``u`` with ``-0.0`` where ``zero`` holds."""
    return torch.where(zero, torch.full((), -0.0, dtype=u.dtype, device=u.device), u)


def zero_mask_of(updates) -> Any:
    """``g == 0`` for every leaf (``+0.0`` and ``-0.0``; NaN is not zero).

    A leaf that is not a dense tensor is passed through as it is: the rules' checks then
    name what is wrong with it (``==`` on a sparse tensor would raise torch's error first).
    """
    return tree_lib.map(_zero, updates)


def _zero(g):
    return g == 0 if isinstance(g, torch.Tensor) and g.layout == torch.strided else g


def skip_updates(updates: Any, zero_mask: Any) -> Any:
    """``-0.0`` where ``zero_mask`` holds, in every leaf of ``updates`` (the update of a
    skipped element: ``p + (-0.0)`` is ``p`` for every ``p``, ``-0.0`` too)."""

    return tree_lib.map(skip_update, updates, zero_mask)
