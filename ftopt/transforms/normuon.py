"""NorMuon (optax.contrib's ``scale_by_normuon``): Muon's orthogonalised momentum, then
each row normalised by a running mean of its squares and the matrix rescaled.

A chain of three stages: Muon's momentum (an elementwise rule: fused), the Newton-Schulz
orthogonalisation (a matrix stage) and the row normalisation, a stateful matrix stage
(:mod:`ftopt.matrix`) keeping one second moment per row. Rows are as optax has them: a
row is every axis of the leaf but the last, its mean is over the last axis.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import optree
import torch

from ftopt import matrix_views, shards
from ftopt import tree as tree_lib
from ftopt.base import GradientTransformation, register_owner, register_state
from ftopt.combine import chain
from ftopt.domains import NONNEG, UNIT_OPEN, check_finite
from ftopt.matrix import flat_params, flatten_call, is_matrix_2d, refuse_split
from ftopt.program import skip_update
from ftopt.rules import compute_dtype, state_dtype
from ftopt.transforms.muon import (
    DEFAULT_NS_COEFFS,
    check_muon_options,
    momentum_stage,
    orthogonalise,
)
from ftopt.validate import check_leaf, check_stage_state

__all__ = ["NorMuonState", "scale_by_normuon"]

Float = float | torch.Tensor
_READS = "NorMuon's row moments and norms read whole matrices"


@register_state
class NorMuonState(NamedTuple):
    """NorMuon's row second moments (optax's ``nu``): per matrix leaf of shape
    ``(..., n)`` one value per row, shape ``(...)``; a leaf the stage passes through has a
    1-element placeholder."""

    row_nu: Any


class RowNormalize:
    """The stage behind NorMuon's normalisation (a stateful matrix stage): per matrix leaf
    o, ``nu ← β2·nu + (1−β2)·mean(o², last axis)``, ``ô = o/(√nu + eps)`` (per row), and
    ``u = ô · scale·√(m·n)/(‖ô‖_F + eps)`` with ‖·‖_F and m·n per matrix."""

    matrix_stage = True
    mask_aware = True
    uses_params = False
    name = "scale_by_normuon"

    def __init__(self, beta2: float, eps: float, scale: float, dims: Any):
        self.beta2, self.eps, self.scale, self.dims = beta2, eps, scale, dims
        register_owner(self)

    def _views(self, spec, paths, u_flat, p_flat) -> list:
        """Per leaf: a :class:`ftopt.matrix_views.MatrixView` (with ``dims``), ``True`` (a
        2-D leaf, without), or ``None`` (passed through)."""
        if self.dims is not None:
            return matrix_views.views(self.name, self.dims, spec, paths, u_flat, p_flat)
        return [True if u is not None and is_matrix_2d(u) else None for u in u_flat]

    def check_shards(self, paths: Sequence[str], u_flat: Sequence[Any]) -> None:
        """Refuse a split matrix leaf (in a call on local shards); with ``dims``, in
        :meth:`check_state`, where the leaves' views are known."""
        if self.dims is None:
            self._refuse_splits(paths, self._views(None, paths, u_flat, u_flat))

    def _refuse_splits(self, paths, views) -> None:
        for path, view in zip(paths, views):
            split = shards.leaf_split(path) if view is not None else None
            if split is not None and split[1]:
                refuse_split(self.name, path, split[0], _READS)

    # -- init ------------------------------------------------------------------------------
    def init(self, params) -> NorMuonState:
        spec, paths, flat = flat_params(params)
        views = self._views(spec, paths, flat, flat)
        for path, p, view in zip(paths, flat, views):
            if view is not None and shards.is_dtensor(p) and shards.split_dims(p):
                refuse_split(self.name, path, tuple(p.placements), _READS)
        nu = [None if p is None else torch.zeros(
            _nu_shape(p, v), dtype=state_dtype(p), device=p.device)
            for p, v in zip(flat, views)]
        return NorMuonState(optree.tree_unflatten(spec, nu))

    # -- checks ----------------------------------------------------------------------------
    def check_state(self, state: Any, u_flat: Sequence[Any], p_flat: Sequence[Any],
                    spec: Any, paths: Sequence[str]) -> list:
        """Raise (naming the path) unless ``state`` is a :class:`NorMuonState` whose
        leaves have the shapes ``init`` gives for these updates; the leaves' views."""
        if not isinstance(state, NorMuonState):
            raise TypeError(f"{self.name}: expected a NorMuonState, got "
                            f"{type(state).__name__}")
        views = self._views(spec, paths, u_flat, p_flat)
        self._refuse_splits(paths, views)
        nus = tree_lib.flatten_like(spec, state.row_nu, "state row_nu", paths)
        for path, u, p, v, s in zip(paths, u_flat, p_flat, views, nus):
            if u is None:
                continue
            check_leaf(path, u, p, p is not None)
            check_stage_state("row_nu", path, s, _nu_shape(u, v), u.device)
        return views

    # -- update ----------------------------------------------------------------------------
    def update(self, updates, state, params=None, **extra):
        spec, paths, u_flat, p_flat, zero_flat = flatten_call(updates, params, extra)
        out, new = self.run_flat(u_flat, zero_flat, state, p_flat, spec, paths)
        return tree_lib.unflatten(spec, out), new

    def run_flat(self, u_flat, zero_flat, state, p_flat, spec, paths):
        """The new updates and state for flat leaves (see :mod:`ftopt.matrix`)."""
        views = self.check_state(state, u_flat, p_flat, spec, paths)
        nus = tree_lib.flatten_like(spec, state.row_nu, "state row_nu", paths)
        out, new_nus = list(u_flat), list(nus)
        groups: dict[tuple, list[int]] = {}
        for i, (u, v) in enumerate(zip(u_flat, views)):
            if u is None:
                continue
            if v is None:
                out[i] = u.to(compute_dtype(u))
                continue
            key = (tuple(u.shape), compute_dtype(u), u.device,
                   None if v is True else (v.perm, v.shape))
            groups.setdefault(key, []).append(i)
        for (_, dtype, _, _), idx in groups.items():
            o = torch.stack([u_flat[i].to(dtype) for i in idx])
            nu = torch.stack([nus[i].to(dtype) for i in idx])
            nu = torch.lerp(nu, (o * o).mean(dim=-1), 1.0 - self.beta2)
            o_hat = o / (nu.sqrt().unsqueeze(-1) + self.eps)
            res = o_hat * self._matrix_scale(o_hat, views[idx[0]])
            for j, i in enumerate(idx):
                new_nus[i] = nu[j].to(nus[i].dtype)
                out[i] = res[j]
        if zero_flat is not None:
            out = [u if u is None or z is None else skip_update(u, z)
                   for u, z in zip(out, zero_flat)]
        return out, NorMuonState(optree.tree_unflatten(spec, new_nus))

    def _matrix_scale(self, o_hat: torch.Tensor, view: Any) -> torch.Tensor:
        """``scale·√(m·n)/(‖ô‖_F + eps)`` per matrix, shaped to multiply ``o_hat`` (a stack
        ``(B, *leaf shape)``)."""
        if view is True:  # one matrix a leaf
            frob = torch.linalg.vector_norm(o_hat, dim=(-2, -1), keepdim=True)
            return self.scale * math.sqrt(o_hat.shape[-2] * o_hat.shape[-1]) / (
                frob + self.eps)
        b, m, n = view.shape
        perm = (0, *(a + 1 for a in view.perm))
        frob = o_hat.permute(perm).reshape(o_hat.shape[0], b, m * n).norm(dim=-1)
        factor = self.scale * math.sqrt(m * n) / (frob + self.eps)  # (B, b)
        leaf_shape = o_hat.shape[1:]
        shape = [o_hat.shape[0]] + [leaf_shape[a] if a in view.batch_axes else 1
                                    for a in range(len(leaf_shape))]
        return factor.reshape(shape)


