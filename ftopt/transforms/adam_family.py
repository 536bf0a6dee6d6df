"""Adam's relatives with their own moment updates: ``scale_by_adamax``,
``scale_by_amsgrad``, ``scale_by_belief`` (AdaBelief), ``scale_by_yogi``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ftopt.base import GradientTransformation, register_state
from ftopt.domains import NONNEG, UNIT_OPEN
from ftopt.rule_transform import rule_transform
from ftopt.rules import Rule, Slot
from ftopt.transforms.adaptive import ScaleByAdamState, moment_rule, moment_scalars

__all__ = ["ScaleByAmsgradState", "ScaleByBeliefState", "scale_by_adamax", "scale_by_amsgrad",
           "scale_by_belief", "scale_by_yogi"]

Float = float | torch.Tensor


@register_state
class ScaleByAmsgradState(NamedTuple):
    """AMSGrad's step count, first and second moments and running maximum of the second."""

    count: torch.Tensor
    mu: Any
    nu: Any
    nu_max: Any


@register_state
class ScaleByBeliefState(NamedTuple):
    """AdaBelief's step count, first moment and second moment of the prediction error."""

    count: torch.Tensor
    mu: Any
    nu: Any


def _mu_hat(x, mu, nesterov: bool):
    """The bias-corrected first moment, Nesterov's look-ahead as optax computes it."""
    if nesterov:
        return x.b1 * mu / x.bc1_next + x.one_minus_b1 * x.u / x.bc1
    return mu / x.bc1


def _adamax_body(o, x):
    mu = o.lerp(x.mu, x.u, x.one_minus_b1)  # b1·mu + (1−b1)·u
    nu = o.maximum(x.b2 * x.nu, o.abs(x.u) + x.eps)
    return mu / x.bc1 / nu, {"mu": mu, "nu": nu}


def scale_by_adamax(
    b1: Float = 0.9,
    b2: Float = 0.999,
    eps: Float = 1e-8,
) -> GradientTransformation:
    """Adamax's preconditioning (Adam with the infinity norm), as optax.

    mu ← b1·mu + (1−b1)·u; nu ← max(b2·nu, |u| + eps); u ← mu/(1−b1ᵗ)/nu. nu is not
    bias-corrected. This is torch.optim.Adamax's math too (its ``weight_decay`` is an L2
    term added to the gradient: ``chain(add_decayed_weights(wd), scale_by_adamax(...),
    scale_by_learning_rate(lr))``).

    Args:
        b1: decay of the first moment, in [0, 1) (default: 0.9).
        b2: decay of the infinity norm, in [0, 1) (default: 0.999).
        eps: added to |u|, >= 0 (default: 1e-8). With eps = 0, an element whose gradients
            were all zero divides 0 by 0, as in optax.
    """
    rule = Rule(
        "scale_by_adamax",
        _adamax_body,
        state_class=ScaleByAdamState,
        slots=(Slot("mu", signed=True), Slot("nu", signed=False)),
        hparams={"b1": b1, "b2": b2, "eps": eps},
        domains={"b1": UNIT_OPEN, "b2": UNIT_OPEN, "eps": NONNEG},
        scalars=moment_scalars(),
        counted=True,
    )
    return rule_transform(rule)


