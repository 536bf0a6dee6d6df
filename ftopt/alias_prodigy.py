"""``prodigy`` and ``dadapt_adamw`` (optax.contrib): learning-rate-free AdamW (see
:mod:`ftopt.transforms.prodigy` and :mod:`ftopt.transforms.dadapt` for the math and how
they run)."""

from __future__ import annotations

from typing import Any

from ftopt.alias import Float, chain_alias
from ftopt.base import GradientTransformation
from ftopt.schedules import ScalarOrSchedule
from ftopt.transforms.dadapt import dadapt_adamw as _dadapt_adamw
from ftopt.transforms.prodigy import scale_by_prodigy

__all__ = ["prodigy", "dadapt_adamw"]


@chain_alias
def prodigy(
    learning_rate: ScalarOrSchedule = 1.0,
    betas: tuple[Float, Float] = (0.9, 0.999),
    beta3: Float | None = None,
    eps: Float = 1e-8,
    estim_lr0: float = 1e-6,
    estim_lr_coef: Float = 1.0,
    weight_decay: Float = 0.0,
    safeguard_warmup: bool = False,
    weight_decay_mask: Any = None,
) -> list[GradientTransformation]:
    """Prodigy (as optax.contrib.prodigy, same arguments and defaults): AdamW whose step
    is d·lr with d a running estimate of the distance to the solution, grown from a global
    dot product Σ g·(x0 − p) and a global L1 norm of its state s. The state is optax's
    ``ProdigyState``; d (``estim_lr``) and its numerator are 0-d tensors on the params'
    device, moved without a host read. It runs as one rule: fused, a reduction pass and one
    main kernel per step for any number of leaves; with ``weight_decay_mask``, a stage of
    torch ops and the fused ``p + u`` (:mod:`ftopt.transforms.prodigy`).

    ``learning_rate`` multiplies the estimate (a schedule that starts near 1.0, e.g. a
    linear decay to 0 after a warmup). ``state_bits=8`` stores m, v and s as 8-bit
    blockwise codes (leaves of at least 4096 elements; :func:`ftopt.quantize_states`), and
    ``state_dtype`` in bf16 or fp16; each step reads them, runs the math (Σ|s| included)
    in the compute dtype and stores them once; ``params0``, a copy of the params, stays in
    their compute dtype (as MADGRAD's ``x0``). ``skip_zeros``: see
    :mod:`ftopt.transforms.prodigy`. The math and the other arguments:
    :func:`ftopt.transforms.prodigy.scale_by_prodigy`.
    """
    return [scale_by_prodigy(learning_rate, betas, beta3, eps, estim_lr0, estim_lr_coef,
                             weight_decay, safeguard_warmup, weight_decay_mask)]


@chain_alias
def dadapt_adamw(
    learning_rate: ScalarOrSchedule = 1.0,
    betas: tuple[Float, Float] = (0.9, 0.999),
    eps: Float = 1e-8,
    estim_lr0: float = 1e-6,
    weight_decay: Float = 0.0,
) -> list[GradientTransformation]:
    """D-Adaptation AdamW (as optax.contrib.dadapt_adamw, same arguments and defaults):
    AdamW whose step is d·lr, d a running lower bound of the distance to the solution from
    a global sum Σ g·s/(√v + eps) and the global L1 norm of s. One fused rule; the state is
    optax's ``DAdaptAdamWState`` (d and its numerator 0-d tensors moved on the device).
    ``state_bits=8`` and ``state_dtype`` store m, v and s as every rule's slots.
    """
    return [_dadapt_adamw(learning_rate, betas, eps, estim_lr0, weight_decay)]
