"""Adaptive scaling: ``scale_by_adam``, ``scale_by_ademamix``, ``scale_by_rms``,
``scale_by_rss``, ``scale_by_adadelta``, ``scale_by_simplified_ademamix``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ftopt.base import GradientTransformation, register_state
from ftopt.domains import NONNEG, POSITIVE, UNIT, UNIT_OPEN
from ftopt.rule_transform import rule_transform
from ftopt.rules import Rule, Slot
from ftopt.schedules import ScalarOrSchedule
from ftopt.transforms.momentum import decay_scalars


@register_state
class ScaleByAdamState(NamedTuple):
    """Adam's step count and first and second moments."""

    count: torch.Tensor
    mu: Any
    nu: Any


@register_state
class ScaleByAdemamixState(NamedTuple):
    """AdEMAMix's step count, fast and slow EMAs and second moment."""

    count: torch.Tensor
    m1: Any
    m2: Any
    nu: Any


@register_state
class ScaleByRmsState(NamedTuple):
    """The running mean of squared updates."""

    nu: Any


@register_state
class ScaleByRssState(NamedTuple):
    """The running sum of squared updates."""

    sum_of_squares: Any


def _host_float(x: Any) -> Any:
    # An initial state value: a float (``bool`` and other types reach the check unchanged).
    return float(x) if isinstance(x, (int, float, torch.Tensor)) and not isinstance(x, bool) \
        else x


def moment_scalars(nesterov: bool = False):
    """1 − b1, 1 − b2 and the bias corrections 1 − b1ᵗ, 1 − b2ᵗ (and 1 − b1ᵗ⁺¹): the
    per-step scalars of Adam-like rules."""

    def scalars(t, h):
        b1, b2 = h["b1"], h["b2"]
        s = {"one_minus_b1": 1 - b1, "one_minus_b2": 1 - b2,
             "bc1": 1 - b1**t, "bc2": 1 - b2**t}
        if nesterov:
            s["bc1_next"] = 1 - b1 ** (t + 1)
        return s

    return scalars


