"""Gradient noise: ``add_noise`` (optax's), from a counter-based hash.

The noise of an element is a function of four integers only: the seed, the step ``t``,
the leaf's position in the flattened param tree (``None`` counted as a leaf: a frozen
param keeps the positions of the others) and the element's row-major position in its
leaf. No generator state is kept or advanced, so a step is reproducible from
``(seed, t)`` alone, on every backend: the same rule body below runs as torch ops (int64
values masked to 32 bits) and in the fused Triton kernel (uint32 values, whose arithmetic
wraps), and gives the same 32-bit words, hence the same uniforms, bit for bit.

The elements of a leaf are drawn in pairs, (2k, 2k + 1) by their positions, so one
hash, one ``log``, one ``sqrt`` and one point of the unit circle serve two elements
(``o.paired``: the fused kernel computes a block's pairs once and interleaves them). Two
32-bit words per pair come from a 32-bit integer finalizer (xor-shift-multiply, Wellons'
``lowbias32``, a bijection of ``[0, 2**32)``; both multipliers are below 2**31, so an
int64 product never overflows) applied to the seed, the step, the leaf and the pair in
turn: two rounds from the pair's counter to the first word, one more to the second. Their
top 23 bits give two uniforms ``(k + 0.5) / 2**23`` (exact in float32; never 0 or 1), and
the Box-Muller transform two independent standard normals, ``r cos θ`` for the even
element and ``r sin θ`` for the odd one, ``r = sqrt(-2 ln u1)``, ``θ = 2π u2 − π/4``
(their tails end at |z| = 5.77, where u1 = 2**-24).

The angle is drawn without a library ``cos``/``sin`` (each does its own range reduction,
most of the work of a pair in the fused kernel): the top 2 bits of the second word are a
quadrant ``q``, the next 21 a uniform offset ``ρ = (4 u2 − q − 0.5)·π/2`` in (−π/4, π/4)
(exact float32 arithmetic up to that last product), so ``θ = q·π/2 + ρ``; ``sin ρ`` and
``cos ρ`` are short minimax polynomials (Cephes' ``sinf``/``cosf``, about an ulp on that
range), rotated into the quadrant by selects. Earlier builds drew ``θ = 2π u2 − π`` with
the math library's ``cos``/``sin`` (and, before that, one pair of words per element): the
noise of a given seed and step differs from theirs.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from ftopt.base import GradientTransformation, register_state
from ftopt.domains import NONNEG, check_int
from ftopt.rule_transform import rule_transform
from ftopt.rules import Rule

__all__ = ["AddNoiseState", "add_noise", "leaf_key", "mix32", "pair_words", "pair_uniforms",
           "quarter_sin_cos", "unit_circle", "pair_normals", "standard_normal"]

Float = float | torch.Tensor

_HALF = 1 << 16  # the seed and the step reach the kernel as two 16-bit halves (exact)
_GOLDEN = 0x61C88647  # 2**32 / golden ratio, negated modulo 2**32: spreads leaf positions
_SECOND = 0x2545F491  # separates an element's second word from its first


@register_state
class AddNoiseState(NamedTuple):
    """The step count of :func:`add_noise` (the noise depends on it; optax's ``rng_key`` is
    replaced by the seed, a hyperparameter)."""

    count: Any


def mix32(o, h):
    """A 32-bit finalizer: xor-shift-multiply rounds, a bijection of ``[0, 2**32)``."""
    h = o.xor(h, o.shr(h, 16))
    h = o.mul32(h, 0x21F0AAAD)
    h = o.xor(h, o.shr(h, 15))
    h = o.mul32(h, 0x735A2D97)
    return o.xor(h, o.shr(h, 15))


def leaf_key(o, x):
    """The 32-bit key of a leaf at a step, from ``x.seed_lo``/``x.seed_hi`` and
    ``x.t_lo``/``x.t_hi`` (16-bit halves) and ``x.leaf`` (per-leaf values in the kernel)."""
    seed = o.add32(o.u32(x.seed_lo), o.mul32(o.u32(x.seed_hi), _HALF))
    step = o.add32(o.u32(x.t_lo), o.mul32(o.u32(x.t_hi), _HALF))
    step_key = mix32(o, o.xor(mix32(o, seed), step))
    return mix32(o, o.xor(step_key, mix32(o, o.add32(x.leaf, _GOLDEN))))


def pair_words(o, k, key):
    """Two 32-bit words for pair ``k`` of the leaf of ``key``: three finalizer rounds."""
    first = mix32(o, mix32(o, o.add32(k, key)))
    second = mix32(o, o.add32(first, _SECOND))
    return first, second


def _unit(o, word):
    """The top 23 bits of a word as a float32 in (0, 1): (k + 0.5) / 2**23, exact."""
    return (o.to_float(o.shr(word, 9)) + 0.5) * (1.0 / (1 << 23))


def pair_uniforms(o, k, key):
    """Two uniforms in (0, 1) for pair ``k`` (see :func:`pair_words`)."""
    first, second = pair_words(o, k, key)
    return _unit(o, first), _unit(o, second)


def quarter_sin_cos(r):
    """``(sin r, cos r)`` for |r| <= π/4 in float32 arithmetic alone: Cephes' ``sinf`` and
    ``cosf`` minimax polynomials (about an ulp on that range; not range-reduced)."""
    z = r * r
    sin = r + r * z * (-1.6666654611e-1 + z * (8.3321608736e-3 + z * -1.9515295891e-4))
    cos = 1.0 - 0.5 * z + z * z * (4.166664568298827e-2 + z * (
        -1.388731625493765e-3 + z * 2.443315711809948e-5))
    return sin, cos


def unit_circle(o, word):
    """``(cos θ, sin θ)`` of the angle ``θ = 2π u2 − π/4`` of a word, ``u2`` its uniform
    (:func:`_unit`), with no ``cos``/``sin`` of a math library: the word's top 2 bits are
    the quadrant ``q`` of ``θ = q·π/2 + ρ``, the next 21 bits ``j`` the offset
    ``ρ = (4 u2 − q − 0.5)·π/2 = (j + 0.5 − 2**20)·π/2**22`` in (−π/4, π/4) (exact up to
    that product; ``j = k − q·2**21`` of the top 23 bits ``k``), whose sine and cosine
    (:func:`quarter_sin_cos`) the quadrant rotates: (c, s), (−s, c), (−c, −s), (s, −c)."""
    q = o.to_float(o.shr(word, 30))
    j = o.to_float(o.shr(word, 9)) - q * float(1 << 21)
    s, c = quarter_sin_cos((j - (float(1 << 20) - 0.5)) * (math.pi / (1 << 22)))
    odd = (q == 1.0) | (q == 3.0)  # q·π/2 swaps the sine and the cosine
    x, y = o.where(odd, s, c), o.where(odd, c, s)
    cos_negative = (q == 1.0) | (q == 2.0)
    return o.where(cos_negative, -x, x), o.where(q >= 2.0, -y, y)


def pair_normals(o, k, key):
    """Two independent N(0, 1) draws for pair ``k``: Box-Muller, ``r cos θ`` and
    ``r sin θ``, ``r = sqrt(-2 ln u1)``, ``θ = 2π u2 − π/4`` (:func:`unit_circle`).

    Everything but ``log`` is float32 arithmetic, the same bits on every backend where no
    multiply and add are contracted into one (the fused kernel may: an ulp or two of the
    polynomials); ``log`` comes from the backend's math library (torch's, the Triton
    interpreter's numpy, the GPU's libdevice), which may differ by an ulp or two."""
    first, second = pair_words(o, k, key)
    radius = o.sqrt(-2.0 * o.log(_unit(o, first)))
    cos, sin = unit_circle(o, second)
    return radius * cos, radius * sin


def standard_normal(o, x):
    """One N(0, 1) draw per element: the even or odd draw of its pair (``x.index >> 1``)."""
    return o.paired(pair_normals, x.index, leaf_key(o, x))


def _noise_body(o, x):
    return x.u + x.std * standard_normal(o, x), {}


def _noise_scalars(t, h: dict) -> dict:
    """The standard deviation sqrt(eta / t**gamma) and the step's 16-bit halves (host ints,
    or float64 tensors for a device count)."""
    return {"std": (h["eta"] / t ** h["gamma"]) ** 0.5, "t_lo": t % _HALF, "t_hi": t // _HALF}


def add_noise(eta: Float = 0.01, gamma: Float = 0.55, seed: int = 0) -> GradientTransformation:
    """Gaussian gradient noise with annealed variance, as optax's ``add_noise``.

    u ← u + σₜ·z, σₜ² = eta / tᵍᵃᵐᵐᵃ (t the step count after increment, 1 on the first
    step: optax's ``eta / (1 + count)**gamma``), z ~ N(0, 1) independent per element.

    z is drawn from a counter-based hash of (seed, t, the leaf's position in the flattened
    param tree, ``None`` counted as a leaf, the element's row-major position in its leaf)
    by Box-Muller, two elements (2k, 2k + 1) per draw (see the module docstring): the same
    seed gives the same noise on every backend and every call, with no generator state. On
    DTensor shards the element's position is the one in the full tensor, so a sharded run
    draws the single-process noise on any number of ranks (a shard that is not one run of
    the full tensor, ``Shard(1)`` of a matrix, is refused). The uniforms are the same bits
    everywhere; z agrees to within the ``log`` of each backend's math library and the fused
    kernel's contracted multiply-adds (a few float32 ulps of |z| + 1). Noise values differ
    from those of earlier builds: before the pairing, and before the angle's sine and
    cosine were polynomials (``θ = 2π u2 − π`` with the math library's ``cos``/``sin``).
    With ``skip_zeros`` no noise is added where the gradient is zero. The chunked CPU
    evaluator does not run it (the eager torch ops do).

    Args:
        eta: the variance of the first step's noise, >= 0 (default: 0.01).
        gamma: the decay exponent of the variance (default: 0.55).
        seed: an int in [0, 2**32) (default: 0; optax's ``key``).
    """
    seed = check_int("add_noise", "seed", seed, 0)
    if seed >= 1 << 32:
        raise ValueError(f"add_noise: seed must be an int in [0, 2**32), got {seed}")
    rule = Rule(
        "add_noise",
        _noise_body,
        state_class=AddNoiseState,
        hparams={"eta": eta, "gamma": gamma, "seed_lo": float(seed % _HALF),
                 "seed_hi": float(seed // _HALF)},
        domains={"eta": NONNEG},
        scalars=_noise_scalars,
        counted=True,
        indexed=True,
    )
    return rule_transform(rule)
