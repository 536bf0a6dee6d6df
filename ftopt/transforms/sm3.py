"""SM3 (Anil et al. 2019, optax's ``scale_by_sm3`` and ``sm3``): a stateful matrix stage
(:mod:`ftopt.matrix`) whose second-moment state is one accumulator per index of each dim
of a leaf, not one per element.

For a leaf with d >= 2 dims, ``mu`` holds d vectors (``mu[i]`` of length ``shape[i]``);
an element's accumulator is the smallest of the d entries that cover it, and each entry
is then reset to the largest accumulator over the slice it covers: reductions over the
whole leaf, computed with torch ops batched over leaves of one shape. A vector's ``mu`` is
one vector, its own accumulator (a 0-d leaf: one 0-d tensor; optax has no layout for
those). ``nu`` is the per-element momentum of the scaled update.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ftopt import tree as tree_lib
from ftopt.base import GradientTransformation, register_owner, register_state
from ftopt.domains import NONNEG, UNIT, check_finite
from ftopt.matrix import check_shards, flatten_call
from ftopt.rules import check_param, compute_dtype, state_dtype
from ftopt.validate import check_layout, check_leaf

__all__ = ["ScaleBySM3State", "scale_by_sm3"]


@register_state
class ScaleBySM3State(NamedTuple):
    """SM3's accumulators (per leaf, a list of one vector per dim) and momentum."""

    mu: Any
    nu: Any


def _accumulator_shapes(shape: Sequence[int]) -> list[tuple[int, ...]]:
    if len(shape) < 2:  # a vector's accumulator is itself; a 0-d leaf's, a 0-d tensor
        return [tuple(shape)]
    return [(n,) for n in shape]


def _broadcast(v: torch.Tensor, ndim: int, dim: int) -> torch.Tensor:
    """``v`` (one entry per index of ``dim``, after a leading batch dim) as
    ``(B, 1, .., shape[dim], .., 1)``."""
    return v.reshape(v.shape[:1] + (1,) * dim + v.shape[1:] + (1,) * (ndim - dim - 1))


