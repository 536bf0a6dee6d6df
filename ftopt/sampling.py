"""optax's ``multi_normal``: a diagonal Gaussian parametrised by its mean and log scale
(``optax._src.utils.MultiNormalDiagFromLogScale``), and the seeded generators that stand
for JAX's PRNG keys in ftopt's random utilities.

Randomness: where optax takes a JAX PRNG key, ftopt takes an ``int`` seed (or a 0-d
integer tensor holding one) or a ``torch.Generator``. A seed makes a fresh generator on
the device of the data, so the same seed gives the same draws on every call (as a JAX
key does); a generator is used as it is and advances (torch's stateful convention), its
draws made on its own device and moved to the data's. The draws follow the same
distribution as optax's but are not the same numbers: JAX's threefry streams and torch's
generators differ, and the CPU and CUDA generators differ from each other.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch

from ftopt.domains import check_int

__all__ = ["MultiNormalDiagFromLogScale", "multi_normal", "generator_for", "Key"]

Key = int | torch.Tensor | torch.Generator
_SEED_LIMIT = 2**64


def generator_for(owner: str, key: Any, device: torch.device,
                  argument: str = "key") -> torch.Generator:
    """The generator that ``key`` stands for (see the module docstring): ``key`` itself if
    it is a ``torch.Generator``, else a new generator on ``device`` seeded with it.

    Raises:
        TypeError: ``key`` is neither an int, a 0-d integer tensor nor a generator.
        ValueError: a negative seed, one of 2**64 or more, or a tensor that is not 0-d.
    """
    if isinstance(key, torch.Generator):
        return key
    if isinstance(key, torch.Tensor):
        if key.ndim != 0 or key.is_floating_point() or key.is_complex() \
                or key.dtype == torch.bool:
            raise ValueError(f"{owner}: {argument} must be an int seed, a 0-d integer tensor "
                             f"or a torch.Generator, got a tensor of shape "
                             f"{tuple(key.shape)} and dtype {key.dtype}")
        key = int(key)
    if not isinstance(key, numbers.Integral) or isinstance(key, bool):
        raise TypeError(f"{owner}: {argument} must be an int seed, a 0-d integer tensor or a "
                        f"torch.Generator, got {type(key).__name__}")
    seed = check_int(owner, argument, key, 0)
    if seed >= _SEED_LIMIT:
        raise ValueError(f"{owner}: {argument} must be below 2**64, got {seed}")
    return torch.Generator(device=device).manual_seed(seed)


def _real(name: str, value: Any) -> torch.Tensor:
    """``value`` as a real floating tensor (the same object if it already is one)."""
    if isinstance(value, torch.Tensor):
        if value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"multi_normal: {name} must be real, got dtype {value.dtype}")
        return value if value.is_floating_point() else value.to(torch.float32)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=torch.float32)
    raise TypeError(f"multi_normal: {name} must be a tensor or a real number, got "
                    f"{type(value).__name__}")


def _broadcast(loc: torch.Size, log_scale: torch.Size) -> tuple[int, ...]:
    n = max(len(loc), len(log_scale))
    a = (1,) * (n - len(loc)) + tuple(loc)
    b = (1,) * (n - len(log_scale)) + tuple(log_scale)
    out = []
    for x, y in zip(a, b):
        if x != y and 1 not in (x, y):
            raise ValueError(f"multi_normal: Incompatible shapes for broadcasting: loc "
                             f"{tuple(loc)} and log_scale {tuple(log_scale)}")
        out.append(y if x == 1 else x)
    return tuple(out)


class MultiNormalDiagFromLogScale:
    r"""A Gaussian with diagonal covariance, ``N(loc, diag(exp(log_scale))²)``, over
    ``param_shape = broadcast(loc.shape, log_scale.shape)`` (optax's class of this name).

    ``loc`` and ``log_scale`` are kept as given (a tensor is not copied, so gradients
    reach it through :meth:`sample` and :meth:`log_prob`); an integer tensor or a Python
    number becomes a float32 tensor (JAX's default dtype).
    """

    def __init__(self, loc: torch.Tensor | float, log_scale: torch.Tensor | float):
        self._log_scale = _real("log_scale", log_scale)
        self._mean = _real("loc", loc)
        if self._mean.device != self._log_scale.device:
            raise ValueError(f"multi_normal: loc is on {self._mean.device} but log_scale on "
                             f"{self._log_scale.device}")
        self._scale = torch.exp(self._log_scale)
        self._param_shape = _broadcast(self._mean.shape, self._scale.shape)

    def sample(self, shape: Sequence[int], key: Key) -> torch.Tensor:
        r"""``len(shape)`` batch dimensions of draws: ``ε · exp(log_scale) + loc`` with
        ``ε ~ N(0, 1)`` of shape ``(*shape, *param_shape)``.

        ``key``: an int seed or a ``torch.Generator`` (see the module docstring: the draws
        differ from JAX's for the same seed). ``ε`` is drawn in float32, or float64 where
        ``loc`` or ``log_scale`` is float64 (as JAX's ``random.normal`` under x64), so the
        samples have the dtype of ``ε · scale + loc``.
        """
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
            raise TypeError(f"multi_normal.sample: shape must be a sequence of ints, got "
                            f"{type(shape).__name__}")
        dims = tuple(check_int("multi_normal.sample", "shape", d, 0) for d in shape)
        device = self._mean.device
        generator = generator_for("multi_normal.sample", key, device)
        dtype = torch.promote_types(torch.promote_types(self._mean.dtype, self._scale.dtype),
                                    torch.float32)
        eps = torch.randn(dims + self._param_shape, generator=generator, dtype=dtype,
                          device=generator.device).to(device)
        return eps * self._scale + self._mean

    def log_prob(self, x: torch.Tensor | float) -> torch.Tensor:
        r"""``Σ log N(x; loc, scale²)`` over the trailing ``len(param_shape)`` axes, with
        each term ``−(log(2π·scale²) + (x − loc)²/scale²) / 2`` (``jax.scipy.stats.norm``'s
        ``logpdf``); leading axes of ``x`` beyond ``param_shape`` are kept (a batch)."""
        x = torch.as_tensor(x, device=self._mean.device)
        if x.is_complex() or x.dtype == torch.bool:
            raise ValueError(f"multi_normal.log_prob: x must be real, got dtype {x.dtype}")
        dtype = torch.promote_types(torch.promote_types(x.dtype, self._mean.dtype),
                                    self._scale.dtype)
        if not dtype.is_floating_point:
            dtype = torch.float32
        x = x.to(dtype)
        var = self._scale.to(dtype).square()
        log_normalizer = torch.log(2 * math.pi * var)
        quadratic = (x - self._mean.to(dtype)).square() / var
        log_prob = (log_normalizer + quadratic) / -2
        if not self._param_shape:
            return log_prob
        return log_prob.sum(dim=tuple(range(-len(self._param_shape), 0)))

    @property
    def log_scale(self) -> torch.Tensor:
        """``log_scale`` as given."""
        return self._log_scale

    @property
    def params(self) -> list[torch.Tensor]:
        """``[loc, log_scale]`` (optax's order)."""
        return [self._mean, self._log_scale]


def multi_normal(loc: torch.Tensor | float,
                 log_scale: torch.Tensor | float) -> MultiNormalDiagFromLogScale:
    """``MultiNormalDiagFromLogScale(loc, log_scale)`` (optax's ``multi_normal``): a
    diagonal Gaussian with mean ``loc`` and standard deviation ``exp(log_scale)``.

    Raises:
        ValueError: the shapes of ``loc`` and ``log_scale`` do not broadcast ("Incompatible
            shapes for broadcasting", as optax), or a complex/bool tensor.

    Example::

        dist = ftopt.multi_normal(torch.zeros(3), torch.zeros(3))
        x = dist.sample((4,), key=0)        # shape (4, 3), the same for the same seed
        dist.log_prob(x)                    # shape (4,)
    """
    return MultiNormalDiagFromLogScale(loc, log_scale)
