"""Adan's preconditioning: ``scale_by_adan`` (adaptive Nesterov momentum)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ftopt.base import GradientTransformation, register_state
from ftopt.domains import NONNEG, UNIT_OPEN
from ftopt.rule_transform import rule_transform
from ftopt.rules import Rule, Slot

__all__ = ["ScaleByAdanState", "scale_by_adan"]

Float = float | torch.Tensor


@register_state
class ScaleByAdanState(NamedTuple):
    """Adan's step count (optax calls it ``t``), the EMAs of the gradients (m), of their
    differences (v) and of the squared Nesterov term (n), and the previous gradient (g)."""

    count: torch.Tensor
    m: Any
    v: Any
    n: Any
    g: Any


def _adan_scalars(t, h):
    first = t <= 1  # no previous gradient yet: the difference is 0
    if isinstance(first, torch.Tensor):
        first = first.to(torch.float64)
    b1, b2, b3 = h["b1"], h["b2"], h["b3"]
    return {"first": float(first) if isinstance(first, bool) else first,
            "one_minus_b1": 1 - b1, "one_minus_b2": 1 - b2, "one_minus_b3": 1 - b3,
            "bc1": 1 - b1**t, "bc2": 1 - b2**t, "bc3": 1 - b3**t}


def _adan_body(o, x):
    diff = o.where(x.first > 0.5, 0.0, x.u - x.g)
    m = o.lerp(x.m, x.u, x.one_minus_b1)  # b1·m + (1−b1)·u
    v = o.lerp(x.v, diff, x.one_minus_b2)
    nesterov = x.u + x.one_minus_b2 * diff
    n = o.lerp(x.n, nesterov * nesterov, x.one_minus_b3)
    direction = m / x.bc1 + x.one_minus_b2 * (v / x.bc2)
    update = direction / (o.sqrt(n / x.bc3 + x.eps_root) + x.eps)
    return update, {"m": m, "v": v, "n": n, "g": x.u}


def scale_by_adan(
    b1: Float = 0.98,
    b2: Float = 0.92,
    b3: Float = 0.99,
    eps: Float = 1e-8,
    eps_root: Float = 0.0,
) -> GradientTransformation:
    """Adan's preconditioning, as optax's code computes it.

    d = u − g_prev (0 on the first step); m ← b1·m + (1−b1)·u; v ← b2·v + (1−b2)·d;
    n ← b3·n + (1−b3)·(u + (1−b2)·d)²; g_prev ← u;
    u ← (m̂ + (1−b2)·v̂)/(√(n̂ + eps_root) + eps), each hat the bias-corrected moment
    (x̂ = x/(1−bᵗ)).

    optax's docstring writes the EMAs with b and 1−b swapped; its code (and this) keeps a
    fraction b of the old moment. The authors' PyTorch Adan (sail-sg/Adan) is the same math
    with the betas given as 1−b (their ``betas=(0.02, 0.08, 0.01)``) and a proximal weight
    decay p ← (p − lr·u)/(1 + lr·wd); :func:`ftopt.adan` decays as optax does
    (``add_decayed_weights``: p ← p − lr·(u + wd·p)).

    Args:
        b1: decay of the gradient EMA, in [0, 1) (default: 0.98).
        b2: decay of the EMA of gradient differences, in [0, 1) (default: 0.92).
        b3: decay of the EMA of the squared Nesterov term, in [0, 1) (default: 0.99).
        eps: added to the denominator outside the square root, >= 0 (default: 1e-8).
        eps_root: added inside the square root, >= 0 (default: 0.0).
    """
    rule = Rule(
        "scale_by_adan",
        _adan_body,
        state_class=ScaleByAdanState,
        slots=(Slot("m"), Slot("v"), Slot("n", signed=False), Slot("g")),
        hparams={"b1": b1, "b2": b2, "b3": b3, "eps": eps, "eps_root": eps_root},
        domains={"b1": UNIT_OPEN, "b2": UNIT_OPEN, "b3": UNIT_OPEN, "eps": NONNEG,
                 "eps_root": NONNEG},
        scalars=_adan_scalars,
        counted=True,
    )
    return rule_transform(rule)
