"""MARS (optax.contrib's ``scale_by_mars``): Adam on a variance-reduced gradient.

A chain of three fused stages: the correction (it keeps the previous gradient), the clip
to a global norm (on the fused path a reduction pass over the corrected gradient before
the main kernel) and Adam. As separate stages, the clip's norm sees the corrected
gradient as the chain hands it on: with ``skip_zeros``, 0 where the raw gradient is zero
(SPEC §3).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ftopt.base import GradientTransformation, register_state
from ftopt.combine import chain
from ftopt.domains import NONNEG, POSITIVE, UNIT_OPEN
from ftopt.rule_transform import rule_transform
from ftopt.rules import Rule, Slot
from ftopt.transforms.adaptive import scale_by_adam

__all__ = ["MarsCorrectionState", "scale_by_mars"]


@register_state
class MarsCorrectionState(NamedTuple):
    """The previous step's gradient (MARS's correction reads it)."""

    last_grad: Any


def _correction_body(o, x):
    return x.u + x.k * (x.u - x.last_grad), {"last_grad": x.u}


def _clip_body(o, x):
    return x.u * o.minimum(x.clip_threshold / (o.global_norm(x.u) + 1e-12), 1.0), {}


def scale_by_mars(b1: float | torch.Tensor = 0.95, b2: float | torch.Tensor = 0.99,
                  eps: float | torch.Tensor = 1e-8, gamma: float | torch.Tensor = 0.025,
                  clip_threshold: float | None = 1.0) -> GradientTransformation:
    """MARS's update (optax.contrib's ``scale_by_mars``, the approximate variant).

    c = u + γ·b1/(1−b1)·(u − u_prev) (u_prev: the previous step's gradient, 0 at first);
    with ``clip_threshold``, c ← c·min(1, clip_threshold/(‖c‖ + 1e-12)), ‖c‖ over all
    leaves; then Adam on c (``scale_by_adam(b1, b2, eps)``). ``gamma=0`` and no clip is
    Adam. The state is the three stages' (``MarsCorrectionState(last_grad)``, the clip's
    ``EmptyState``, ``ScaleByAdamState(count, mu, nu)``; optax keeps the four in one).

    Args:
        b1: momentum decay, in [0, 1) (default: 0.95).
        b2: second-moment decay, in [0, 1) (default: 0.99).
        eps: added to √v̂, >= 0 (default: 1e-8).
        gamma: the variance reduction's weight, >= 0 (default: 0.025).
        clip_threshold: the largest global norm of c, > 0, or ``None`` (default: 1.0).
    """
    correction = rule_transform(Rule(
        "mars_correction", _correction_body, state_class=MarsCorrectionState,
        slots=(Slot("last_grad"),), hparams={"b1": b1, "gamma": gamma},
        domains={"b1": UNIT_OPEN, "gamma": NONNEG},
        scalars=lambda t, h: {"k": h["gamma"] * h["b1"] / (1 - h["b1"])}))
    parts = [correction]
    if clip_threshold is not None:
        parts.append(rule_transform(Rule(
            "mars_clip", _clip_body, hparams={"clip_threshold": clip_threshold},
            domains={"clip_threshold": POSITIVE})))
    return chain(*parts, scale_by_adam(b1, b2, eps))
