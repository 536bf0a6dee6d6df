"""Optimizers of optax's catalogue built on per-leaf norms: ``novograd`` (a per-leaf
second moment) and ``fromage`` (a trust ratio and a shrink of the params).

As in :mod:`ftopt.alias`, every alias takes keyword-only ``skip_zeros``, ``state_bits`` and
``state_dtype``.
"""

from __future__ import annotations

from ftopt.alias import Float, chain_alias
from ftopt.base import GradientTransformation
from ftopt.schedules import ScalarOrSchedule
from ftopt.transforms import scale_by_learning_rate, scale_by_novograd, scale_by_trust_ratio
from ftopt.transforms.fromage import fromage_step

__all__ = ["fromage", "novograd"]


@chain_alias
def novograd(
    learning_rate: ScalarOrSchedule,
    b1: Float = 0.9,
    b2: Float = 0.25,
    eps: Float = 1e-6,
    eps_root: Float = 0.0,
    weight_decay: Float = 0.0,
) -> list[GradientTransformation]:
    """NovoGrad: ``chain(scale_by_novograd(b1, b2, eps, eps_root, weight_decay),
    scale_by_learning_rate(lr))``, as optax (whose alias defaults ``eps`` to 1e-6, its
    transform to 1e-8). The second moment is one value per leaf (fp32, never 8-bit);
    ``state_bits``/``state_dtype`` store the first moment. See
    :func:`ftopt.scale_by_novograd` for the math, how it runs and ``skip_zeros``."""
    return [scale_by_novograd(b1, b2, eps, eps_root, weight_decay),
            scale_by_learning_rate(learning_rate)]


@chain_alias
def fromage(
    learning_rate: ScalarOrSchedule,
    min_norm: Float = 1e-6,
) -> list[GradientTransformation]:
    """Fromage, as optax: per leaf u ← u·max(‖p‖, min_norm)/max(‖u‖, min_norm) (ratio 1
    where either norm is 0), then p ← m·(p − lr·u) with m = 1/√(1 + lr²):
    ``chain(scale_by_trust_ratio(min_norm), fromage_step(lr))`` (optax's
    ``scale_by_learning_rate(lr·m)`` and ``add_decayed_weights(m − 1)`` as one rule).
    Stateless (``state_bits``/``state_dtype`` are accepted and change nothing); fuses,
    the two norms in a reduction pass. ``min_norm`` >= 0."""
    return [scale_by_trust_ratio(min_norm), fromage_step(learning_rate)]
