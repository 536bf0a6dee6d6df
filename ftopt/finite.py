"""``apply_if_finite``: skip the steps whose gradients hold a NaN or an Inf (as optax).

One overflowing batch (a loss spike, an fp16 gradient) would otherwise write NaN into the
params and into every moment estimate for good. The wrapper decides per step, on the
device, without a host synchronisation: the finiteness flag is a 0-d bool tensor and every
output leaf is ``torch.where(flag, new, old)``, so a step never waits for the GPU and can be
captured in a CUDA graph or traced.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ftopt import tree as tree_lib
from ftopt._counts import mark_device_decided
from ftopt.base import GradientTransformation, register_owner, register_state
from ftopt.domains import check_int
from ftopt.numerics import safe_increment
from ftopt.shards import all_ranks

__all__ = ["ApplyIfFiniteState", "apply_if_finite"]



@register_state
class ApplyIfFiniteState(NamedTuple):
    """The state of :func:`apply_if_finite` (optax's layout).

    Attributes:
        notfinite_count: consecutive steps with a NaN or Inf in the updates (0-d int32;
            reset to 0 by a finite step).
        last_finite: whether the last step's updates were all finite (0-d bool).
        total_notfinite: steps with a NaN or Inf since ``init`` (0-d int32; never reset).
        inner_state: the wrapped transform's state.
    """

    notfinite_count: torch.Tensor
    last_finite: torch.Tensor
    total_notfinite: torch.Tensor
    inner_state: Any


def _all_finite(leaves: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A 0-d bool tensor on ``device``: every element of every leaf is finite."""
    if not leaves:
        return torch.ones((), dtype=torch.bool, device=device)
    # On local shards, a step is skipped on every rank if any shard is not finite.
    return all_ranks(torch.stack([torch.isfinite(u).all().to(device) for u in leaves]).all())


def where_leaf(flag: torch.Tensor, new: Any, old: Any) -> Any:
    """``new`` where ``flag`` else ``old``, leaf by leaf (bit-exact either way)."""
    if not isinstance(new, torch.Tensor) or not isinstance(old, torch.Tensor):
        return new
    if old.dtype != new.dtype:
        old = old.to(new.dtype)
    out = torch.where(flag.to(new.device), new, old.to(new.device))
    if out.ndim == 0 and not out.is_floating_point():
        # A step count kept or advanced on the device flag: the next step must not read it.
        mark_device_decided(out)
    return out


def _skip(flag: torch.Tensor, u: Any) -> Any:
    if not isinstance(u, torch.Tensor):
        return u
    neg_zero = torch.full((), -0.0, dtype=u.dtype, device=u.device)
    return torch.where(flag.to(u.device), u, neg_zero)


class ApplyIfFinite:
    """The object behind :func:`apply_if_finite` (see there)."""

    # Why ``ftopt.step`` and ``ftopt.explain`` run this transform eagerly.
    unfused_reason = ("apply_if_finite runs eagerly: it selects between the inner step and "
                      "no step on a device flag, outside the fused kernels")

    def __init__(self, inner: GradientTransformation, max_consecutive_errors: int):
        if not isinstance(inner, GradientTransformation):
            raise TypeError(f"apply_if_finite: inner must be a GradientTransformation, got "
                            f"{type(inner).__name__}")
        self.inner = inner
        self.max_consecutive_errors = check_int("apply_if_finite", "max_consecutive_errors",
                                                max_consecutive_errors, minimum=0)
        register_owner(self)

    @property
    def transforms(self) -> tuple[GradientTransformation, ...]:
        return (self.inner,)

    def rebuild(self, transforms: Sequence[GradientTransformation]) -> GradientTransformation:
        obj = ApplyIfFinite(transforms[0], self.max_consecutive_errors)
        return GradientTransformation(obj.init, obj.update)

    def init(self, params) -> ApplyIfFiniteState:
        flat = tree_lib.leaves(params)
        device = flat[0].device if flat and isinstance(flat[0], torch.Tensor) else None
        zero = torch.zeros((), dtype=torch.int32, device=device)
        return ApplyIfFiniteState(zero, torch.ones((), dtype=torch.bool, device=device),
                                  zero.clone(), self.inner.init(params))

    def update(self, updates, state, params=None, **extra):
        if not isinstance(state, ApplyIfFiniteState):
            raise ValueError(f"apply_if_finite expects an ApplyIfFiniteState, got "
                             f"{type(state).__name__} (a state made by another transform?)")
        paths, leaves, _ = tree_lib.flatten_with_paths(updates)
        for path, u in zip(paths, leaves):
            if not isinstance(u, torch.Tensor):
                raise TypeError(f"update at {path}: expected a tensor or None, got "
                                f"{type(u).__name__}")
        count = state.notfinite_count
        finite = _all_finite(leaves, count.device)
        notfinite_count = torch.where(finite, torch.zeros_like(count), safe_increment(count))
        apply = finite | (notfinite_count > self.max_consecutive_errors)
        # The inner step always runs (no branch on the device flag); its results are kept
        # only where ``apply`` holds.
        new_updates, new_inner = self.inner.update(updates, state.inner_state, params, **extra)
        inner = tree_lib.map(lambda n, o: where_leaf(apply, n, o), new_inner, state.inner_state)
        total = torch.where(finite, state.total_notfinite,
                            safe_increment(state.total_notfinite))
        return (tree_lib.map(lambda u: _skip(apply, u), new_updates),
                ApplyIfFiniteState(notfinite_count, finite, total, inner))


def apply_if_finite(
    inner: GradientTransformation, max_consecutive_errors: int
) -> GradientTransformation:
    """Runs ``inner`` on steps whose updates are all finite; skips the others (as optax).

    finite = every element of every update leaf is finite (``None`` leaves are ignored);
    n ← 0 if finite else n + 1; apply = finite or n > ``max_consecutive_errors``.
    Where ``apply``: ``inner``'s updates and state. Otherwise updates of ``-0.0`` (so
    ``p + u`` leaves every param bit-identical, a ``-0.0`` one too) and ``inner``'s state
    kept bit-identical. ``total_notfinite`` counts the non-finite steps, ``last_finite``
    records the last one. After more than ``max_consecutive_errors`` non-finite steps in a
    row the update is applied anyway (NaNs and all), as optax does.

    No host synchronisation: the flag stays on the device and outputs are selected with
    ``torch.where``; ``inner`` runs on every step. ``ftopt.step`` runs the wrapper eagerly
    (:func:`ftopt.explain` says so).

    Args:
        inner: the transform to guard.
        max_consecutive_errors: an int >= 0, the number of non-finite steps in a row that
            are skipped.
    """
    obj = ApplyIfFinite(inner, max_consecutive_errors)
    return GradientTransformation(obj.init, obj.update)