def scale_by_amsgrad(
    b1: Float = 0.9,
    b2: Float = 0.999,
    eps: Float = 1e-8,
    eps_root: Float = 0.0,
    *,
    bias_correction_mu: bool = True,
    bias_correction_nu: bool = True,
) -> GradientTransformation:
    """AMSGrad's preconditioning (Adam with a running maximum of the second moment), as
    optax.

    mu ← b1·mu + (1−b1)·u; nu ← b2·nu + (1−b2)·u²;
    nu_max ← max(nu_max, nu/(1−b2ᵗ)); u ← m̂/(√(nu_max+eps_root)+eps), m̂ = mu/(1−b1ᵗ).
    ``bias_correction_mu=False`` uses m̂ = mu, ``bias_correction_nu=False`` takes the
    maximum of the uncorrected nu (the original paper: both False). The switches are
    keyword-only (optax takes ``mu_dtype`` before them).

    torch.optim.Adam(amsgrad=True) differs: it keeps the maximum of the *uncorrected* nu and
    divides that by the current 1−b2ᵗ (``max(nu)/(1−b2ᵗ)`` rather than
    ``max(nu/(1−b2ˢ))``), so the two agree only while nu grows.

    Args:
        b1: decay of the first moment, in [0, 1) (default: 0.9).
        b2: decay of the second moment, in [0, 1) (default: 0.999).
        eps: added to the denominator outside the square root, >= 0 (default: 1e-8).
        eps_root: added inside the square root, >= 0 (default: 0.0).
        bias_correction_mu: bias-correct the first moment (default: True).
        bias_correction_nu: bias-correct the second moment before the maximum
            (default: True).
    """

    def body(o, x):
        mu = o.lerp(x.mu, x.u, x.one_minus_b1)
        nu = o.lerp(x.nu, x.u * x.u, x.one_minus_b2)
        mu_hat = mu / x.bc1 if bias_correction_mu else mu
        nu_max = o.maximum(x.nu_max, nu / x.bc2 if bias_correction_nu else nu)
        update = mu_hat / (o.sqrt(nu_max + x.eps_root) + x.eps)
        return update, {"mu": mu, "nu": nu, "nu_max": nu_max}

    return moment_rule("scale_by_amsgrad", body, ScaleByAmsgradState, b1, b2, eps, eps_root,
                       more_unsigned=("nu_max",))


