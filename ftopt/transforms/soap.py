"""SOAP (optax.contrib's ``scale_by_soap``): Adam run in the eigenbasis of Shampoo's
preconditioner, a stateful matrix stage (:mod:`ftopt.matrix`).

Per leaf and per axis of size at most ``max_precond_dim``, a Kronecker factor
``GG_i ← β·GG_i + (1−β)·(g contracted with itself over every other axis)`` and an
orthogonal basis ``Q_i``. The gradient is rotated into the basis (each axis multiplied by
``Q_iᵀ``), Adam's moments are kept there, and the step is rotated back. The first step
only builds the factors and their eigenbases (its update is zero); every
``precondition_frequency`` steps after it the bases are refined by one power iteration
and a QR decomposition, the second moment permuted to the new order of the eigenvalues
and the momentum carried over into the new basis. Each basis vector is signed, its
largest entry positive, so every backend and device keeps the same bases (optax keeps
LAPACK's signs, which the update does not depend on).

Rotated states have no element of the parameter's own: with ``skip_zeros`` the update
is zero (the param kept) where the gradient is zero, and every state advances (as GaLore's
projected states, SPEC §3).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import optree
import torch

from ftopt import eager, shards
from ftopt import tree as tree_lib
from ftopt._counts import new_count, remember_count
from ftopt.base import GradientTransformation, register_owner, register_state
from ftopt.domains import NONNEG, UNIT_OPEN, check_finite
from ftopt.matrix import StatefulStage, decompose_finite, flat_params, refuse_split
from ftopt.program import skip_update
from ftopt.rules import compute_dtype, state_dtype
from ftopt.validate import check_count, check_leaf, check_stage_state

__all__ = ["SoapState", "scale_by_soap"]

_PLACEHOLDER = (0, 0)  # the factor of an axis that is not preconditioned
_READS = "SOAP's factors and rotations read the whole leaf"


@register_state
class SoapState(NamedTuple):
    """SOAP's step count, Adam's moments in the rotated basis (shaped as the params), and
    per axis ``i`` a tree like the params of Kronecker factors ``gg[i]`` and bases
    ``q[i]``: ``(n_i, n_i)`` where axis ``i`` (of size ``n_i``) is preconditioned,
    ``(0, 0)`` where it is not (too large, a 1-D leaf without ``precondition_1d``, or a
    leaf with fewer axes). optax keeps one ``Preconditioner`` tuple per leaf instead."""

    count: torch.Tensor
    exp_avg: Any
    exp_avg_sq: Any
    gg: tuple
    q: tuple


class Soap(StatefulStage):
    """The stage behind :func:`scale_by_soap`."""

    uses_params = False
    name = "scale_by_soap"
    how = "torch, leaves batched by shape: eigh and QR of each factor"

    def __init__(self, b1: float, b2: float, shampoo_beta: float, eps: float,
                 frequency: int, max_dim: int, precondition_1d: bool,
                 mu_dtype: torch.dtype | None):
        self.b1, self.b2, self.beta, self.eps = b1, b2, shampoo_beta, eps
        self.frequency, self.max_dim, self.precondition_1d = frequency, max_dim, precondition_1d
        self.mu_dtype = mu_dtype
        register_owner(self)

    def _axes(self, shape: Sequence[int]) -> list[bool]:
        """Which axes of a leaf of ``shape`` are preconditioned."""
        if len(shape) == 1 and not self.precondition_1d:
            return [False]
        return [n <= self.max_dim for n in shape]

    def _factor_shapes(self, shape: Sequence[int], rank: int) -> list[tuple[int, int]]:
        on = self._axes(shape)
        return [(shape[i], shape[i]) if i < len(shape) and on[i] else _PLACEHOLDER
                for i in range(rank)]

    # -- init ------------------------------------------------------------------------------
    def init(self, params) -> SoapState:
        spec, paths, flat = flat_params(params)
        for path, p in zip(paths, flat):
            if p is not None and shards.is_dtensor(p) and shards.split_dims(p):
                refuse_split(self.name, path, tuple(p.placements), _READS)
        rank = max((p.dim() for p in flat if p is not None), default=0)
        moments = [None if p is None else torch.zeros(
            p.shape, dtype=self.mu_dtype or state_dtype(p), device=p.device) for p in flat]
        factors = [[None if p is None else torch.zeros(s, dtype=torch.float32, device=p.device)
                    for s in (self._factor_shapes(p.shape, rank) if p is not None
                              else [None] * rank)] for p in flat]

        def trees(rows):
            return tuple(optree.tree_unflatten(spec, [row[i] for row in rows])
                         for i in range(rank))

        device = tree_lib.state_device([p for p in flat if p is not None])
        return SoapState(new_count(0, device), optree.tree_unflatten(spec, moments),
                         optree.tree_unflatten(spec, [None if m is None else m.clone()
                                                      for m in moments]),
                         trees(factors), trees([[None if f is None else f.clone()
                                                 for f in row] for row in factors]))

    # -- checks ----------------------------------------------------------------------------
    def check_shards(self, paths: Sequence[str], u_flat: Sequence[Any]) -> None:
        for path, u in zip(paths, u_flat):
            split = shards.leaf_split(path) if u is not None else None
            if split is not None and split[1]:
                refuse_split(self.name, path, split[0], _READS)

    def check_state(self, state: Any, u_flat: Sequence[Any], p_flat: Sequence[Any],
                    spec: Any, paths: Sequence[str]) -> None:
        """Raise (naming the leaf's path) unless ``state`` is a :class:`SoapState` whose
        leaves have the shapes ``init`` gives for these updates."""
        if not isinstance(state, SoapState):
            raise TypeError(f"{self.name}: expected a SoapState, got {type(state).__name__}")
        check_count(self.name, state.count)
        self.check_shards(paths, u_flat)
        if not isinstance(state.gg, tuple) or not isinstance(state.q, tuple) or \
                len(state.gg) != len(state.q):
            raise TypeError(f"{self.name}: state.gg and state.q must be tuples of one tree "
                            "per axis, of one length")
        rank = len(state.gg)
        flat = _flat_state(state, spec, paths)
        for i, u in enumerate(u_flat):
            if u is None:
                continue
            check_leaf(paths[i], u, p_flat[i], p_flat[i] is not None)
            if u.dim() > rank:
                raise ValueError(f"state gg at {paths[i]}: {rank} factors for a leaf of "
                                 f"rank {u.dim()}")
            want = ([tuple(u.shape)] * 2 + self._factor_shapes(u.shape, rank) * 2)
            names = (["exp_avg", "exp_avg_sq"] + [f"gg[{k}]" for k in range(rank)]
                     + [f"q[{k}]" for k in range(rank)])
            for name, leaves, shape in zip(names, flat, want):
                check_stage_state(name, paths[i], leaves[i], shape, u.device)

    # -- update (StatefulStage's) ------------------------------------------------------------
    def run_flat(self, u_flat, zero_flat, state, p_flat, spec, paths):
        """The new updates and state for flat leaves (see :mod:`ftopt.matrix`)."""
        del p_flat
        known = eager.known_count(state.count)
        t = (known if known is not None else int(state.count)) + 1
        count = state.count + 1
        remember_count(count, t)
        rank = len(state.gg)
        m_flat, v_flat, *factors = _flat_state(state, spec, paths)
        gg_flat, q_flat = factors[:rank], factors[rank:]
        out = list(u_flat)
        new = [list(x) for x in (m_flat, v_flat, *gg_flat, *q_flat)]
        groups: dict[tuple, list[int]] = {}
        for i, u in enumerate(u_flat):
            if u is not None:  # (leaves of one shape and layout: one batch)
                key = (tuple(u.shape), compute_dtype(u), u.device, m_flat[i].dtype,
                       tuple(gg_flat[k][i].numel() > 0 for k in range(rank)))
                groups.setdefault(key, []).append(i)
        for (shape, dtype, _, _, flags), idx in groups.items():
            g = torch.stack([u_flat[i].to(dtype) for i in idx])
            m, v = (torch.stack([x[i] for i in idx]) for x in (m_flat, v_flat))
            on = list(flags[:len(shape)])
            gg = [torch.stack([gg_flat[k][i] for i in idx]) if k < len(on) and on[k] else None
                  for k in range(rank)]
            q = [torch.stack([q_flat[k][i] for i in idx]) if k < len(on) and on[k] else None
                 for k in range(rank)]
            step, m, v, gg, q = self._batch(g, m, v, gg, q, on, t)
            for j, i in enumerate(idx):
                out[i] = step[j]
                new[0][i], new[1][i] = m[j], v[j]
                for k in range(rank):
                    if gg[k] is not None:
                        new[2 + k][i], new[2 + rank + k][i] = gg[k][j], q[k][j]
        if zero_flat is not None:
            out = [x if x is None or z is None else skip_update(x, z)
                   for x, z in zip(out, zero_flat)]
        trees = [optree.tree_unflatten(spec, x) for x in new]
        return out, SoapState(count, trees[0], trees[1], tuple(trees[2:2 + rank]),
                              tuple(trees[2 + rank:]))

    def _batch(self, g, m, v, gg, q, on, t):
        """Step ``t`` (1 the first) of a batch of equal leaves ``g`` ``(B, *shape)``: the
        updates and the new states (``on``: the preconditioned axes; ``gg``, ``q``: per
        axis a ``(B, n, n)`` stack, ``None`` where an axis is not preconditioned)."""
        gg = [None if f is None else _lerp(f, _outer(g, k), 1.0 - self.beta)
              for k, f in enumerate(gg)]
        if t == 1:  # the factors' eigenbases, no update
            return torch.zeros_like(g), m, v, gg, [None if f is None else _eigenbasis(f)
                                                   for f in gg]
        dtype = m.dtype
        r = _project(g, q, on)
        m32 = torch.lerp(m.to(r.dtype), r, 1.0 - self.b1)
        v32 = torch.lerp(v.to(r.dtype), r * r, 1.0 - self.b2)
        # (every new state row-major, as a donated step's buffers are: a matrix product
        # reading them rounds otherwise on other strides, so the two would drift apart)
        m_new, v_new = (x.to(dtype).contiguous() for x in (m32, v32))
        k = t - 1  # (the first step kept no moments)
        scale = (1.0 - self.b2 ** k) ** 0.5 / (1.0 - self.b1 ** k)
        step = _project_back(m_new.to(r.dtype) / (v_new.to(r.dtype).sqrt() + self.eps), q,
                             on) * scale
        if k % self.frequency == 0:
            q_new, v32 = _refine(gg, q, v_new.to(r.dtype), on)
            m32 = _project(_project_back(m_new.to(r.dtype), q, on), q_new, on)
            q, m_new, v_new = q_new, m32.to(dtype).contiguous(), v32.to(dtype).contiguous()
        return step.contiguous(), m_new, v_new, gg, q


def _lerp(a: torch.Tensor, b: torch.Tensor, w: float) -> torch.Tensor:
    return a + w * (b - a)


def _outer(g: torch.Tensor, axis: int) -> torch.Tensor:
    """Each leaf of the batch ``g`` contracted with itself over every axis but ``axis``:
    ``(B, n, n)``."""
    x = g.movedim(axis + 1, 1).reshape(g.shape[0], g.shape[axis + 1], -1)
    return x @ x.transpose(1, 2)


def _rotate(g: torch.Tensor, q: Sequence[Any], on: Sequence[bool], back: bool
            ) -> torch.Tensor:
    """Each preconditioned axis ``i`` of the batch ``g`` multiplied by ``Q_iᵀ`` (into the
    basis) or ``Q_i`` (``back``); each axis in turn moves last, so the order is kept."""
    for i, flag in enumerate(on):
        g = g.movedim(1, -1)
        if flag:
            b = q[i].transpose(1, 2) if back else q[i]
            g = (g.reshape(g.shape[0], -1, g.shape[-1]) @ b).reshape(g.shape)
    return g


def _project(g, q, on) -> torch.Tensor:
    return _rotate(g, q, on, back=False)


def _project_back(g, q, on) -> torch.Tensor:
    return _rotate(g, q, on, back=True)


def _signed(q: torch.Tensor) -> torch.Tensor:
    """Each basis vector (a column of each matrix of ``q``) with its entry of the largest
    magnitude positive. An eigenvector's or QR column's sign is arbitrary, and LAPACK's
    choice flips under perturbations at rounding level: from two Kronecker factors 1.7e-7
    apart, relative, ``eigh`` returned two of 16 well separated eigenvectors negated
    (CPU fuzz seed 213, fused against eager). The update does not depend on these signs;
    the state, a checkpoint and other backends and devices then hold the same basis."""
    at = q.abs().argmax(dim=-2, keepdim=True)
    return q * torch.where(torch.take_along_dim(q, at, dim=-2) < 0, -1.0, 1.0).to(q.dtype)


def _eigenbasis(f: torch.Tensor) -> torch.Tensor:
    """The eigenvectors of each factor (plus 1e-30·I), largest eigenvalue first, signed
    (:func:`_signed`)."""
    eye = torch.eye(f.shape[-1], dtype=f.dtype, device=f.device)
    # (row-major, as the state's buffers are: LAPACK returns column-major; a factor with a
    # NaN, from a gradient with one or normalized from all zeros, gets a NaN basis)
    vectors = decompose_finite(lambda x: torch.linalg.eigh(x).eigenvectors, f + 1e-30 * eye,
                               eye)
    return _signed(vectors.flip(-1)).contiguous()


def _refine(gg, q, v, on) -> tuple[list, torch.Tensor]:
    """One power iteration and QR per preconditioned axis, the basis first ordered by
    its estimated eigenvalues (descending; ``v`` permuted alike along that axis), then
    signed (:func:`_signed`)."""
    new = list(q)
    for i, flag in enumerate(on):
        if not flag:
            continue
        est = torch.diagonal(q[i].transpose(1, 2) @ gg[i] @ q[i], dim1=1, dim2=2)
        order = torch.argsort(est, dim=1, stable=True).flip(1)  # (ties as numpy's [::-1])
        shape = [v.shape[0]] + [1] * (v.dim() - 1)
        shape[i + 1] = order.shape[1]
        v = torch.take_along_dim(v, order.reshape(shape), dim=i + 1)
        ordered = torch.take_along_dim(q[i], order[:, None, :], dim=2)
        new[i] = _signed(torch.linalg.qr(gg[i] @ ordered).Q).contiguous()
    return new, v


def _flat_state(state: SoapState, spec, paths) -> list[list]:
    """``exp_avg``, ``exp_avg_sq``, each ``gg[i]`` and each ``q[i]``, flattened against
    the updates' structure."""
    fields = [("exp_avg", state.exp_avg), ("exp_avg_sq", state.exp_avg_sq)]
    fields += [(f"gg[{i}]", x) for i, x in enumerate(state.gg)]
    fields += [(f"q[{i}]", x) for i, x in enumerate(state.q)]
    return [tree_lib.flatten_like(spec, tree, f"state {name}", paths) for name, tree in fields]


def scale_by_soap(
    b1: float = 0.95,
    b2: float = 0.95,
    shampoo_beta: float = -1.0,
    eps: float = 1e-8,
    precondition_frequency: int = 10,
    max_precond_dim: int = 10000,
    precondition_1d: bool = False,
    mu_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """SOAP's update (optax.contrib's ``scale_by_soap``; see the module docstring).

    Step 1: ``GG_i`` from the gradient, ``Q_i`` its eigenvectors (descending), update 0.
    Step t > 1 (k = t − 1): r = g rotated into the basis; ``m ← b1·m + (1−b1)·r``,
    ``v ← b2·v + (1−b2)·r²``; the update is ``m/(√v + eps)`` rotated back, times
    ``√(1−b2ᵏ)/(1−b1ᵏ)``; then ``GG_i`` updated with g, and when ``k`` is a multiple of
    ``precondition_frequency`` each ``Q_i`` refined (power iteration, QR), ``v`` permuted
    and ``m`` carried into the new basis. Matrix products in fp32 (optax's ``precision``
    is JAX's; ``qr_dtype`` is fp32 here). The step count is read on the host (which
    branch to run), so the step does not run under ``torch.func.vmap``; and
    differentiating through it is ill-defined where a factor has repeated eigenvalues
    (``eigh``'s derivative), as the rank-deficient factors of the first steps do.

    Args:
        b1: the momentum's decay, in [0, 1) (default: 0.95).
        b2: the second moment's decay, in [0, 1) (default: 0.95).
        shampoo_beta: the factors' decay, in [0, 1), or negative for ``b2`` (default: −1).
        eps: added to √v, >= 0 (default: 1e-8).
        precondition_frequency: steps between refinements of the bases, >= 1
            (default: 10).
        max_precond_dim: axes longer than this are not preconditioned (Adam along them)
            (default: 10000).
        precondition_1d: precondition 1-D leaves too (default: False).
        mu_dtype: the storage dtype of both moments (default: the params' compute dtype).
    """
    b1 = check_finite("scale_by_soap", "b1", b1, UNIT_OPEN)
    b2 = check_finite("scale_by_soap", "b2", b2, UNIT_OPEN)
    shampoo_beta = check_finite("scale_by_soap", "shampoo_beta", shampoo_beta)
    if shampoo_beta < 0:
        shampoo_beta = b2
    shampoo_beta = check_finite("scale_by_soap", "shampoo_beta", shampoo_beta, UNIT_OPEN)
    eps = check_finite("scale_by_soap", "eps", eps, NONNEG)
    for name, value in (("precondition_frequency", precondition_frequency),
                        ("max_precond_dim", max_precond_dim)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"scale_by_soap: {name} must be an int >= 1, got {value!r}")
    if mu_dtype is not None and not (isinstance(mu_dtype, torch.dtype)
                                     and mu_dtype.is_floating_point):
        raise TypeError(f"scale_by_soap: mu_dtype must be a floating torch.dtype or None, "
                        f"got {mu_dtype!r}")
    stage = Soap(b1, b2, shampoo_beta, eps, precondition_frequency, max_precond_dim,
                 bool(precondition_1d), mu_dtype)
    return GradientTransformation(stage.init, stage.update)
