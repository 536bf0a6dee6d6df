"""Sign-based transforms: ``scale_by_sign``, ``scale_by_lion``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ftopt.base import GradientTransformation, register_state
from ftopt.domains import UNIT
from ftopt.rule_transform import rule_transform
from ftopt.rules import Rule, Slot


@register_state
class ScaleByLionState(NamedTuple):
    """Lion's step count and momentum."""

    count: torch.Tensor
    mu: Any


def _sign_body(o, x):
    return o.sign(x.u), {}


def scale_by_sign() -> GradientTransformation:
    """The sign of the update: u ← sign(u) (sign(0) = 0), as optax.

    signSGD is ``chain(scale_by_sign(), scale_by_learning_rate(lr))``.
    """
    return rule_transform(Rule("scale_by_sign", _sign_body))


def _lion_body(o, x):
    direction = o.sign(o.lerp(x.mu, x.u, x.one_minus_b1))  # sign(b1·mu + (1−b1)·u)
    mu = o.lerp(x.mu, x.u, x.one_minus_b2)
    return direction, {"mu": mu}


def scale_by_lion(
    b1: float | torch.Tensor = 0.9, b2: float | torch.Tensor = 0.99
) -> GradientTransformation:
    """Lion: u ← sign(b1·mu + (1−b1)·u) (sign(0) = 0); mu ← b2·mu + (1−b2)·u.

    Args:
        b1: interpolation of the update direction, in [0, 1] (default: 0.9).
        b2: decay of the momentum, in [0, 1] (default: 0.99).
    """
    rule = Rule(
        "scale_by_lion",
        _lion_body,
        state_class=ScaleByLionState,
        slots=(Slot("mu"),),
        hparams={"b1": b1, "b2": b2},
        domains={"b1": UNIT, "b2": UNIT},
        scalars=lambda t, h: {"one_minus_b1": 1 - h["b1"], "one_minus_b2": 1 - h["b2"]},
        counted=True,
    )
    return rule_transform(rule)
