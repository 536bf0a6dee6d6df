"""Rprop: ``scale_by_rprop`` (per-element step sizes driven by gradient signs)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ftopt.base import GradientTransformation, register_state
from ftopt.domains import NONNEG, POSITIVE
from ftopt.rule_transform import rule_transform
from ftopt.rules import Rule, Slot

__all__ = ["ScaleByRpropState", "scale_by_rprop"]

Float = float | torch.Tensor


@register_state
class ScaleByRpropState(NamedTuple):
    """Rprop's per-element step sizes and previous updates (optax's layout)."""

    step_sizes: Any
    prev_updates: Any


def _rprop_body(o, x):
    agree = x.u * x.prev_updates  # > 0: same sign as last time, < 0: it flipped
    scaled = o.where(agree > 0.0, x.step_sizes * x.eta_plus, x.step_sizes * x.eta_minus)
    clipped = o.minimum(o.maximum(scaled, x.min_step_size), x.max_step_size)
    step_sizes = o.where(agree == 0.0, x.step_sizes, clipped)
    flipped = agree < 0.0
    prev_updates = o.where(flipped, 0.0, step_sizes * o.sign(x.u))
    update = o.where(flipped, 0.0, x.prev_updates)
    return update, {"step_sizes": step_sizes, "prev_updates": prev_updates}


def scale_by_rprop(
    learning_rate: float,
    eta_minus: Float = 0.5,
    eta_plus: Float = 1.2,
    min_step_size: Float = 1e-6,
    max_step_size: Float = 50.0,
) -> GradientTransformation:
    """Rprop's scaling, as optax's code computes it.

    a = u·prev; step ← step where a = 0, else clip(step·(eta_plus if a > 0 else
    eta_minus), min_step_size, max_step_size); prev_new ← 0 where a < 0, else
    step·sign(u); u ← 0 where a < 0, else the *previous* prev. Step sizes start at
    ``learning_rate``, prev at 0.

    As in optax the update lags one step (the first update is 0, the step for the sign of
    uₜ is returned at step t+1); :func:`ftopt.rprop` negates it (``scale(-1.0)``).
    torch.optim.Rprop applies step·sign(uₜ) at step t (0 where the sign flipped) and
    clips the step sizes to (min, max) as ``step_sizes=``. sign(NaN) is 0 here (as in
    :func:`ftopt.scale_by_sign`), so a NaN gradient leaves no NaN in the state (optax's
    ``jnp.sign`` keeps it).

    Args:
        learning_rate: the initial step size, >= 0 (a number: it only fills the state).
        eta_minus: the factor of the step size where the sign flipped, >= 0 (default: 0.5).
        eta_plus: the factor where it agreed, >= 0 (default: 1.2).
        min_step_size: the smallest step size, >= 0 (default: 1e-6).
        max_step_size: the largest step size, > 0 (default: 50.0).
    """
    rule = Rule(
        "scale_by_rprop",
        _rprop_body,
        state_class=ScaleByRpropState,
        slots=(Slot("step_sizes", signed=False, init="learning_rate"), Slot("prev_updates")),
        hparams={"learning_rate": _host_float(learning_rate), "eta_minus": eta_minus,
                 "eta_plus": eta_plus, "min_step_size": min_step_size,
                 "max_step_size": max_step_size},
        domains={"learning_rate": NONNEG, "eta_minus": NONNEG, "eta_plus": NONNEG,
                 "min_step_size": NONNEG, "max_step_size": POSITIVE},
    )
    return rule_transform(rule)


def _host_float(x: Any) -> Any:
    # An initial state value: a float (``bool`` and other types reach the check unchanged).
    return float(x) if isinstance(x, (int, float, torch.Tensor)) and not isinstance(x, bool) \
        else x
