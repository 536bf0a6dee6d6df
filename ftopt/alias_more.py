"""More elementwise optimizers of optax's catalogue (optax and optax.contrib names,
signatures and defaults), each a short chain of transforms: ``adan``, ``madgrad``,
``cocob``, ``rprop``, ``dog``, ``dowg``, ``mars``.

As in :mod:`ftopt.alias`, every alias takes keyword-only ``skip_zeros``, ``state_bits`` and
``state_dtype``.
"""

from __future__ import annotations

from typing import Any

from ftopt.alias import Float, chain_alias
from ftopt.base import GradientTransformation
from ftopt.schedules import ScalarOrSchedule
from ftopt.transforms import (
    add_decayed_weights,
    scale,
    scale_by_adan,
    scale_by_cocob,
    scale_by_learning_rate,
    scale_by_madgrad,
    scale_by_rprop,
)
from ftopt.transforms.dog import scale_by_dog, scale_by_dowg
from ftopt.transforms.mars import scale_by_mars

__all__ = ["adan", "cocob", "dog", "dowg", "madgrad", "mars", "rprop"]


@chain_alias
def adan(
    learning_rate: ScalarOrSchedule,
    b1: Float = 0.98,
    b2: Float = 0.92,
    b3: Float = 0.99,
    eps: Float = 1e-8,
    eps_root: Float = 1e-8,
    weight_decay: Float = 0.0,
    mask: Any = None,
) -> list[GradientTransformation]:
    """Adan: ``chain(scale_by_adan(b1, b2, b3, eps, eps_root), add_decayed_weights(wd,
    mask), scale_by_learning_rate(lr))``, as optax (whose alias defaults ``eps_root`` to
    1e-8, its transform to 0). See :func:`ftopt.scale_by_adan` for the authors' betas and
    proximal decay."""
    return [scale_by_adan(b1, b2, b3, eps, eps_root), add_decayed_weights(weight_decay, mask),
            scale_by_learning_rate(learning_rate)]


@chain_alias
def madgrad(
    learning_rate: ScalarOrSchedule,
    momentum: Float = 0.9,
    weight_decay: Float = 0.0,
    eps: Float = 1e-6,
) -> list[GradientTransformation]:
    """MADGRAD (as optax.contrib): ``chain(add_decayed_weights(wd),
    scale_by_madgrad(lr, momentum, eps))``: the decay is an L2 term added to the gradient,
    facebookresearch/madgrad's default (its ``decouple_decay=True``, p ← p − lr·wd·p after
    the step, is not offered)."""
    return [add_decayed_weights(weight_decay), scale_by_madgrad(learning_rate, momentum, eps)]


@chain_alias
def cocob(
    learning_rate: ScalarOrSchedule = 1.0,
    alpha: Float = 100.0,
    eps: float = 1e-8,
    weight_decay: Float = 0.0,
    mask: Any = None,
) -> list[GradientTransformation]:
    """COCOB-Backprop (as optax.contrib): ``chain(add_decayed_weights(wd, mask),
    scale_by_learning_rate(lr, flip_sign=False), scale_by_cocob(alpha, eps))``."""
    return [add_decayed_weights(weight_decay, mask),
            scale_by_learning_rate(learning_rate, flip_sign=False),
            scale_by_cocob(alpha, eps)]


@chain_alias
def rprop(
    learning_rate: float,
    eta_minus: Float = 0.5,
    eta_plus: Float = 1.2,
    min_step_size: Float = 1e-6,
    max_step_size: Float = 50.0,
) -> list[GradientTransformation]:
    """Rprop: ``chain(scale_by_rprop(...), scale(-1.0))``, as optax (its update lags one
    step behind torch.optim.Rprop's; see :func:`ftopt.scale_by_rprop`)."""
    return [scale_by_rprop(learning_rate, eta_minus, eta_plus, min_step_size, max_step_size),
            scale(-1.0)]


@chain_alias
def dog(
    learning_rate: ScalarOrSchedule = 1.0,
    init_step: tuple[str, Float] = ("heuristic", 1e-6),
    eps: Float = 1e-8,
    weight_decay: Float | None = None,
    mask: Any = None,
) -> list[GradientTransformation]:
    """DoG (optax.contrib): ``chain([add_decayed_weights(wd, mask)],
    scale_by_dog(init_step, eps), scale_by_learning_rate(lr))``. Its state keeps a copy of
    the params at ``init`` (pass the real params there)."""
    parts = [] if weight_decay is None else [add_decayed_weights(weight_decay, mask)]
    return parts + [scale_by_dog(init_step, eps), scale_by_learning_rate(learning_rate)]


@chain_alias
def dowg(
    learning_rate: ScalarOrSchedule = 1.0,
    init_estim_sq_dist: Float | None = None,
    eps: Float = 1e-4,
    weight_decay: Float | None = None,
    mask: Any = None,
) -> list[GradientTransformation]:
    """DoWG (optax.contrib): ``chain([add_decayed_weights(wd, mask)],
    scale_by_dowg(init_estim_sq_dist, eps), scale_by_learning_rate(lr))``."""
    parts = [] if weight_decay is None else [add_decayed_weights(weight_decay, mask)]
    return parts + [scale_by_dowg(init_estim_sq_dist, eps),
                    scale_by_learning_rate(learning_rate)]


@chain_alias
def mars(
    learning_rate: ScalarOrSchedule,
    b1: Float = 0.95,
    b2: Float = 0.99,
    eps: Float = 1e-8,
    gamma: Float = 0.025,
    clip_threshold: float | None = 1.0,
    weight_decay: Float = 0.0,
    weight_decay_mask: Any = None,
) -> list[GradientTransformation]:
    """MARS (as optax.contrib): ``chain(scale_by_mars(b1, b2, eps, gamma,
    clip_threshold), add_decayed_weights(weight_decay, weight_decay_mask),
    scale_by_learning_rate(lr))``: Adam on the gradient plus γ·b1/(1−b1) times its change
    since the last step, clipped to a global norm. Fused, the clip's norm is a reduction
    pass over the corrected gradient, and the rest of the chain one kernel."""
    return [scale_by_mars(b1, b2, eps, gamma, clip_threshold),
            add_decayed_weights(weight_decay, weight_decay_mask),
            scale_by_learning_rate(learning_rate)]
