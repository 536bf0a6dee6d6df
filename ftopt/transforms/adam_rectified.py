"""Adam variants whose early steps differ by the step number: ``scale_by_radam`` (the
variance rectification) and ``scale_by_adopt`` (the first step only measures nu).

Their step-dependent choices are per-step scalars (computed once per step from the count,
on the host or as 0-d tensors), so a body stays one branch-free elementwise expression.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ftopt.base import GradientTransformation
from ftopt.domains import NONNEG, POSITIVE, UNIT_OPEN, Interval
from ftopt.rule_transform import rule_transform
from ftopt.rules import Rule, Slot
from ftopt.transforms.adaptive import ScaleByAdamState

__all__ = ["scale_by_adopt", "scale_by_radam"]

Float = float | torch.Tensor

# RAdam rectifies once the length of the approximated SMA is at least the threshold; below
# 4 the rectification term is the root of a negative number (see scale_by_radam).
RADAM_THRESHOLD = Interval(4.0)


def _select(cond: Any, a: Any, b: Any) -> Any:
    """``a`` where ``cond`` else ``b``: host numbers, or float64 0-d tensors when ``cond``
    is a tensor (a device count, a tensor hyperparameter)."""
    if not isinstance(cond, torch.Tensor):
        return a if cond else b
    a, b = (torch.as_tensor(v, dtype=torch.float64, device=cond.device) for v in (a, b))
    return torch.where(cond, a, b)


def _radam_scalars(nesterov: bool):
    def scalars(t, h):
        b1, b2, threshold = h["b1"], h["b2"], h["threshold"]
        ro_inf = 2.0 / (1 - b2) - 1.0
        b2t = b2**t
        ro = ro_inf - 2 * t * b2t / (1 - b2t)  # 1 at t = 1, rising towards ro_inf
        rectify = ro >= threshold
        s = {"one_minus_b1": 1 - b1, "one_minus_b2": 1 - b2,
             "bc1": 1 - b1**t, "bc2": 1 - b2t,
             "rectify": _select(rectify, 1.0, 0.0),
             "r": _rectification(ro, ro_inf, rectify)}
        if nesterov:
            s["bc1_next"] = 1 - b1 ** (t + 1)
        return s

    return scalars


def _rectification(ro: Any, ro_inf: Any, rectify: Any) -> Any:
    """√((ro−4)(ro−2)ro_inf / ((ro_inf−4)(ro_inf−2)ro)) where ``rectify`` (then 4 <= ro <
    ro_inf, every factor is positive), else 0 (unused)."""
    if not isinstance(rectify, torch.Tensor):
        if not rectify:
            return 0.0
        return math.sqrt((ro - 4) * (ro - 2) * ro_inf / ((ro_inf - 4) * (ro_inf - 2) * ro))
    ro, ro_inf = (torch.as_tensor(v, dtype=torch.float64, device=rectify.device)
                  for v in (ro, ro_inf))
    den = torch.where(rectify, (ro_inf - 4) * (ro_inf - 2) * ro, 1.0)
    ratio = torch.where(rectify, (ro - 4) * (ro - 2) * ro_inf / den, 0.0)
    return ratio.clamp_min(0.0).sqrt()


def scale_by_radam(
    b1: Float = 0.9,
    b2: Float = 0.999,
    eps: Float = 1e-8,
    eps_root: Float = 0.0,
    threshold: Float = 5.0,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    """Rectified Adam's preconditioning, as optax.

    mu, nu, m̂ and v̂ as in :func:`scale_by_adam`; ro∞ = 2/(1−b2) − 1,
    roₜ = ro∞ − 2t·b2ᵗ/(1−b2ᵗ). Where roₜ >= threshold,
    u ← r·m̂/(√(v̂+eps_root)+eps) with r = √((roₜ−4)(roₜ−2)ro∞ / ((ro∞−4)(ro∞−2)roₜ));
    otherwise u ← m̂ (the momentum alone). The branch and r are per-step scalars.

    torch.optim.RAdam rectifies where roₜ > 5 and adds eps to √nu before the bias
    correction (its denominator is √nu/√(1−b2ᵗ) + eps): with eps small against √v̂ the
    two agree.

    Args:
        b1: decay of the first moment, in [0, 1) (default: 0.9).
        b2: decay of the second moment, in [0, 1) (default: 0.999).
        eps: added to the denominator outside the square root, >= 0 (default: 1e-8).
        eps_root: added inside the square root, >= 0 (default: 0.0).
        threshold: the roₜ from which the update is rectified, >= 4 (default: 5.0). Below
            4, r is the root of a negative number (optax returns NaN there).
        nesterov: Nesterov momentum, m̂ as in :func:`scale_by_adam` (default: False).
    """

    def body(o, x):
        mu = o.lerp(x.mu, x.u, x.one_minus_b1)
        nu = o.lerp(x.nu, x.u * x.u, x.one_minus_b2)
        if nesterov:
            mu_hat = x.b1 * mu / x.bc1_next + x.one_minus_b1 * x.u / x.bc1
        else:
            mu_hat = mu / x.bc1
        rectified = x.r * mu_hat / (o.sqrt(nu / x.bc2 + x.eps_root) + x.eps)
        return o.where(x.rectify > 0.5, rectified, mu_hat), {"mu": mu, "nu": nu}

    rule = Rule(
        "scale_by_radam",
        body,
        state_class=ScaleByAdamState,
        slots=(Slot("mu", signed=True), Slot("nu", signed=False)),
        hparams={"b1": b1, "b2": b2, "eps": eps, "eps_root": eps_root,
                 "threshold": threshold},
        domains={"b1": UNIT_OPEN, "b2": UNIT_OPEN, "eps": NONNEG, "eps_root": NONNEG,
                 "threshold": RADAM_THRESHOLD},
        scalars=_radam_scalars(nesterov),
        counted=True,
    )
    return rule_transform(rule)


def quarter_power(count: Any) -> Any:
    """ADOPT's default clipping bound: count^(1/4) (0 on the first step)."""
    return count**0.25


