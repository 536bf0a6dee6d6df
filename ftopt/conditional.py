"""``conditionally_transform`` and ``conditionally_mask`` (as optax): run the inner
transform only on the steps a condition of the call count picks.

The condition may be decided on the device: it is called with the count (a 0-d int32
tensor) and may return a 0-d bool tensor, in which case the inner step always runs and
every output leaf is ``torch.where(flag, new, old)`` (no host synchronisation, as
:func:`ftopt.apply_if_finite`); a Python bool picks a branch on the host and runs the
inner step only when it is taken.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch

from ftopt import tree as tree_lib
from ftopt.base import GradientTransformation, register_owner, register_state
from ftopt.finite import safe_increment, where_leaf

__all__ = ["ConditionallyTransformState", "ConditionallyMaskState",
           "conditionally_transform", "conditionally_mask"]

# Keywords ftopt itself passes down a chain: never a condition's arguments.
_OWN_EXTRA = ("zero_mask", "backend")


class ConditionFn(Protocol):
    """optax's type of ``should_transform_fn``: the step count (a 0-d int32 tensor) and,
    with ``forward_extra_args``, the update's extra keywords, to a bool or 0-d bool
    tensor."""

    def __call__(self, step: torch.Tensor, **extra_args: Any) -> Any: ...


@register_state
class ConditionallyTransformState(NamedTuple):
    """The inner state and the count of calls so far (optax's layout)."""

    inner_state: Any
    step: torch.Tensor


@register_state
class ConditionallyMaskState(NamedTuple):
    """The count of calls so far and the inner state (optax's layout)."""

    step: torch.Tensor
    inner_state: Any


class Conditionally:
    """The object behind :func:`conditionally_transform` and :func:`conditionally_mask`."""

    unfused_reason = ("conditionally_transform and conditionally_mask run eagerly: they "
                      "select between the inner step and none on the condition")

    def __init__(self, name: str, inner: GradientTransformation,
                 should_transform_fn: ConditionFn, forward_extra_args: bool):
        if not isinstance(inner, GradientTransformation):
            raise TypeError(f"{name}: inner must be a GradientTransformation, got "
                            f"{type(inner).__name__}")
        if not callable(should_transform_fn):
            raise TypeError(f"{name}: should_transform_fn must be a function of the step "
                            f"count, got {type(should_transform_fn).__name__}")
        self.name, self.inner = name, inner
        self.should_transform_fn = should_transform_fn
        self.forward_extra_args = bool(forward_extra_args)
        self.masks = name == "conditionally_mask"
        self.state_class = ConditionallyMaskState if self.masks else ConditionallyTransformState
        register_owner(self)

    @property
    def transforms(self) -> tuple[GradientTransformation, ...]:
        return (self.inner,)

    def rebuild(self, transforms: Sequence[GradientTransformation]) -> GradientTransformation:
        obj = Conditionally(self.name, transforms[0], self.should_transform_fn,
                            self.forward_extra_args)
        return GradientTransformation(obj.init, obj.update)

    def _state(self, step: torch.Tensor, inner: Any):
        return self.state_class(step=step, inner_state=inner)

    def init(self, params):
        flat = tree_lib.leaves(params)
        device = flat[0].device if flat and isinstance(flat[0], torch.Tensor) else None
        return self._state(torch.zeros((), dtype=torch.int32, device=device),
                           self.inner.init(params))

    def _rejected(self, updates):
        if not self.masks:
            return updates
        # -0.0, not optax's +0.0: ``p + u`` then keeps every param's bits, -0.0 too
        return tree_lib.map(lambda u: torch.full_like(u, -0.0), updates)

    def update(self, updates, state, params=None, **extra):
        if not isinstance(state, self.state_class):
            raise ValueError(f"{self.name} expects a {self.state_class.__name__}, got "
                             f"{type(state).__name__} (a state made by another transform?)")
        kwargs = ({k: v for k, v in extra.items() if k not in _OWN_EXTRA}
                  if self.forward_extra_args else {})
        flag = self.should_transform_fn(state.step, **kwargs)
        step = safe_increment(state.step)
        if not isinstance(flag, torch.Tensor):
            if not flag:
                return self._rejected(updates), self._state(step, state.inner_state)
            new_updates, new_inner = self.inner.update(updates, state.inner_state, params,
                                                       **extra)
            return new_updates, self._state(step, new_inner)
        if flag.shape != () or flag.dtype != torch.bool:
            raise ValueError(f"{self.name}: should_transform_fn must return a bool or a 0-d "
                             f"bool tensor, got a {flag.dtype} tensor of shape "
                             f"{tuple(flag.shape)}")
        new_updates, new_inner = self.inner.update(updates, state.inner_state, params, **extra)
        inner = tree_lib.map(lambda n, o: where_leaf(flag, n, o), new_inner, state.inner_state)
        out = tree_lib.map(lambda n, o: where_leaf(flag, n, o), new_updates,
                           self._rejected(updates))
        return out, self._state(step, inner)


def conditionally_transform(inner: GradientTransformation,
                            should_transform_fn: ConditionFn,
                            forward_extra_args: bool = False) -> GradientTransformation:
    """Runs ``inner`` on the calls where ``should_transform_fn(step)`` holds; on the
    others the updates pass through unchanged and ``inner``'s state is kept (as optax).

    Args:
        inner: the transform to run.
        should_transform_fn: a function of ``step`` (the calls before this one, a 0-d int32
            tensor) returning a bool or a 0-d bool tensor (decided on the device: no host
            synchronisation, ``inner`` runs on every call and its results are selected).
        forward_extra_args: also pass the keyword arguments of ``update`` to it.
    """
    obj = Conditionally("conditionally_transform", inner, should_transform_fn,
                        forward_extra_args)
    return GradientTransformation(obj.init, obj.update)


def conditionally_mask(inner: GradientTransformation,
                       should_transform_fn: ConditionFn,
                       forward_extra_args: bool = False) -> GradientTransformation:
    """Runs ``inner`` on the calls where ``should_transform_fn(step)`` holds; on the
    others the updates are zero (``-0.0``: ``p + u`` keeps every param's bits) and
    ``inner``'s state is kept (as optax, which writes ``+0.0``).

    Args: as :func:`conditionally_transform`.
    """
    obj = Conditionally("conditionally_mask", inner, should_transform_fn, forward_extra_args)
    return GradientTransformation(obj.init, obj.update)
