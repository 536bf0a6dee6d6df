"""COCOB-Backprop (Orabona and Tommasi 2017, as optax.contrib): ``scale_by_cocob``, a
learning-rate-free step from coin betting, one elementwise rule."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ftopt.base import GradientTransformation, register_state
from ftopt.domains import NONNEG
from ftopt.rule_transform import rule_transform
from ftopt.rules import Rule, Slot
from ftopt.transforms.adaptive import _host_float

__all__ = ["COCOBState", "scale_by_cocob"]


@register_state
class COCOBState(NamedTuple):
    """optax's layout: the params given to ``init`` (copied), the negated sum of the
    updates, the largest update magnitude seen (from ``eps``), the sum of the update
    magnitudes, and the reward."""

    init_particles: Any
    cumulative_gradients: Any
    scale: Any
    subgradients: Any
    reward: Any


def _cocob_body(o, x):
    scale = o.maximum(x.scale, o.abs(x.u))
    subgradients = x.subgradients + o.abs(x.u)
    # (0 first: a NaN update leaves a NaN reward, as jnp.maximum does)
    reward = o.maximum(0.0, x.reward - x.u * (x.p - x.init_particles))
    cumulative = x.cumulative_gradients - x.u
    bet = cumulative / (scale * o.maximum(subgradients + scale, x.alpha * scale))
    return x.init_particles + bet * (scale + reward) - x.p, {
        "init_particles": x.init_particles, "cumulative_gradients": cumulative,
        "scale": scale, "subgradients": subgradients, "reward": reward}


def scale_by_cocob(alpha: float | torch.Tensor = 100.0,
                   eps: float = 1e-8) -> GradientTransformation:
    """COCOB-Backprop's step, as optax.contrib: with p0 the params given to ``init``,
    L ← max(L, |u|); G ← G + |u|; R ← max(R − u·(p − p0), 0); C ← C − u;
    u ← p0 + C/(L·max(G + L, alpha·L))·(L + R) − p (the update moves the params to that
    point; L starts at ``eps``). Reads the params.

    Args:
        alpha: >= 0 (default: 100.0). eps: the initial L, >= 0 (default: 1e-8).

    With ``state_bits=8`` or 16-bit ``state_dtype`` C, L, G and R are stored in that
    format; p0 (a copy of the params) stays in their compute dtype.
    """
    rule = Rule(
        "scale_by_cocob",
        _cocob_body,
        state_class=COCOBState,
        slots=(Slot("init_particles", from_params=True), Slot("cumulative_gradients"),
               Slot("scale", signed=False, init="eps"), Slot("subgradients", signed=False),
               Slot("reward", signed=False)),
        hparams={"alpha": alpha, "eps": _host_float(eps)},
        domains={"alpha": NONNEG, "eps": NONNEG},
        uses_params=True,
    )
    return rule_transform(rule)
