"""MADGRAD: ``scale_by_madgrad`` (momentumized, adaptive dual averaging)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ftopt.base import GradientTransformation, register_state
from ftopt.domains import NONNEG, UNIT_OPEN
from ftopt.rule_transform import rule_transform
from ftopt.rules import Rule, Slot
from ftopt.schedules import ScalarOrSchedule

__all__ = ["MadgradState", "scale_by_madgrad"]


@register_state
class MadgradState(NamedTuple):
    """MADGRAD's step count, weighted sums of squared gradients and of gradients, and the
    initial params x0."""

    count: torch.Tensor
    grad_sum_sq: Any
    s: Any
    x0: Any


def _madgrad_scalars(t, h):
    # lamb = (lr + eps)·√(k+1), k the count before this step (t − 1)
    return {"lamb": (h["learning_rate"] + h["eps"]) * t**0.5,
            "one_minus_momentum": 1 - h["momentum"]}


def _madgrad_body(o, x):
    grad_sum_sq = x.grad_sum_sq + x.lamb * (x.u * x.u)
    s = x.s + x.lamb * x.u
    # (1−momentum)·z + momentum·p − p with z = x0 − s/(∛G + eps), written as
    # (1−momentum)·(z − p) so the update does not lose digits to p − p.
    to_z = (x.x0 - x.p) - s / (o.cbrt(grad_sum_sq) + x.eps)
    return x.one_minus_momentum * to_z, {"grad_sum_sq": grad_sum_sq, "s": s, "x0": x.x0}


def scale_by_madgrad(
    learning_rate: ScalarOrSchedule,
    momentum: float | torch.Tensor = 0.9,
    eps: float | torch.Tensor = 1e-6,
) -> GradientTransformation:
    """MADGRAD's step, as optax.contrib (and facebookresearch/madgrad): the update moves
    the params themselves, so the learning rate is part of it (no
    ``scale_by_learning_rate`` after it).

    lamb = (lr + eps)·√t; G ← G + lamb·u²; s ← s + lamb·u; z = x0 − s/(∛G + eps);
    u ← (1−momentum)·z + momentum·p − p. x0 is the params given to ``init`` (copied).
    The learning rate is read at the step count before the step (0 first), as optax.

    Args:
        learning_rate: a float >= 0, a 0-d tensor or a schedule of the count.
        momentum: in [0, 1) (default: 0.9); 0 makes the params the dual average z.
        eps: added to the learning rate and to ∛G, >= 0 (default: 1e-6).

    With ``state_bits=8`` or 16-bit ``state_dtype`` G and s are stored in that format;
    x0 (a copy of the params) stays in their compute dtype (:class:`ftopt.rules.Slot`'s
    ``from_params``), so z carries no rounding of it. A donated fused step never writes
    x0 (the rule returns it as it was).
    """
    rule = Rule(
        "scale_by_madgrad",
        _madgrad_body,
        state_class=MadgradState,
        slots=(Slot("grad_sum_sq", signed=False), Slot("s"), Slot("x0", from_params=True)),
        hparams={"learning_rate": learning_rate, "momentum": momentum, "eps": eps},
        domains={"learning_rate": NONNEG, "momentum": UNIT_OPEN, "eps": NONNEG},
        scalars=_madgrad_scalars,
        counted=True,
        uses_params=True,
    )
    return rule_transform(rule)
