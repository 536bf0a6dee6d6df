"""Float64 reference of ``noisy_sgd`` (nothing here imports ftopt), conventions as in
``reference.py`` (``t`` from 1, ``p_new = p + last_update``).

optax's chain ``add_noise(eta, gamma) -> scale_by_learning_rate(lr)``:
u = -lr·(g + σₜ·z), σₜ = sqrt(eta / t**gamma), with z recomputed here from the documented
draw (ftopt/transforms/noise.py): 32-bit words of (seed, t, leaf position in the sorted
dict, pair index k = element index >> 1) in Python-int / int64 arithmetic, then
Box-Muller in float64: r·cos θ for element 2k, r·sin θ for element 2k + 1, θ = 2π u2 − π/4.
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64
M32 = 0xFFFFFFFF


def mix32(h):
    """xor-shift-multiply finalizer on 32-bit values (ints or int64 tensors)."""
    h = h ^ (h >> 16)
    h = (h * 0x21F0AAAD) & M32
    h = h ^ (h >> 15)
    h = (h * 0x735A2D97) & M32
    return h ^ (h >> 15)


def words(seed: int, t: int, leaf: int, index: torch.Tensor):
    """The two words of each element's pair (``index``: element positions, int64)."""
    step_key = mix32(mix32(seed & M32) ^ (t & M32))
    leaf_key = mix32(step_key ^ mix32((leaf + 0x61C88647) & M32))
    pair = (index & M32) >> 1
    first = mix32(mix32((pair + leaf_key) & M32))
    second = mix32((first + 0x2545F491) & M32)
    return first, second


def normals(seed: int, t: int, leaf: int, shape, start: int = 0) -> torch.Tensor:
    """z of a leaf of ``shape`` whose first element is at position ``start``."""
    index = torch.arange(start, start + math.prod(shape), dtype=torch.int64)
    first, second = words(seed, t, leaf, index)
    u1 = ((first >> 9).to(F64) + 0.5) / 2**23
    u2 = ((second >> 9).to(F64) + 0.5) / 2**23
    radius, angle = torch.sqrt(-2.0 * torch.log(u1)), 2 * math.pi * u2 - math.pi / 4
    z = torch.where(index % 2 == 0, radius * torch.cos(angle), radius * torch.sin(angle))
    return z.reshape(shape)


class RefNoisySGD:
    def __init__(self, lr, eta=0.01, gamma=0.55, seed=0):
        self.lr, self.eta, self.gamma, self.seed = lr, eta, gamma, seed
        self.t = 0
        self.last_update: dict = {}

    def step(self, params: dict, grads: dict) -> dict:
        self.t += 1
        sigma = math.sqrt(self.eta / self.t**self.gamma)
        out = {}
        for leaf, k in enumerate(sorted(params)):  # the flattened order of a dict
            p = params[k].detach().to(F64)
            g = grads[k].detach().to(F64)
            u = -self.lr * (g + sigma * normals(self.seed, self.t, leaf, tuple(p.shape)))
            self.last_update[k] = u
            out[k] = p + u
        return {k: out[k] for k in params}
