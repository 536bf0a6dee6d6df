"""More elementwise optimizers of optax's catalogue (optax and optax.contrib names,
signatures and defaults), each a short chain of transforms: ``adan``, ``madgrad``,
``rprop``.

As in :mod:`ftopt.alias`, every alias takes keyword-only ``skip_zeros``, ``state_bits`` and
``state_dtype``.
"""

from __future__ import annotations

from typing import Any

import torch

from ftopt.alias import check_state_options, finish
from ftopt.base import GradientTransformation
from ftopt.schedules import ScalarOrSchedule
from ftopt.transforms import (
    add_decayed_weights,
    scale,
    scale_by_adan,
    scale_by_learning_rate,
    scale_by_madgrad,
    scale_by_rprop,
)

__all__ = ["adan", "madgrad", "rprop"]

Float = float | torch.Tensor


def adan(
    learning_rate: ScalarOrSchedule,
    b1: Float = 0.98,
    b2: Float = 0.92,
    b3: Float = 0.99,
    eps: Float = 1e-8,
    eps_root: Float = 1e-8,
    weight_decay: Float = 0.0,
    mask: Any = None,
    *,
    skip_zeros: bool = False,
    state_bits: int = 32,
    state_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """Adan: ``chain(scale_by_adan(b1, b2, b3, eps, eps_root), add_decayed_weights(wd,
    mask), scale_by_learning_rate(lr))``, as optax (whose alias defaults ``eps_root`` to
    1e-8, its transform to 0). See :func:`ftopt.scale_by_adan` for the authors' betas and
    proximal decay."""
    check_state_options("adan", state_bits, state_dtype)
    parts = [scale_by_adan(b1, b2, b3, eps, eps_root), add_decayed_weights(weight_decay, mask),
             scale_by_learning_rate(learning_rate)]
    return finish(parts, skip_zeros, state_bits, state_dtype)


def madgrad(
    learning_rate: ScalarOrSchedule,
    momentum: Float = 0.9,
    weight_decay: Float = 0.0,
    eps: Float = 1e-6,
    *,
    skip_zeros: bool = False,
    state_bits: int = 32,
    state_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """MADGRAD (as optax.contrib): ``chain(add_decayed_weights(wd),
    scale_by_madgrad(lr, momentum, eps))``: the decay is an L2 term added to the gradient,
    facebookresearch/madgrad's default (its ``decouple_decay=True``, p ← p − lr·wd·p after
    the step, is not offered)."""
    check_state_options("madgrad", state_bits, state_dtype)
    parts = [add_decayed_weights(weight_decay), scale_by_madgrad(learning_rate, momentum, eps)]
    return finish(parts, skip_zeros, state_bits, state_dtype)


def rprop(
    learning_rate: float,
    eta_minus: Float = 0.5,
    eta_plus: Float = 1.2,
    min_step_size: Float = 1e-6,
    max_step_size: Float = 50.0,
    *,
    skip_zeros: bool = False,
    state_bits: int = 32,
    state_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """Rprop: ``chain(scale_by_rprop(...), scale(-1.0))``, as optax (its update lags one
    step behind torch.optim.Rprop's; see :func:`ftopt.scale_by_rprop`)."""
    check_state_options("rprop", state_bits, state_dtype)
    parts = [scale_by_rprop(learning_rate, eta_minus, eta_plus, min_step_size, max_step_size),
             scale(-1.0)]
    return finish(parts, skip_zeros, state_bits, state_dtype)
