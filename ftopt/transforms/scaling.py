"""Scaling transforms: ``scale``, ``scale_by_schedule``, ``scale_by_learning_rate``,
``add_decayed_weights``, ``add_cautious_weight_decay``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ftopt.base import EmptyState, GradientTransformation, register_state
from ftopt.domains import NONNEG
from ftopt.rule_transform import rule_transform
from ftopt.rules import Rule
from ftopt.schedules import ScalarOrSchedule, Schedule


@register_state
class ScaleByScheduleState(NamedTuple):
    """The step count of a scheduled learning rate."""

    count: torch.Tensor


def _scale_body(o, x):
    return x.u * x.step_size, {}


def scale(step_size: float | torch.Tensor) -> GradientTransformation:
    """Scales updates: u ← step_size·u.

    Args:
        step_size: a finite float or 0-d tensor (any sign).
    """
    return rule_transform(Rule("scale", _scale_body, hparams={"step_size": step_size}))


def identity() -> GradientTransformation:
    """Leaves updates unchanged: u ← u (a scale by 1, so a chain holding it still fuses)."""
    return scale(1.0)


def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    """Scales updates by a schedule of the step count, as optax: u ← s(count)·u.

    The count is 0 on the first step and kept in ``ScaleByScheduleState.count``; the
    value is used as it is, any sign (:func:`scale_by_learning_rate` negates a learning
    rate instead).

    Args:
        step_size_fn: a schedule (any callable of the count: :mod:`ftopt.schedules`).
    """
    if not callable(step_size_fn):
        raise TypeError(f"scale_by_schedule: step_size_fn must be a schedule (a callable of "
                        f"the step count), got {type(step_size_fn).__name__}; use scale() "
                        f"for a constant")
    rule = Rule("scale_by_schedule", _scale_body, state_class=ScaleByScheduleState,
                hparams={"step_size_fn": step_size_fn},
                scalars=lambda t, h: {"step_size": h["step_size_fn"]}, counted=True)
    return rule_transform(rule)


def scale_by_learning_rate(
    learning_rate: ScalarOrSchedule, *, flip_sign: bool = True
) -> GradientTransformation:
    """Scales updates by the learning rate: u ← −lr·u (u ← lr·u with ``flip_sign=False``).

    Args:
        learning_rate: a float >= 0, a 0-d tensor, or a schedule called with the step
            count (0 on the first step, as in optax).
        flip_sign: negate the update, so that ``apply_updates`` descends (default: True).
    """
    sign = -1.0 if flip_sign else 1.0
    scheduled = callable(learning_rate)
    rule = Rule(
        "scale_by_learning_rate",
        _scale_body,
        state_class=ScaleByScheduleState if scheduled else EmptyState,
        hparams={"learning_rate": learning_rate},
        domains={"learning_rate": NONNEG},  # as torch.optim; the sign is flip_sign's
        scalars=lambda t, h: {"step_size": sign * h["learning_rate"]},
        counted=scheduled,
    )
    return rule_transform(rule)


@register_state
class WeightDecaySchedule(NamedTuple):
    """The step count of a scheduled weight decay (optax's name)."""

    count: torch.Tensor


def _decay_body(o, x):
    return x.u + x.weight_decay * x.p, {}


def _cautious_decay_body(o, x):
    # sign(u)·sign(p) >= 0, not u·p >= 0: a product that underflows to 0 decays nothing extra
    aligned = o.sign(x.u) * o.sign(x.p) >= 0.0
    return o.where(aligned, x.u + x.weight_decay * x.p, x.u), {}


def _decay_rule(name: str, body, weight_decay: ScalarOrSchedule, mask: Any) -> Rule:
    scheduled = callable(weight_decay)
    return Rule(name, body, state_class=WeightDecaySchedule if scheduled else EmptyState,
                hparams={"weight_decay": weight_decay}, domains={"weight_decay": NONNEG},
                uses_params=True, leaf_mask=mask, counted=scheduled)


def add_decayed_weights(
    weight_decay: ScalarOrSchedule = 0.0, mask: Any = None
) -> GradientTransformation:
    """Adds decayed weights: u ← u + wd·p.

    Args:
        weight_decay: a float >= 0, a 0-d tensor, or a schedule called with the step count
            (0 on the first step; the count is kept in ``WeightDecaySchedule``, as optax)
            (default: 0.0).
        mask: a pytree of bools like the params (or a function of the params returning
            one); leaves marked False are passed through unchanged (default: all leaves).
    """
    return rule_transform(_decay_rule("add_decayed_weights", _decay_body, weight_decay, mask))


def add_cautious_weight_decay(
    weight_decay: ScalarOrSchedule = 0.0, mask: Any = None
) -> GradientTransformation:
    """Cautious weight decay (optax.contrib's): u ← u + wd·p where u and p do not have
    opposite signs (sign(u)·sign(p) >= 0, so also where either is 0), u elsewhere.

    Placed after the optimizer's scaling and before the learning rate, the decay only
    acts where it pulls p the way the update already does (Chen et al., 2025).

    Args:
        weight_decay: a float >= 0, a 0-d tensor or a schedule of the step count, as
            :func:`add_decayed_weights` (default: 0.0).
        mask: as :func:`add_decayed_weights` (default: all leaves).
    """
    return rule_transform(_decay_rule("add_cautious_weight_decay", _cautious_decay_body,
                                      weight_decay, mask))


weight_decay = add_decayed_weights