def _adopt_scalars(t, h):
    later = t > 1  # the first step only initializes nu (and leaves mu at zero)
    return {"one_minus_b1": _select(later, 1 - h["b1"], 0.0),
            "one_minus_b2": _select(later, 1 - h["b2"], 1.0)}


def scale_by_adopt(
    b1: Float = 0.9,
    b2: Float = 0.9999,
    eps: Float = 1e-6,
    *,
    nesterov: bool = False,
    use_clipping: bool = True,
    clip_value_fn: Callable[[Any], Any] = quarter_power,
) -> GradientTransformation:
    """ADOPT's preconditioning (as optax.contrib.scale_by_adopt): the update is normalized
    by the second moment of the *previous* steps, then averaged.

    On the first step (count 0): nu ← u², mu stays 0, u ← 0. Afterwards:
    v = u/max(√nu_prev, eps), clipped to [−c, c] with c = clip_value_fn(count) when
    ``use_clipping``; nu ← b2·nu + (1−b2)·u²; mu ← b1·mu + (1−b1)·v; u ← mu, or with
    ``nesterov`` u ← b1·mu + (1−b1)·v. ``count`` is the step count before this step
    (t − 1), as in optax.

    Args:
        b1: decay of the first moment, in [0, 1) (default: 0.9).
        b2: decay of the second moment, in [0, 1) (default: 0.9999).
        eps: the floor of √nu, > 0 (default: 1e-6): 0 would divide a gradient by a zero nu
            (every earlier gradient of the element zero), inf or NaN.
        nesterov: Nesterov momentum (default: False).
        use_clipping: clip the normalized update (default: True).
        clip_value_fn: the clipping bound as a function of the count (default: count^0.25,
            as optax); it is called once per step, like a schedule.
    """

    def body(o, x):
        nu = o.lerp(x.nu, x.u * x.u, x.one_minus_b2)
        normalized = x.u / o.maximum(o.sqrt(x.nu), x.eps)
        if use_clipping:
            # as jnp.clip, a NaN stays NaN (a comparison with NaN is false)
            low = x.clip_value * -1.0
            normalized = o.where(normalized > x.clip_value, x.clip_value,
                                 o.where(normalized < low, low, normalized))
        mu = o.lerp(x.mu, normalized, x.one_minus_b1)
        update = o.lerp(mu, normalized, x.one_minus_b1) if nesterov else mu
        return update, {"mu": mu, "nu": nu}

    hparams: dict[str, Any] = {"b1": b1, "b2": b2, "eps": eps}
    if use_clipping:
        if not callable(clip_value_fn):
            raise TypeError("scale_by_adopt: clip_value_fn must be a function of the step "
                            f"count, got {type(clip_value_fn).__name__}")
        hparams["clip_value"] = clip_value_fn
    rule = Rule(
        "scale_by_adopt",
        body,
        state_class=ScaleByAdamState,
        slots=(Slot("mu", signed=True), Slot("nu", signed=False)),
        hparams=hparams,
        domains={"b1": UNIT_OPEN, "b2": UNIT_OPEN, "eps": POSITIVE},
        scalars=_adopt_scalars,
        counted=True,
    )
    return rule_transform(rule)
