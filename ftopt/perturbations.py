"""Perturbations (optax's ``optax.perturbations``): a differentiable approximation of a
function that need not be differentiable, ``f_σ(x) = E_z f(x + σz)``.

:func:`make_perturbed_fun` gives a stochastic function whose value and derivatives (any
order, through autograd or ``torch.func``) are unbiased Monte-Carlo estimates of
``f_σ``'s, from values of ``f`` alone at perturbed inputs: the score-function estimator,
written with the "magic box" ``exp(l − stop_gradient(l))`` of the samples' log-density
``l`` (Foerster et al. 2018), so that differentiating the estimate estimates the
derivative. Its first argument is the source of randomness: a ``torch.Generator`` or an
int seed (optax's PRNG key).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.func

from ftopt import tree as tree_lib

__all__ = ["Normal", "Gumbel", "make_perturbed_fun"]


class Normal:
    """The standard normal distribution (its log-density up to a constant)."""

    def sample(self, generator: torch.Generator, shape: tuple, dtype: torch.dtype,
               device: Any) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=dtype, device=device)

    def log_prob(self, z: torch.Tensor) -> torch.Tensor:
        return -0.5 * z * z


class Gumbel:
    """The standard Gumbel distribution (its log-density)."""

    def sample(self, generator: torch.Generator, shape: tuple, dtype: torch.dtype,
               device: Any) -> torch.Tensor:
        u = torch.rand(shape, generator=generator, dtype=dtype, device=device)
        return -torch.log(-torch.log(u.clamp_min(torch.finfo(dtype).tiny)))

    def log_prob(self, z: torch.Tensor) -> torch.Tensor:
        return -z - torch.exp(-z)


def _generator(key: Any, device: Any) -> torch.Generator:
    if isinstance(key, torch.Generator):
        return key
    if isinstance(key, int) and not isinstance(key, bool):
        return torch.Generator(device=device).manual_seed(key)
    raise TypeError(f"make_perturbed_fun: the first argument must be a torch.Generator or "
                    f"an int seed, got {type(key).__name__}")


def make_perturbed_fun(fun: Callable[[Any], Any], num_samples: int = 1000,
                       sigma: float = 0.1, noise: Any = None,
                       use_baseline: bool = True) -> Callable[[Any, Any], Any]:
    """``fun`` smoothed by perturbations (optax's): ``(key, x) -> estimate of
    E_z fun(x + sigma·z)``, differentiable in ``x`` whatever ``fun`` is.

    Args:
        fun: a function from a tree of tensors to a tree of tensors; it is called on the
            ``num_samples`` perturbed inputs at once through ``torch.func.vmap``.
        num_samples: the perturbed inputs averaged over (default: 1000).
        sigma: the scale of the perturbation, > 0 (default: 0.1).
        noise: an object with ``sample(generator, shape, dtype, device)`` and
            ``log_prob(z)``, as :class:`Normal` and :class:`Gumbel` (default: Gumbel).
        use_baseline: subtract ``fun`` at the unperturbed input in the estimator of the
            derivatives (variance reduction; the value is unchanged) (default: True).
    """
    noise = Gumbel() if noise is None else noise
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
        raise ValueError(f"make_perturbed_fun: num_samples must be an int >= 1, got "
                         f"{num_samples!r}")
    if not sigma > 0:
        raise ValueError(f"make_perturbed_fun: sigma must be > 0, got {sigma!r}")
    batched = torch.func.vmap(fun)

    def estimate(key: Any, x: Any) -> Any:
        _, leaves, spec = tree_lib.flatten_with_paths(x)
        if not leaves:
            raise ValueError("make_perturbed_fun: x holds no tensor")
        gen = _generator(key, leaves[0].device)
        z = [noise.sample(gen, (num_samples, *p.shape), p.dtype, p.device) for p in leaves]
        shifted = [(p + sigma * s).detach() for p, s in zip(leaves, z)]
        # The sample recomputed from x, so that its log-density carries x's gradient.
        log_prob = sum(noise.log_prob((s - p) / sigma).reshape(num_samples, -1).sum(1)
                       for p, s in zip(leaves, shifted))
        box = torch.exp(log_prob - log_prob.detach())
        outs = batched(tree_lib.unflatten(spec, shifted))
        base = fun(tree_lib.unflatten(spec, [p.detach() for p in leaves])) \
            if use_baseline else None

        def mean(out, b=None):
            w = box.reshape(-1, *([1] * (out.dim() - 1))).to(out.dtype)
            est = w * out if b is None else w * out + (1 - w) * b
            return est.mean(0)

        if base is None:
            return tree_lib.map(mean, outs)
        return tree_lib.map(mean, outs, base)

    return estimate
