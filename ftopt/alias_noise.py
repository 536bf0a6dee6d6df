"""Noisy SGD (optax's ``noisy_sgd``): SGD on gradients with annealed Gaussian noise.

As in :mod:`ftopt.alias`, the alias takes keyword-only ``skip_zeros``, ``state_bits`` and
``state_dtype`` (it keeps no per-element state, so the last two change nothing).
"""

from __future__ import annotations

from ftopt.alias import Float, chain_alias
from ftopt.base import GradientTransformation
from ftopt.schedules import ScalarOrSchedule
from ftopt.transforms.noise import add_noise
from ftopt.transforms.scaling import scale_by_learning_rate

__all__ = ["noisy_sgd"]


@chain_alias
def noisy_sgd(
    learning_rate: ScalarOrSchedule,
    eta: Float = 0.01,
    gamma: Float = 0.55,
    seed: int = 0,
) -> list[GradientTransformation]:
    """Noisy SGD: ``chain(add_noise(eta, gamma, seed), scale_by_learning_rate(lr))``, as
    optax: u ← −lr·(g + σₜ·z), σₜ² = eta / tᵍᵃᵐᵐᵃ (t = 1 on the first step), z ~ N(0, 1)
    from a counter-based hash of (seed, t, leaf, element) (see :func:`ftopt.add_noise`).

    Example::

        tx = ftopt.noisy_sgd(1e-2, eta=0.01, gamma=0.55, seed=0)
        params, state = ftopt.step(tx, params, grads, tx.init(params))
    """
    return [add_noise(eta, gamma, seed), scale_by_learning_rate(learning_rate)]