def _nu_shape(u: torch.Tensor, view: Any) -> tuple[int, ...]:
    return tuple(u.shape[:-1]) if view is not None else (1,)


def scale_by_normuon(
    ns_coeffs: Sequence = DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    beta: Float = 0.95,
    beta2: float = 0.95,
    eps: float = 1e-8,
    *,
    nesterov: bool = True,
    preconditioning: str = "frobenius",
    ns_dtype: torch.dtype | None = None,
    weight_dimension_numbers: Any = None,
    normuon_scale: float = 0.2,
) -> GradientTransformation:
    """NorMuon's update (optax.contrib's ``scale_by_normuon``): Muon's, then per row.

    m̂ and its orthogonalisation O are :func:`ftopt.scale_by_muon`'s (the same
    ``ns_coeffs``, ``ns_steps``, ``beta``, ``eps``, ``nesterov``, ``preconditioning``,
    ``ns_dtype`` and ``weight_dimension_numbers``); then per matrix leaf, rows being all
    axes but the last: ``nu ← β2·nu + (1−β2)·mean(O², last axis)``,
    ``Ô = O/(√nu + eps)`` and ``u = Ô·normuon_scale·√(m·n)/(‖Ô‖_F + eps)``, ``m·n`` and
    ‖·‖_F over each matrix (with ``weight_dimension_numbers``, each batch index's). Leaves
    that are not matrices pass m̂ through, as Muon's do.

    State: ``(MuonMomentumState(count, mu), EmptyState(), NorMuonState(row_nu))`` (optax keeps
    one ``NorMuonState(count, mu, nu, ns_coeffs)``). With ``skip_zeros``, mu keeps its bits
    at zero gradients and the update is zero there; nu is a row statistic (a reduction,
    SPEC §3) and advances from the masked O. On DTensor leaves the matrices must be
    replicated (the row moments are not sharded).

    Args:
        ns_coeffs, ns_steps, beta, eps, nesterov, preconditioning, ns_dtype,
        weight_dimension_numbers: as :func:`ftopt.scale_by_muon`.
        beta2: the row moments' decay, in [0, 1) (default: 0.95).
        normuon_scale: the update's RMS per matrix, >= 0 (default: 0.2).
    """
    eps = check_finite("scale_by_normuon", "eps", eps, NONNEG)
    beta2 = check_finite("scale_by_normuon", "beta2", beta2, UNIT_OPEN)
    normuon_scale = check_finite("scale_by_normuon", "normuon_scale", normuon_scale, NONNEG)
    check_muon_options("scale_by_normuon", ns_steps, preconditioning, ns_dtype)
    stage = RowNormalize(beta2, eps, normuon_scale, weight_dimension_numbers)
    return chain(momentum_stage(nesterov, beta),
                 orthogonalise(ns_coeffs, ns_steps, eps, False, preconditioning, ns_dtype,
                                weight_dimension_numbers),
                 GradientTransformation(stage.init, stage.update))
