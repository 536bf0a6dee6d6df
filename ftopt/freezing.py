"""Freezing parameters, as optax: ``set_to_zero``, ``freeze`` (zero updates where a mask
is True) and ``selective_transform`` (an optimizer for the other leaves only, no state for
the frozen ones); ``multi_transform``, optax's older name of :func:`ftopt.partition`."""

from __future__ import annotations

from typing import Any

from ftopt import tree as tree_lib
from ftopt.base import GradientTransformation
from ftopt.combine import masked, partition
from ftopt.rule_transform import rule_transform
from ftopt.rules import Rule

__all__ = ["set_to_zero", "freeze", "selective_transform", "multi_transform"]

multi_transform = partition  # optax's name before partition


def _zero_body(o, x):
    return o.where(x.u != x.u, 0.0, 0.0), {}  # +0.0 everywhere, NaN and -0.0 too


def set_to_zero() -> GradientTransformation:
    """Replaces every update by zero: u ← +0.0 (NaN and −0.0 too; ``None`` leaves stay
    ``None``). An elementwise rule, so a chain holding it still fuses."""
    return rule_transform(Rule("set_to_zero", _zero_body))


def _mask_tree(mask: Any):
    """``mask`` as :func:`ftopt.masked` takes it: a bool applies to every leaf."""
    if isinstance(mask, bool):
        return lambda tree: tree_lib.map(lambda _: mask, tree)
    return mask


def freeze(mask: bool | Any) -> GradientTransformation:
    """Zeros the updates of the leaves where ``mask`` is True (they stay as they are);
    the others pass through: ``masked(set_to_zero(), mask)``, as optax.

    Args:
        mask: a bool (every leaf frozen, or none), a pytree of bools shaped like the
            params (True: frozen), or a function of the params returning one.
    """
    return masked(set_to_zero(), _mask_tree(mask))


def selective_transform(optimizer: GradientTransformation, *,
                        freeze_mask: bool | Any) -> GradientTransformation:
    """Runs ``optimizer`` on the leaves where ``freeze_mask`` is False and zeros the
    updates of the others, which get no optimizer state: a :func:`ftopt.partition` of
    ``{"train": optimizer, "freeze": set_to_zero()}``, as optax.

    Args:
        optimizer: the optimizer of the trained leaves.
        freeze_mask: a bool, a pytree of bools shaped like the params (True: frozen), or
            a function of the params returning one.
    """
    mask = _mask_tree(freeze_mask)

    def labels(params):
        flags = mask(params) if callable(mask) else mask
        return tree_lib.map(lambda frozen: "freeze" if frozen else "train", flags)

    return partition({"train": optimizer, "freeze": set_to_zero()}, labels)