class SM3:
    """The stage behind :func:`scale_by_sm3` (a stateful matrix stage)."""

    matrix_stage = True
    mask_aware = True
    name = "scale_by_sm3"

    def __init__(self, b1: float, b2: float, eps: float):
        self.b1, self.b2, self.eps = b1, b2, eps
        register_owner(self)

    def check_shards(self, paths: Sequence[str], u_flat: Sequence[Any]) -> None:
        # Each accumulator is a reduction over the whole leaf: no split.
        check_shards(self.name, "leaf", lambda u: True, paths, u_flat)

    def init(self, params) -> ScaleBySM3State:
        paths, flat, spec = tree_lib.flatten_with_paths(params)
        mu, nu = [], []
        for path, p in zip(paths, flat):
            check_param(path, p)
            dtype = state_dtype(p)
            mu.append([torch.zeros(s, dtype=dtype, device=p.device)
                       for s in _accumulator_shapes(p.shape)])
            nu.append(torch.zeros(p.shape, dtype=dtype, device=p.device))
        return ScaleBySM3State(tree_lib.unflatten(spec, mu), tree_lib.unflatten(spec, nu))

    def _flat_state(self, state: Any, spec, paths) -> tuple[list, list]:
        if not isinstance(state, ScaleBySM3State):
            raise TypeError(f"{self.name}: expected a ScaleBySM3State, got "
                            f"{type(state).__name__}")
        return (tree_lib.flatten_like(spec, state.mu, "state mu", paths),
                tree_lib.flatten_like(spec, state.nu, "state nu", paths))

    def check_state(self, state: Any, u_flat: Sequence[Any], p_flat: Sequence[Any],
                    spec: Any, paths: Sequence[str]) -> None:
        """Raise (naming the leaf's path) unless ``state`` has the layout ``init`` gives
        for these updates."""
        mu, nu = self._flat_state(state, spec, paths)
        for i, u in enumerate(u_flat):
            if u is None:
                continue
            check_leaf(paths[i], u, p_flat[i], p_flat[i] is not None)
            shapes = _accumulator_shapes(u.shape)
            if not isinstance(mu[i], (list, tuple)) or len(mu[i]) != len(shapes):
                raise ValueError(f"state mu at {paths[i]}: expected a list of {len(shapes)} "
                                 f"tensors for a leaf of shape {tuple(u.shape)}, got "
                                 f"{type(mu[i]).__name__}")
            for k, (s, shape) in enumerate([(nu[i], tuple(u.shape)), *zip(mu[i], shapes)]):
                where = (f"state nu at {paths[i]}" if k == 0 else
                         f"state mu[{k - 1}] at {paths[i]} (a leaf of shape {tuple(u.shape)})")
                if not isinstance(s, torch.Tensor):
                    raise TypeError(f"{where}: expected a tensor, got {type(s).__name__}")
                check_layout("state", paths[i], s)
                if not s.is_floating_point():
                    raise TypeError(f"{where}: expected a floating-point tensor, got "
                                    f"{s.dtype}")
                if tuple(s.shape) != shape:
                    raise ValueError(f"{where}: shape {tuple(s.shape)}, expected {shape}")
                if s.device != u.device:
                    raise ValueError(f"{where}: on {s.device}, expected {u.device}")

    def update(self, updates, state, params=None, **extra):
        spec, paths, u_flat, p_flat, zero_flat = flatten_call(updates, params, extra)
        self.check_state(state, u_flat, p_flat, spec, paths)
        self.check_shards(paths, u_flat)
        out, new = self.run_flat(u_flat, zero_flat, state, p_flat, spec, paths)
        return tree_lib.unflatten(spec, out), new

    def run_flat(self, u_flat, zero_flat, state, p_flat, spec, paths):
        """The new updates and state for flat leaves (see :mod:`ftopt.matrix`)."""
        del p_flat
        mu, nu = self._flat_state(state, spec, paths)
        new_mu, new_nu, out = list(mu), list(nu), list(u_flat)
        groups: dict[tuple, list[int]] = {}
        for i, u in enumerate(u_flat):
            if u is not None:
                groups.setdefault((tuple(u.shape), compute_dtype(u), u.device), []).append(i)
        for (shape, dtype, _), idx in groups.items():
            g = torch.stack([u_flat[i].to(dtype) for i in idx])
            m = [torch.stack([mu[i][k].to(dtype) for i in idx]) for k in range(len(mu[idx[0]]))]
            v = torch.stack([nu[i].to(dtype) for i in idx])
            zero = None if zero_flat is None else torch.stack([zero_flat[i] for i in idx])
            res, m, v = self._leaves(g, m, v, zero, len(shape))
            for j, i in enumerate(idx):
                new_mu[i] = [x[j].to(mu[i][k].dtype) for k, x in enumerate(m)]
                new_nu[i] = v[j].to(nu[i].dtype)
                out[i] = res[j]
        return out, ScaleBySM3State(tree_lib.unflatten(spec, new_mu),
                                    tree_lib.unflatten(spec, new_nu))

    def _leaves(self, g, m, v, zero, ndim: int):
        """A batch ``(B, *shape)`` of one shape: (updates, accumulators, momentum)."""
        coeff = 1.0 - self.b2 if self.b2 != 1.0 else 1.0
        if ndim < 2:
            accum = coeff * g * g + self.b2 * m[0]
        else:
            least = _broadcast(m[0], ndim, 0)
            for d in range(1, ndim):
                least = torch.minimum(least, _broadcast(m[d], ndim, d))
            accum = coeff * g * g + self.b2 * least
        scaled = g * torch.where(accum > 0, (accum + self.eps).rsqrt(), 0.0)
        new_v = (1.0 - self.b1) * scaled + self.b1 * v
        if ndim < 2:
            new_m = [accum]
        elif accum.numel() == 0:  # an empty leaf: no maxima to take
            new_m = [x.clone() for x in m]
        else:
            new_m = [accum.amax(dim=[1 + k for k in range(ndim) if k != d])
                     for d in range(ndim)]
        if zero is not None:
            # The per-element states keep their bits (a vector's accumulator is one);
            # the per-dim maxima are reductions and advance (SPEC §3).
            new_v = torch.where(zero, v, new_v)
            if ndim < 2:
                new_m = [torch.where(zero, m[0], new_m[0])]
            return torch.where(zero, torch.full((), -0.0, dtype=g.dtype, device=g.device),
                               new_v), new_m, new_v
        return new_v, new_m, new_v


def scale_by_sm3(b1: float | torch.Tensor = 0.9, b2: float | torch.Tensor = 1.0,
                 eps: float | torch.Tensor = 1e-8) -> GradientTransformation:
    """Scales by SM3's cover-based second moments (Anil et al. 2019), as optax.

    With ``c = 1 − b2`` (1 when ``b2 == 1``): ``a ← c·u² + b2·min_i mu[i]`` (each element's
    smallest covering accumulator; a vector's own), ``s ← u/√(a + eps)`` where ``a > 0``
    (else 0), ``nu ← (1 − b1)·s + b1·nu``, then ``mu[i] ← max of a`` over the slice each
    entry covers; the update is ``nu``.

    A matrix stage (:mod:`ftopt.matrix`): leaves of one shape are batched, the elementwise
    stages around it fuse. With ``skip_zeros``, ``nu`` (and a vector's accumulator) keeps
    its bits where the raw gradient is zero and the update there is ``-0.0``; the per-dim
    maxima are reductions and advance. DTensor leaves must be unsplit (``Replicate``).

    Args:
        b1: the momentum's decay, in [0, 1] (default: 0.9).
        b2: the accumulators' decay, in [0, 1] (default: 1.0: a running sum).
        eps: added to the accumulator under the root, >= 0 (default: 1e-8).
    """
    b1 = check_finite("scale_by_sm3", "b1", b1, UNIT)
    b2 = check_finite("scale_by_sm3", "b2", b2, UNIT)
    eps = check_finite("scale_by_sm3", "eps", eps, NONNEG)
    obj = SM3(b1, b2, eps)
    return GradientTransformation(obj.init, obj.update)