def scale_by_belief(
    b1: Float = 0.9,
    b2: Float = 0.999,
    eps: Float = 1e-16,
    eps_root: Float = 1e-16,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    """AdaBelief's preconditioning (the second moment of the prediction error u − mu), as
    optax.

    mu ← b1·mu + (1−b1)·u; nu ← b2·nu + (1−b2)·(u − mu)² + eps_root (mu the new first
    moment; eps_root is added to the stored nu every step);
    u ← m̂/(√(nu/(1−b2ᵗ)) + eps), m̂ = mu/(1−b1ᵗ), or with ``nesterov``
    m̂ = b1·mu/(1−b1ᵗ⁺¹) + (1−b1)·u/(1−b1ᵗ).

    Args:
        b1: decay of the first moment, in [0, 1) (default: 0.9).
        b2: decay of the second moment, in [0, 1) (default: 0.999).
        eps: added to the denominator outside the square root, >= 0 (default: 1e-16).
        eps_root: added to the second moment every step, >= 0 (default: 1e-16).
        nesterov: Nesterov momentum (default: False).
    """

    def body(o, x):
        mu = o.lerp(x.mu, x.u, x.one_minus_b1)
        error = x.u - mu
        nu = o.lerp(x.nu, error * error, x.one_minus_b2) + x.eps_root
        update = _mu_hat(x, mu, nesterov) / (o.sqrt(nu / x.bc2) + x.eps)
        return update, {"mu": mu, "nu": nu}

    return moment_rule("scale_by_belief", body, ScaleByBeliefState, b1, b2, eps, eps_root,
                       nesterov)


def _acprop_scalars(t, h):
    """ACProp's denominator is the previous step's second moment, bias-corrected at the
    previous count; on the first step it is 1 (optax.contrib): nu_hat = nu/bc + first."""
    b2 = h["b2"]
    if isinstance(t, torch.Tensor):
        first = (t <= 1).to(t.dtype)
        before = torch.clamp(t - 1, min=1)
    else:
        first, before = float(t <= 1), max(t - 1, 1)
    return {"one_minus_b1": 1 - h["b1"], "one_minus_b2": 1 - b2,
            "bc_before": 1 - (1 - first) * b2**before, "first": first}


def scale_by_acprop(
    b1: Float = 0.9,
    b2: Float = 0.999,
    eps: Float = 1e-16,
    eps_root: Float = 1e-16,
) -> GradientTransformation:
    """ACProp's preconditioning (the asynchronous AdaBelief, as optax.contrib): the update
    is divided by the second moment of the prediction error *before* this step.

    mu ← b1·mu + (1−b1)·u; nu ← b2·nu + (1−b2)·(u − mu_old)² + eps_root;
    u ← u/(√(nu_old/(1−b2^(t−1))) + eps), with √1 in place of the root on the first step.

    Args:
        b1, b2: decays of the moments, in [0, 1) (defaults 0.9, 0.999).
        eps: added to the denominator, >= 0 (default: 1e-16).
        eps_root: added to the stored nu every step, >= 0 (default: 1e-16).
    """

    def body(o, x):
        mu = o.lerp(x.mu, x.u, x.one_minus_b1)
        error = x.u - x.mu
        nu = o.lerp(x.nu, error * error, x.one_minus_b2) + x.eps_root
        nu_hat = x.nu / x.bc_before + x.first  # (nu_old is 0 on the first step)
        return x.u / (o.sqrt(nu_hat) + x.eps), {"mu": mu, "nu": nu}

    return rule_transform(Rule(
        "scale_by_acprop", body, state_class=ScaleByBeliefState,
        slots=(Slot("mu", signed=True), Slot("nu", signed=False)),
        hparams={"b1": b1, "b2": b2, "eps": eps, "eps_root": eps_root},
        domains={"b1": UNIT_OPEN, "b2": UNIT_OPEN, "eps": NONNEG, "eps_root": NONNEG},
        scalars=_acprop_scalars, counted=True))


def _yogi_body(o, x):
    mu = o.lerp(x.mu, x.u, x.one_minus_b1)
    square = x.u * x.u
    nu = x.nu - x.one_minus_b2 * o.sign(x.nu - square) * square
    update = mu / x.bc1 / (o.sqrt(nu / x.bc2 + x.eps_root) + x.eps)
    return update, {"mu": mu, "nu": nu}


def scale_by_yogi(
    b1: Float = 0.9,
    b2: Float = 0.999,
    eps: Float = 1e-3,
    eps_root: Float = 0.0,
    initial_accumulator_value: float = 1e-6,
) -> GradientTransformation:
    """Yogi's preconditioning (an additive, sign-controlled second moment), as optax.

    mu ← b1·mu + (1−b1)·u; nu ← nu − (1−b2)·sign(nu − u²)·u²;
    u ← m̂/(√(v̂+eps_root)+eps), m̂ = mu/(1−b1ᵗ), v̂ = nu/(1−b2ᵗ). Both mu and nu start at
    ``initial_accumulator_value`` (and are still bias-corrected, as optax does).

    Args:
        b1: decay of the first moment, in [0, 1) (default: 0.9).
        b2: rate of the second moment, in [0, 1) (default: 0.999).
        eps: added to the denominator outside the square root, >= 0 (default: 1e-3).
        eps_root: added inside the square root, >= 0 (default: 0.0).
        initial_accumulator_value: the initial mu and nu, >= 0 (default: 1e-6).
    """
    rule = Rule(
        "scale_by_yogi",
        _yogi_body,
        state_class=ScaleByAdamState,
        slots=(Slot("mu", signed=True, init="initial_accumulator_value"),
               Slot("nu", signed=False, init="initial_accumulator_value")),
        hparams={"b1": b1, "b2": b2, "eps": eps, "eps_root": eps_root,
                 "initial_accumulator_value": _host_float(initial_accumulator_value)},
        domains={"b1": UNIT_OPEN, "b2": UNIT_OPEN, "eps": NONNEG, "eps_root": NONNEG,
                 "initial_accumulator_value": NONNEG},
        scalars=moment_scalars(),
        counted=True,
    )
    return rule_transform(rule)


def _host_float(x: Any) -> Any:
    # An initial state value: a float (``bool`` and other types reach the check unchanged).
    return float(x) if isinstance(x, (int, float, torch.Tensor)) and not isinstance(x, bool) \
        else x
