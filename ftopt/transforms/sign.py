"""Sign-based transforms: ``scale_by_sign``, ``scale_by_lion``, ``scale_by_ano``."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from ftopt.base import GradientTransformation, register_state
from ftopt.domains import NONNEG, UNIT, UNIT_OPEN
from ftopt.rule_transform import rule_transform
from ftopt.rules import Rule, Slot
from ftopt.transforms.adaptive import ScaleByAdamState


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


def _ano_body(o, x):
    mu = o.lerp(x.mu, x.u, x.one_minus_b1)
    g2 = x.u * x.u
    nu = x.b2 * x.nu + x.one_minus_b2 * o.sign(g2 - x.nu) * g2
    return o.abs(x.u) * o.sign(mu) / o.sqrt(nu / x.bc2 + x.eps), {"mu": mu, "nu": nu}


def _ano_scalars(logarithmic: bool):
    def scalars(t, h):
        b1 = h["b1"]
        if logarithmic:  # 1 − 1/log(max(2, t))
            b1 = (1.0 - 1.0 / torch.log(torch.clamp(t.to(torch.float64), min=2.0))
                  if isinstance(t, torch.Tensor) else 1.0 - 1.0 / math.log(max(2, t)))
        return {"one_minus_b1": 1 - b1, "one_minus_b2": 1 - h["b2"], "bc2": 1 - h["b2"] ** t}
    return scalars


def scale_by_ano(b1: float | torch.Tensor = 0.92, b2: float | torch.Tensor = 0.99,
                 eps: float | torch.Tensor = 1e-8,
                 logarithmic_schedule: bool = False) -> GradientTransformation:
    """Ano (optax.contrib's ``scale_by_ano``): the sign of the momentum, the gradient's
    magnitude, and a Yogi-like second moment.

    mu ← b1·mu + (1−b1)·u; nu ← b2·nu + (1−b2)·sign(u² − nu)·u²;
    u ← |u|·sign(mu) / √(nu/(1−b2ᵗ) + eps). ``logarithmic_schedule``: b1 = 1 − 1/log(max(2,
    t)) at step t instead (as optax: below 0 for the first steps). The state is a
    ``ScaleByAdamState`` (count, mu, nu); nu stays >= 0 for b2 >= 0.5 (it loses at most
    (1−b2)·u² < (1−b2)·nu a step), and its 8-bit map is the unsigned one.

    Args:
        b1: momentum decay, in [0, 1] (default: 0.92).
        b2: second-moment decay, in [0, 1) (default: 0.99).
        eps: added under the square root, >= 0 (default: 1e-8).
        logarithmic_schedule: b1 from the step count (default: False).
    """
    rule = Rule(
        "scale_by_ano", _ano_body, state_class=ScaleByAdamState,
        slots=(Slot("mu"), Slot("nu", signed=False)),
        hparams={"b1": b1, "b2": b2, "eps": eps},
        domains={"b1": UNIT, "b2": UNIT_OPEN, "eps": NONNEG},
        scalars=_ano_scalars(bool(logarithmic_schedule)), counted=True,
    )
    return rule_transform(rule)
