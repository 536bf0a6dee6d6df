"""More of optax's elementwise optimizers, each a short chain of transforms (optax
signatures and defaults): Adam's variants (``adamax``, ``adamaxw``, ``amsgrad``, ``nadam``,
``nadamw``, ``radam``, ``adabelief``, ``acprop``, ``yogi``, ``adopt``, ``simplified_ademamix``),
``adadelta``, the sign methods (``sign_sgd``, ``signum``),
``optimistic_gradient_descent`` and ``optimistic_adam_v2``.

As in :mod:`ftopt.alias`, every alias takes keyword-only ``skip_zeros``, ``state_bits`` and
``state_dtype``.
optax's ``mu_dtype``/``accumulator_dtype`` arguments are not taken: states are fp32 (or
8-bit with ``state_bits=8``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ftopt.alias import Float, chain_alias
from ftopt.base import GradientTransformation
from ftopt.domains import UNIT, check_hparam
from ftopt.schedules import ScalarOrSchedule
from ftopt.transforms import (
    add_decayed_weights,
    ema,
    quarter_power,
    scale_by_acprop,
    scale_by_adadelta,
    scale_by_adam,
    scale_by_adamax,
    scale_by_adopt,
    scale_by_amsgrad,
    scale_by_ano,
    scale_by_belief,
    scale_by_learning_rate,
    scale_by_optimistic_gradient,
    scale_by_radam,
    scale_by_sign,
    scale_by_simplified_ademamix,
    scale_by_yogi,
)

__all__ = ["acprop", "adabelief", "ano", "adadelta", "adamax", "adamaxw", "adopt", "amsgrad",
           "nadam",
           "nadamw", "optimistic_adam", "optimistic_adam_v2", "optimistic_gradient_descent",
           "radam",
           "sign_sgd", "signum", "simplified_ademamix", "yogi"]


@chain_alias
def adamax(
    learning_rate: ScalarOrSchedule,
    b1: Float = 0.9,
    b2: Float = 0.999,
    eps: Float = 1e-8,
) -> list[GradientTransformation]:
    """Adamax: ``chain(scale_by_adamax(b1, b2, eps), scale_by_learning_rate(lr))``
    (torch.optim.Adamax without weight decay)."""
    return [scale_by_adamax(b1, b2, eps), scale_by_learning_rate(learning_rate)]


@chain_alias
def adamaxw(
    learning_rate: ScalarOrSchedule,
    b1: Float = 0.9,
    b2: Float = 0.999,
    eps: Float = 1e-8,
    weight_decay: Float = 1e-4,
    mask: Any = None,
) -> list[GradientTransformation]:
    """Adamax with decoupled weight decay: ``chain(scale_by_adamax,
    add_decayed_weights(wd, mask), scale_by_learning_rate)``: p ← p − lr·(û + wd·p)."""
    return [scale_by_adamax(b1, b2, eps), add_decayed_weights(weight_decay, mask),
            scale_by_learning_rate(learning_rate)]


@chain_alias
def amsgrad(
    learning_rate: ScalarOrSchedule,
    b1: Float = 0.9,
    b2: Float = 0.999,
    eps: Float = 1e-8,
    eps_root: Float = 0.0,
    *,
    bias_correction_mu: bool = True,
    bias_correction_nu: bool = True,
) -> list[GradientTransformation]:
    """AMSGrad: ``chain(scale_by_amsgrad(...), scale_by_learning_rate(lr))``.

    The bias-correction switches are keyword-only here (optax takes ``mu_dtype`` before
    them). See :func:`ftopt.scale_by_amsgrad` for how torch's ``amsgrad=True`` differs.
    """
    return [scale_by_amsgrad(b1, b2, eps, eps_root, bias_correction_mu=bias_correction_mu,
                             bias_correction_nu=bias_correction_nu),
            scale_by_learning_rate(learning_rate)]


@chain_alias
def nadam(
    learning_rate: ScalarOrSchedule,
    b1: Float = 0.9,
    b2: Float = 0.999,
    eps: Float = 1e-8,
    eps_root: Float = 0.0,
    *,
    nesterov: bool = True,
) -> list[GradientTransformation]:
    """NAdam as optax defines it: ``adam(..., nesterov=True)``.

    m̂ = b1·mu/(1−b1ᵗ⁺¹) + (1−b1)·u/(1−b1ᵗ). torch.optim.NAdam differs: it warms the
    momentum up (b1·(1 − 0.5·0.96^(0.004·t)), ``momentum_decay``) and bias-corrects with
    the product of those coefficients.
    """
    return [scale_by_adam(b1, b2, eps, eps_root, nesterov=nesterov),
            scale_by_learning_rate(learning_rate)]


@chain_alias
def nadamw(
    learning_rate: ScalarOrSchedule,
    b1: Float = 0.9,
    b2: Float = 0.999,
    eps: Float = 1e-8,
    eps_root: Float = 0.0,
    weight_decay: Float = 1e-4,
    mask: Any = None,
    *,
    nesterov: bool = True,
) -> list[GradientTransformation]:
    """NAdamW as optax defines it: ``adamw(..., nesterov=True)`` (decoupled decay,
    multiplied by the learning rate; see :func:`nadam` for torch's NAdam)."""
    return [scale_by_adam(b1, b2, eps, eps_root, nesterov=nesterov),
            add_decayed_weights(weight_decay, mask), scale_by_learning_rate(learning_rate)]


@chain_alias
def radam(
    learning_rate: ScalarOrSchedule,
    b1: Float = 0.9,
    b2: Float = 0.999,
    eps: Float = 1e-8,
    eps_root: Float = 0.0,
    threshold: Float = 5.0,
    *,
    nesterov: bool = False,
) -> list[GradientTransformation]:
    """Rectified Adam: ``chain(scale_by_radam(...), scale_by_learning_rate(lr))``
    (see :func:`ftopt.scale_by_radam` for torch.optim.RAdam)."""
    return [scale_by_radam(b1, b2, eps, eps_root, threshold, nesterov=nesterov),
            scale_by_learning_rate(learning_rate)]


@chain_alias
def adabelief(
    learning_rate: ScalarOrSchedule,
    b1: Float = 0.9,
    b2: Float = 0.999,
    eps: Float = 1e-16,
    eps_root: Float = 1e-16,
    weight_decay: Float | None = None,
    weight_decay_mask: Any = None,
    *,
    nesterov: bool = False,
) -> list[GradientTransformation]:
    """AdaBelief: ``chain(scale_by_belief(...), [add_decayed_weights(wd, mask)],
    scale_by_learning_rate(lr))``; the decay only when ``weight_decay`` is not None."""
    parts = [scale_by_belief(b1, b2, eps, eps_root, nesterov=nesterov)]
    if weight_decay is not None:
        parts.append(add_decayed_weights(weight_decay, weight_decay_mask))
    parts.append(scale_by_learning_rate(learning_rate))
    return parts


@chain_alias
def acprop(
    learning_rate: ScalarOrSchedule,
    b1: Float = 0.9,
    b2: Float = 0.999,
    eps: Float = 1e-16,
    eps_root: Float = 1e-16,
    weight_decay: Float = 0.0,
    mask: Any = None,
) -> list[GradientTransformation]:
    """ACProp (as optax.contrib): ``chain(scale_by_acprop(b1, b2, eps, eps_root),
    add_decayed_weights(weight_decay, mask), scale_by_learning_rate(lr))``."""
    return [scale_by_acprop(b1, b2, eps, eps_root), add_decayed_weights(weight_decay, mask),
            scale_by_learning_rate(learning_rate)]


@chain_alias
def yogi(
    learning_rate: ScalarOrSchedule,
    b1: Float = 0.9,
    b2: Float = 0.999,
    eps: Float = 1e-3,
) -> list[GradientTransformation]:
    """Yogi: ``chain(scale_by_yogi(b1, b2, eps), scale_by_learning_rate(lr))`` (mu and nu
    start at 1e-6, as optax)."""
    return [scale_by_yogi(b1, b2, eps), scale_by_learning_rate(learning_rate)]


@chain_alias
def adadelta(
    learning_rate: ScalarOrSchedule | None = None,
    rho: Float = 0.9,
    eps: Float = 1e-6,
    weight_decay: Float = 0.0,
    weight_decay_mask: Any = None,
) -> list[GradientTransformation]:
    """Adadelta: ``chain(add_decayed_weights(wd, mask), scale_by_adadelta(rho, eps),
    scale_by_learning_rate(lr))``, which is torch.optim.Adadelta (its weight decay is
    this coupled one).

    ``learning_rate=None`` means 1.0 (the descent of optax's documented formula and
    torch's default); optax's code then leaves out the learning rate step, and with it
    the sign flip, so that its updates ascend.
    """
    return [add_decayed_weights(weight_decay, weight_decay_mask),
            scale_by_adadelta(rho, eps),
            scale_by_learning_rate(1.0 if learning_rate is None else learning_rate)]


@chain_alias
def sign_sgd(
    learning_rate: ScalarOrSchedule,
) -> list[GradientTransformation]:
    """signSGD: ``chain(scale_by_sign(), scale_by_learning_rate(lr))``: p ← p − lr·sign(g)."""
    return [scale_by_sign(), scale_by_learning_rate(learning_rate)]


@chain_alias
def signum(
    learning_rate: ScalarOrSchedule,
    beta: Float = 0.9,
) -> list[GradientTransformation]:
    """Signum (signSGD with momentum): ``chain(ema(beta, debias=False), scale_by_sign(),
    scale_by_learning_rate(lr))``: m ← beta·m + (1−beta)·g; p ← p − lr·sign(m)."""
    check_hparam("signum", "beta", beta, UNIT)  # named as the caller wrote it, not ema's decay
    return [ema(beta, debias=False), scale_by_sign(), scale_by_learning_rate(learning_rate)]


@chain_alias
def optimistic_gradient_descent(
    learning_rate: ScalarOrSchedule,
    alpha: Float = 1.0,
    beta: Float = 1.0,
) -> list[GradientTransformation]:
    """Optimistic gradient descent: ``chain(scale_by_optimistic_gradient(alpha, beta),
    scale_by_learning_rate(lr))``: p ← p − lr·((alpha+beta)·gₜ − beta·gₜ₋₁)."""
    return [scale_by_optimistic_gradient(alpha, beta), scale_by_learning_rate(learning_rate)]


@chain_alias
def optimistic_adam_v2(
    learning_rate: ScalarOrSchedule,
    *,
    alpha: Float = 1.0,
    beta: Float = 1.0,
    b1: Float = 0.9,
    b2: Float = 0.999,
    eps: Float = 1e-8,
    eps_root: Float = 0.0,
    nesterov: bool = True,
) -> list[GradientTransformation]:
    """Optimistic Adam (as optax, Daskalakis et al. 2017): ``chain(scale_by_adam(b1, b2,
    eps, eps_root, nesterov=nesterov), scale_by_optimistic_gradient(alpha, beta),
    scale_by_learning_rate(lr))``: with r the Adam direction, p ← p − lr·((alpha+beta)·rₜ
    − beta·rₜ₋₁)."""
    return [scale_by_adam(b1, b2, eps, eps_root, nesterov=nesterov),
            scale_by_optimistic_gradient(alpha, beta), scale_by_learning_rate(learning_rate)]


@chain_alias
def optimistic_adam(
    learning_rate: Float,
    optimism: Float | None = None,
    b1: Float = 0.9,
    b2: Float = 0.999,
    eps: Float = 1e-8,
    eps_root: Float = 0.0,
    *,
    nesterov: bool = True,
) -> list[GradientTransformation]:
    """Optimistic Adam in optax's older interface (``optax.optimistic_adam``, deprecated
    there for :func:`optimistic_adam_v2`): ``chain(scale_by_adam(b1, b2, eps, eps_root,
    nesterov=nesterov), scale_by_optimistic_gradient(alpha=learning_rate, beta=optimism),
    scale_by_learning_rate(1.0))``, so p ← p − ((lr + o)·rₜ − o·rₜ₋₁); ``optimism``
    defaults to ``learning_rate``. It is ``optimistic_adam_v2(1.0, alpha=learning_rate,
    beta=optimism)``. The learning rate is a number or a 0-d tensor, not a schedule (as
    optax)."""
    if callable(learning_rate):
        raise ValueError("optimistic_adam: learning_rate cannot be a schedule (optax's "
                         "interface); use optimistic_adam_v2, which takes one")
    check_hparam("optimistic_adam", "learning_rate", learning_rate)
    optimism = learning_rate if optimism is None else optimism
    check_hparam("optimistic_adam", "optimism", optimism)
    return [scale_by_adam(b1, b2, eps, eps_root, nesterov=nesterov),
            scale_by_optimistic_gradient(learning_rate, optimism),
            scale_by_learning_rate(1.0)]


@chain_alias
def adopt(
    learning_rate: ScalarOrSchedule,
    b1: Float = 0.9,
    b2: Float = 0.9999,
    eps: Float = 1e-6,
    *,
    nesterov: bool = False,
    use_clipping: bool = True,
    clip_value_fn: Callable[[Any], Any] = quarter_power,
) -> list[GradientTransformation]:
    """ADOPT (as optax.contrib): ``chain(scale_by_adopt(...), scale_by_learning_rate(lr))``.
    The first step only measures the second moment (its update is 0)."""
    return [scale_by_adopt(b1, b2, eps, nesterov=nesterov, use_clipping=use_clipping,
                           clip_value_fn=clip_value_fn),
            scale_by_learning_rate(learning_rate)]


@chain_alias
def simplified_ademamix(
    learning_rate: ScalarOrSchedule,
    b1: Float = 0.99,
    b2: Float = 0.95,
    alpha: ScalarOrSchedule = 0.0,
    eps: Float = 1e-8,
    eps_root: Float = 0.0,
    weight_decay: Float = 0.0,
    mask: Any = None,
) -> list[GradientTransformation]:
    """Simplified AdEMAMix (as optax.contrib): ``chain(scale_by_simplified_ademamix(...),
    add_decayed_weights(wd, mask), scale_by_learning_rate(lr))``."""
    return [scale_by_simplified_ademamix(b1, b2, alpha, eps, eps_root),
            add_decayed_weights(weight_decay, mask), scale_by_learning_rate(learning_rate)]


@chain_alias
def ano(
    learning_rate: ScalarOrSchedule,
    b1: Float = 0.92,
    b2: Float = 0.99,
    eps: Float = 1e-8,
    weight_decay: Float = 0.0,
    logarithmic_schedule: bool = False,
) -> list[GradientTransformation]:
    """Ano (as optax.contrib): ``chain(scale_by_ano(b1, b2, eps, logarithmic_schedule),
    add_decayed_weights(weight_decay), scale_by_learning_rate(lr))``: the momentum's
    sign for the direction, the gradient's magnitude for the size."""
    return [scale_by_ano(b1, b2, eps, logarithmic_schedule), add_decayed_weights(weight_decay),
            scale_by_learning_rate(learning_rate)]