def scale_by_adam(
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float | torch.Tensor = 1e-8,
    eps_root: float | torch.Tensor = 0.0,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    """Adam's preconditioning.

    mu ← b1·mu + (1−b1)·u; nu ← b2·nu + (1−b2)·u²;
    u ← m̂/(√(v̂+eps_root)+eps) with m̂ = mu/(1−b1ᵗ), v̂ = nu/(1−b2ᵗ). With ``nesterov``,
    m̂ = b1·mu/(1−b1ᵗ⁺¹) + (1−b1)·u/(1−b1ᵗ) (as optax).

    Args:
        b1: decay of the first moment, in [0, 1) (default: 0.9).
        b2: decay of the second moment, in [0, 1) (default: 0.999). 1 is excluded: the
            bias correction divides by 1 − bᵗ.
        eps: added to the denominator outside the square root, >= 0 (default: 1e-8).
        eps_root: added inside the square root, >= 0 (default: 0.0).
        nesterov: Nesterov momentum (default: False).
    """

    def body(o, x):
        mu = o.lerp(x.mu, x.u, x.one_minus_b1)  # b1·mu + (1−b1)·u
        nu = o.lerp(x.nu, x.u * x.u, x.one_minus_b2)
        if nesterov:
            mu_hat = x.b1 * mu / x.bc1_next + x.one_minus_b1 * x.u / x.bc1
        else:
            mu_hat = mu / x.bc1
        nu_hat = nu / x.bc2
        return mu_hat / (o.sqrt(nu_hat + x.eps_root) + x.eps), {"mu": mu, "nu": nu}

    return moment_rule("scale_by_adam", body, ScaleByAdamState, b1, b2, eps, eps_root,
                       nesterov)


def moment_rule(name: str, body, state_class, b1, b2, eps, eps_root, nesterov: bool = False,
                more_unsigned: tuple[str, ...] = ()) -> GradientTransformation:
    """An Adam-like rule: a signed ``mu``, an unsigned ``nu`` (and ``more_unsigned``
    slots), hyperparameters b1, b2 in [0, 1), eps, eps_root >= 0, :func:`moment_scalars`
    and a step count."""
    return rule_transform(Rule(
        name,
        body,
        state_class=state_class,
        slots=(Slot("mu", signed=True), Slot("nu", signed=False),
               *(Slot(n, signed=False) for n in more_unsigned)),
        hparams={"b1": b1, "b2": b2, "eps": eps, "eps_root": eps_root},
        domains={"b1": UNIT_OPEN, "b2": UNIT_OPEN, "eps": NONNEG, "eps_root": NONNEG},
        scalars=moment_scalars(nesterov),
        counted=True,
    ))


def _ademamix_body(o, x):
    m1 = o.lerp(x.m1, x.u, x.one_minus_b1)  # b1·m1 + (1−b1)·u
    m2 = o.lerp(x.m2, x.u, x.one_minus_b3)
    nu = o.lerp(x.nu, x.u * x.u, x.one_minus_b2)
    numerator = m1 / x.bc1 + x.alpha * m2
    update = numerator / (o.sqrt(nu / x.bc2 + x.eps_root) + x.eps)
    return update, {"m1": m1, "m2": m2, "nu": nu}


def _ademamix_scalars(t, h):
    b1, b2, b3 = h["b1"], h["b2"], h["b3"]
    return {"one_minus_b1": 1 - b1, "one_minus_b2": 1 - b2, "one_minus_b3": 1 - b3,
            "bc1": 1 - b1**t, "bc2": 1 - b2**t}


def scale_by_ademamix(
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    b3: ScalarOrSchedule = 0.9999,
    alpha: ScalarOrSchedule = 5.0,
    eps: float | torch.Tensor = 1e-8,
    eps_root: float | torch.Tensor = 0.0,
) -> GradientTransformation:
    """AdEMAMix's preconditioning (a fast and a slow EMA of the updates).

    m1 ← b1·m1 + (1−b1)·u; m2 ← b3·m2 + (1−b3)·u; nu ← b2·nu + (1−b2)·u²;
    u ← (m1/(1−b1ᵗ) + α·m2)/(√(nu/(1−b2ᵗ)+eps_root)+eps); m2 is not bias-corrected.

    Args:
        b1, b2: decays of the fast EMA and of the second moment, in [0, 1).
        b3: decay of the slow EMA, in [0, 1]; a schedule of the step t (1 on the first step), e.g.
            :func:`ftopt.schedules.ademamix_b3_warmup` (default: 0.9999).
        alpha: weight of the slow EMA, >= 0; a float or a schedule of t, e.g.
            :func:`ftopt.schedules.ademamix_alpha_warmup` (default: 5.0).
        eps, eps_root: as in :func:`scale_by_adam`.
    """
    rule = Rule(
        "scale_by_ademamix",
        _ademamix_body,
        state_class=ScaleByAdemamixState,
        slots=(Slot("m1"), Slot("m2"), Slot("nu", signed=False)),
        hparams={"b1": b1, "b2": b2, "b3": b3, "alpha": alpha, "eps": eps,
                 "eps_root": eps_root},
        domains={"b1": UNIT_OPEN, "b2": UNIT_OPEN, "b3": UNIT, "alpha": NONNEG, "eps": NONNEG,
                 "eps_root": NONNEG},
        scalars=_ademamix_scalars,
        counted=True,
        schedule_at_t=True,
    )
    return rule_transform(rule)


def scale_by_rms(
    decay: float | torch.Tensor = 0.9,
    eps: float | torch.Tensor = 1e-8,
    initial_scale: float = 0.0,
    *,
    eps_in_sqrt: bool = True,
) -> GradientTransformation:
    """Scales by the root mean square of past updates (RMSprop).

    nu ← decay·nu + (1−decay)·u²; u ← u/√(nu+eps), or u/(√nu+eps) with
    ``eps_in_sqrt=False`` (torch.optim.RMSprop and bitsandbytes).

    Args:
        decay: decay of the running mean, in [0, 1] (default: 0.9).
        eps: stabiliser, >= 0 (default: 1e-8).
        initial_scale: initial value of nu, >= 0 (default: 0.0).
        eps_in_sqrt: where eps goes (default: True).
    """

    def body(o, x):
        nu = o.lerp(x.nu, x.u * x.u, x.one_minus_decay)  # decay·nu + (1−decay)·u²
        if eps_in_sqrt:
            return x.u / o.sqrt(nu + x.eps), {"nu": nu}
        return x.u / (o.sqrt(nu) + x.eps), {"nu": nu}

    rule = Rule(
        "scale_by_rms",
        body,
        state_class=ScaleByRmsState,
        slots=(Slot("nu", signed=False, init="initial_scale"),),
        hparams={"decay": decay, "eps": eps, "initial_scale": _host_float(initial_scale)},
        domains={"decay": UNIT, "eps": NONNEG, "initial_scale": NONNEG},
        scalars=decay_scalars(False),
    )
    return rule_transform(rule)


@register_state
class ScaleByRStdDevState(NamedTuple):
    """The running means of the updates and of their squares (optax's layout)."""

    mu: Any
    nu: Any


@register_state
class ScaleByRStdDevWithCountState(NamedTuple):
    """:class:`ScaleByRStdDevState` with the step count of its bias correction."""

    count: torch.Tensor
    mu: Any
    nu: Any


def scale_by_stddev(
    decay: float | torch.Tensor = 0.9,
    eps: float | torch.Tensor = 1e-8,
    initial_scale: float = 0.0,
    *,
    eps_in_sqrt: bool = True,
    bias_correction: bool = False,
) -> GradientTransformation:
    """Scales by the running standard deviation of past updates (centered RMSprop, as
    optax): mu ← decay·mu + (1−decay)·u; nu ← decay·nu + (1−decay)·u²;
    u ← u/√(n̂ − m̂² + eps), or u/(√(n̂ − m̂²) + eps) with ``eps_in_sqrt=False``
    (torch.optim.RMSprop's ``centered=True``), where m̂, n̂ are mu, nu, or with
    ``bias_correction`` mu/(1−decayᵗ), nu/(1−decayᵗ).

    Args:
        decay: decay of the running means, in [0, 1] ([0, 1) with ``bias_correction``).
        eps: stabiliser, >= 0 (default: 1e-8).
        initial_scale: initial value of nu, >= 0 (default: 0.0).
        eps_in_sqrt: where eps goes (default: True).
        bias_correction: divide the means by 1 − decayᵗ (default: False).
    """

    def body(o, x):
        mu = o.lerp(x.mu, x.u, x.one_minus_decay)
        nu = o.lerp(x.nu, x.u * x.u, x.one_minus_decay)
        # n̂ − m̂² as (nu·bc − mu²)/bc²: the two terms that cancel are rounded the same
        # way by every backend (no quotient inside the difference, which a backend may
        # round as a product with the reciprocal and the cancellation would magnify).
        var = (nu * x.bc - mu * mu) / (x.bc * x.bc) if bias_correction else nu - mu * mu
        if eps_in_sqrt:
            return x.u / o.sqrt(var + x.eps), {"mu": mu, "nu": nu}
        return x.u / (o.sqrt(var) + x.eps), {"mu": mu, "nu": nu}

    rule = Rule(
        "scale_by_stddev",
        body,
        state_class=ScaleByRStdDevWithCountState if bias_correction else ScaleByRStdDevState,
        slots=(Slot("mu"), Slot("nu", signed=False, init="initial_scale")),
        hparams={"decay": decay, "eps": eps, "initial_scale": _host_float(initial_scale)},
        domains={"decay": UNIT_OPEN if bias_correction else UNIT, "eps": NONNEG,
                 "initial_scale": NONNEG},
        scalars=decay_scalars(bias_correction),
        counted=bias_correction,
    )
    return rule_transform(rule)


def scale_by_rss(
    initial_accumulator_value: float = 0.1,
    eps: float | torch.Tensor = 1e-7,
    *,
    eps_in_sqrt: bool = True,
) -> GradientTransformation:
    """Scales by the root of the sum of squared updates (Adagrad).

    s ← s + u²; u ← u/√(s+eps) where s > 0 (else 0), or u/(√s+eps) with
    ``eps_in_sqrt=False`` (torch.optim.Adagrad and bitsandbytes).

    Args:
        initial_accumulator_value: initial value of s, >= 0 (default: 0.1).
        eps: stabiliser, >= 0 (default: 1e-7).
        eps_in_sqrt: where eps goes (default: True).
    """

    def body(o, x):
        s = x.sum_of_squares + x.u * x.u
        if eps_in_sqrt:
            return o.where(s > 0.0, x.u / o.sqrt(s + x.eps), 0.0), {"sum_of_squares": s}
        return x.u / (o.sqrt(s) + x.eps), {"sum_of_squares": s}

    rule = Rule(
        "scale_by_rss",
        body,
        state_class=ScaleByRssState,
        slots=(Slot("sum_of_squares", signed=False, init="initial_accumulator_value"),),
        hparams={"initial_accumulator_value": _host_float(initial_accumulator_value),
                 "eps": eps},
        domains={"initial_accumulator_value": NONNEG, "eps": NONNEG},
    )
    return rule_transform(rule)


@register_state
class ScaleByAdaDeltaState(NamedTuple):
    """Adadelta's running means of squared updates in and out."""

    e_g: Any
    e_x: Any


def _adadelta_body(o, x):
    e_g = o.lerp(x.e_g, x.u * x.u, x.one_minus_rho)  # rho·e_g + (1−rho)·u²
    update = o.sqrt(x.e_x + x.eps) / o.sqrt(e_g + x.eps) * x.u
    e_x = o.lerp(x.e_x, update * update, x.one_minus_rho)
    return update, {"e_g": e_g, "e_x": e_x}


def scale_by_adadelta(
    rho: float | torch.Tensor = 0.9,
    eps: float | torch.Tensor = 1e-6,
) -> GradientTransformation:
    """Adadelta's preconditioning, as optax.

    e_g ← rho·e_g + (1−rho)·u²; u ← √(e_x + eps)/√(e_g + eps)·u (e_x of the previous
    step); e_x ← rho·e_x + (1−rho)·u². This is torch.optim.Adadelta's math.

    Args:
        rho: decay of both running means, in [0, 1] (default: 0.9).
        eps: added inside both square roots, > 0 (default: 1e-6): with 0, the first step's
            update is 0 and stays 0.
    """
    rule = Rule(
        "scale_by_adadelta",
        _adadelta_body,
        state_class=ScaleByAdaDeltaState,
        slots=(Slot("e_g", signed=False), Slot("e_x", signed=False)),
        hparams={"rho": rho, "eps": eps},
        domains={"rho": UNIT, "eps": POSITIVE},
        scalars=lambda t, h: {"one_minus_rho": 1 - h["rho"]},
    )
    return rule_transform(rule)


@register_state
class ScaleBySimplifiedAdEMAMixState(NamedTuple):
    """Simplified AdEMAMix's step count (optax calls it ``t``), accumulated momentum and
    second moment."""

    count: torch.Tensor
    m: Any
    n: Any


def _simplified_ademamix_body(o, x):
    m = x.b1 * x.m + x.u  # an accumulation, not an EMA: no (1−b1) factor
    n = o.lerp(x.n, x.u * x.u, x.one_minus_b2)
    update = (m + x.alpha * x.u) / (o.sqrt(n / x.bc2 + x.eps_root) + x.eps)
    return update, {"m": m, "n": n}


def scale_by_simplified_ademamix(
    b1: float | torch.Tensor = 0.99,
    b2: float | torch.Tensor = 0.95,
    alpha: ScalarOrSchedule = 0.0,
    eps: float | torch.Tensor = 1e-8,
    eps_root: float | torch.Tensor = 0.0,
) -> GradientTransformation:
    """Simplified AdEMAMix's preconditioning (as optax.contrib): one momentum, mixed with
    the current update.

    m ← b1·m + u; n ← b2·n + (1−b2)·u²; u ← (m + α·u)/(√(n/(1−b2ᵗ)+eps_root)+eps).
    m is neither an average nor bias-corrected.

    Args:
        b1: decay of the momentum, in [0, 1) (default: 0.99).
        b2: decay of the second moment, in [0, 1) (default: 0.95).
        alpha: weight of the current update, >= 0; a float or a schedule of the step count
            before this step (0 on the first step), as optax (default: 0.0).
        eps, eps_root: as in :func:`scale_by_adam`.
    """
    rule = Rule(
        "scale_by_simplified_ademamix",
        _simplified_ademamix_body,
        state_class=ScaleBySimplifiedAdEMAMixState,
        slots=(Slot("m", signed=True), Slot("n", signed=False)),
        hparams={"b1": b1, "b2": b2, "alpha": alpha, "eps": eps, "eps_root": eps_root},
        domains={"b1": UNIT_OPEN, "b2": UNIT_OPEN, "alpha": NONNEG, "eps": NONNEG,
                 "eps_root": NONNEG},
        scalars=lambda t, h: {"one_minus_b2": 1 - h["b2"], "bc2": 1 - h["b2"] ** t},
        counted=True,
    )
    return rule_transform(rule)
