"""Adafactor's pieces: ``scale_by_factored_rms`` (a stateful matrix stage, see
:mod:`ftopt.matrix`), ``clip_by_block_rms`` and ``scale_by_param_block_rms`` (elementwise
rules that read per-leaf norms, so they fuse).

The factored second moments are row and column means of the squared gradient: whole-leaf
reductions, computed with torch ops batched over leaves of one shape. The stages around
them (clipping, learning rate, parameter scale, momentum, weight decay) fuse.

On a leaf split over ranks along one dim (FSDP2's ``Shard(0)``, tensor parallel's
``Shard(1)``; :mod:`ftopt.distributed`) each rank holds whole slices of that dim: the
statistic that keeps the dim is its own (a DTensor sharded as the leaf), the one reduced
over it is a sum over the ranks (a replicated DTensor). The partial sums of every such
leaf go over the ranks in one all-reduce per step, and every mean divides by the full
tensor's size, so a rank with fewer rows (or none) is right.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ftopt import eager, shards
from ftopt import tree as tree_lib
from ftopt._counts import new_count, remember_count
from ftopt.base import GradientTransformation, register_owner, register_state
from ftopt.domains import NONNEG, POSITIVE, check_finite
from ftopt.matrix import StatefulStage
from ftopt.program import skip_update
from ftopt.rule_transform import rule_transform
from ftopt.rules import Rule, check_param, compute_dtype, state_dtype
from ftopt.transforms.factored_batch import (
    FactoredBatch,
    FactoredLayout,
    mix,
    stat_zeros,
    sum_over_ranks,
)
from ftopt.validate import check_count, check_leaf, check_stage_state

__all__ = ["FactoredState", "scale_by_factored_rms", "clip_by_block_rms",
           "scale_by_param_block_rms", "factored_dims"]


@register_state
class FactoredState(NamedTuple):
    """Adafactor's step count and second moments (optax's layout): per leaf, ``v_row`` and
    ``v_col`` for a factored leaf (``v`` a 1-element placeholder), ``v`` for another one
    (``v_row``, ``v_col`` placeholders)."""

    count: torch.Tensor
    v_row: Any
    v_col: Any
    v: Any


def factored_dims(shape: Sequence[int], factored: bool,
                  min_dim_size_to_factor: int) -> tuple[int, int] | None:
    """``(d1, d0)``: the second largest and the largest dimension of ``shape`` (ties: the
    earlier one counts as smaller, as numpy's argsort), or ``None`` when the leaf is not
    factored (``factored`` off, fewer than 2 dims, or the second largest below
    ``min_dim_size_to_factor``)."""
    if not factored or len(shape) < 2:
        return None
    order = sorted(range(len(shape)), key=lambda i: shape[i])
    if shape[order[-2]] < min_dim_size_to_factor:
        return None
    return order[-2], order[-1]


def _decay_rate_pow(step: Any, exponent: float) -> Any:
    """Adafactor's second-moment decay: 1 − (step + 1)^(−exponent)."""
    return 1.0 - (step + 1) ** (-exponent)


class FactoredRms(StatefulStage):
    """The stage behind :func:`scale_by_factored_rms` (a stateful matrix stage)."""

    name = "scale_by_factored_rms"

    def __init__(self, factored: bool, decay_rate: float, step_offset: int,
                 min_dim_size_to_factor: int, epsilon: float, decay_rate_fn: Callable):
        self.factored, self.decay_rate, self.step_offset = factored, decay_rate, step_offset
        self.min_dim, self.epsilon, self.decay_rate_fn = (min_dim_size_to_factor, epsilon,
                                                          decay_rate_fn)
        register_owner(self)

    def _dims(self, shape) -> tuple[int, int] | None:
        return factored_dims(tuple(shape), self.factored, self.min_dim)

    def check_shards(self, paths, u_flat) -> None:
        """Raise for a factored leaf whose shards (in a call on local shards) split more
        than one dim, or are strided (unfactored leaves are element-wise)."""
        for path, u in zip(paths, u_flat):
            if u is not None:
                self._layout(path, u)

    def _layout(self, path: str, u: torch.Tensor) -> FactoredLayout | None:
        """How the leaf at ``path`` (local tensor ``u``) is factored, from its full
        shape; ``None`` for an unfactored leaf."""
        full = shards.full_shape(path) or tuple(u.shape)
        dims = self._dims(full)
        if dims is None:
            return None
        split, found = None, shards.leaf_split(path)
        if found is not None and found[1]:
            self._check_split(path, full, *found)
            (dim,) = found[1]
            split = 1 if dim == dims[0] else 0 if dim == dims[1] else None
        return FactoredLayout(dims, split, full[dims[0]], full[dims[1]])

    # -- init ------------------------------------------------------------------------------
    def init(self, params) -> FactoredState:
        paths, flat, spec = tree_lib.flatten_with_paths(params)
        for path, p in zip(paths, flat):
            check_param(path, p)
        rows, cols, vs = [], [], []
        for path, p in zip(paths, flat):
            dtype, dims = state_dtype(p), self._dims(p.shape)
            one = torch.zeros((1,), dtype=dtype, device=p.device)
            if dims is None:
                rows.append(one)
                cols.append(one.clone())
                # A DTensor's v is a DTensor sharded as the leaf (element-wise).
                vs.append(torch.zeros_like(p, dtype=dtype) if shards.is_dtensor(p) else
                          torch.zeros(p.shape, dtype=dtype, device=p.device))
                continue
            split = shards.split_dims(p)
            if split:
                self._check_split(path, tuple(p.shape), tuple(p.placements), split)
            d1, d0 = dims
            rows.append(stat_zeros(p, d0, dtype, split))
            cols.append(stat_zeros(p, d1, dtype, split))
            vs.append(one)
        device = tree_lib.state_device(flat)
        count = new_count(0, device)
        return FactoredState(count, *(tree_lib.unflatten(spec, x) for x in (rows, cols, vs)))

    def _check_split(self, path: str, shape: tuple, placements: tuple,
                     split: frozenset[int]) -> None:
        """A factored leaf may be split along one dim, in plain blocks (``Shard``): its
        row and column means are then sums over the ranks along that dim."""
        if len(split) == 1 and not shards.strided(placements):
            return
        how = (f"splitting dims {sorted(split)}" if len(split) > 1
               else f"a strided shard of dim {min(split)}")
        raise ValueError(
            f"{self.name} at {path}: the leaf of shape {tuple(shape)} is sharded with "
            f"placements {tuple(placements)}, {how}, but its factored second moments (row "
            "and column means) are summed over the ranks along one split dim only: shard "
            "it on one dim (Shard(0), as FSDP2, or Shard(1)), replicate it, or keep it "
            "unfactored (factored=False, or min_dim_size_to_factor above its second "
            "largest dim)")

    # -- checks ----------------------------------------------------------------------------
    def check_state(self, state: Any, u_flat: Sequence[Any], p_flat: Sequence[Any],
                    spec: Any, paths: Sequence[str]) -> None:
        """Raise (naming the leaf's path) unless ``state`` is a :class:`FactoredState`
        whose leaves have the shapes ``init`` gives for these updates."""
        if not isinstance(state, FactoredState):
            raise TypeError(f"{self.name}: expected a FactoredState, got "
                            f"{type(state).__name__}")
        check_count(self.name, state.count)
        flat = _flat_state(state, spec, paths)
        for i, u in enumerate(u_flat):
            if u is None:
                continue
            check_leaf(paths[i], u, p_flat[i], p_flat[i] is not None)
            layout = self._layout(paths[i], u)
            dims = None if layout is None else layout.dims
            want = ((_without(u.shape, dims[1]), _without(u.shape, dims[0]), (1,))
                    if dims is not None else ((1,), (1,), tuple(u.shape)))
            for name, leaves, shape in zip(("v_row", "v_col", "v"), flat, want):
                check_stage_state(name, paths[i], leaves[i], shape, u.device)

    # -- update (StatefulStage's) ------------------------------------------------------------
    def run_flat(self, u_flat, zero_flat, state, p_flat, spec, paths):
        """The new updates and state for flat leaves (see :mod:`ftopt.matrix`)."""
        del p_flat
        rows, cols, vs = _flat_state(state, spec, paths)
        new_rows, new_cols, new_vs = list(rows), list(cols), list(vs)
        out = list(u_flat)
        beta, new_count = self._decay(state.count)
        groups: dict[tuple, list[int]] = {}
        for i, u in enumerate(u_flat):
            if u is not None:
                key = (tuple(u.shape), compute_dtype(u), u.device, self._layout(paths[i], u))
                groups.setdefault(key, []).append(i)
        batches = []
        for (_, dtype, _, layout), idx in groups.items():
            g = torch.stack([u_flat[i].to(dtype) for i in idx])
            if layout is None:
                zeros = None if zero_flat is None else [zero_flat[i] for i in idx]
                res, v = self._plain(g, torch.stack([vs[i].to(dtype) for i in idx]), beta,
                                     zeros)
                for j, i in enumerate(idx):
                    new_vs[i] = v[j].to(vs[i].dtype)
                    out[i] = res[j]
            else:
                batches.append(FactoredBatch(
                    idx, g, torch.stack([rows[i].to(dtype) for i in idx]),
                    torch.stack([cols[i].to(dtype) for i in idx]), beta, layout,
                    self.epsilon))
        sum_over_ranks(batches, paths)
        for batch in batches:
            res, r, c = batch.finish()
            for j, i in enumerate(batch.idx):
                new_rows[i], new_cols[i] = r[j].to(rows[i].dtype), c[j].to(cols[i].dtype)
                out[i] = res[j]
        if zero_flat is not None:
            out = [u if u is None or z is None else skip_update(u, z)
                   for u, z in zip(out, zero_flat)]
        return out, FactoredState(new_count, *(tree_lib.unflatten(spec, x)
                                               for x in (new_rows, new_cols, new_vs)))

    def _decay(self, count: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """The decay rate at this step (from the count before the step) and the new count;
        on the host where the count may be known there (:func:`ftopt.eager.known_count`)."""
        known = eager.known_count(count)
        new_count = count + 1
        if known is None:
            step = count.to(torch.float64 if count.device.type in ("cpu", "cuda")
                            else torch.float32)
        else:
            remember_count(new_count, known + 1)
            step = float(known)
        beta = self.decay_rate_fn(step - self.step_offset, self.decay_rate)
        return beta, new_count

    def _plain(self, g, v, beta, zeros):
        new_v = mix(v, g * g + self.epsilon, beta)
        if zeros is not None:
            mask = torch.stack(zeros)
            new_v = torch.where(mask, v, new_v)
        return g * new_v.rsqrt(), new_v



def _without(shape, dim: int) -> tuple[int, ...]:
    return tuple(s for k, s in enumerate(shape) if k != dim)


def _flat_state(state: FactoredState, spec, paths) -> list[list]:
    """``v_row``, ``v_col``, ``v`` flattened against the updates' structure."""
    return [tree_lib.flatten_like(spec, getattr(state, name), f"state {name}", paths)
            for name in ("v_row", "v_col", "v")]


def scale_by_factored_rms(
    factored: bool = True,
    decay_rate: float = 0.8,
    step_offset: int = 0,
    min_dim_size_to_factor: int = 128,
    epsilon: float = 1e-30,
    decay_rate_fn: Callable[[Any, float], Any] = _decay_rate_pow,
) -> GradientTransformation:
    """Scaling by a factored estimate of the gradient's RMS (Adafactor), as optax.

    With ``β = decay_rate_fn(count − step_offset, decay_rate)`` (default
    ``1 − (count − step_offset + 1)^(−decay_rate)``, ``count`` the steps done before this
    one) and ``g² = u² + epsilon``: a leaf whose two largest dims ``d1 ≤ d0`` (sizes) are
    both >= ``min_dim_size_to_factor`` keeps row and column means,
    ``v_row ← β·v_row + (1−β)·mean_{d0}(g²)``, ``v_col ← β·v_col + (1−β)·mean_{d1}(g²)``,
    and ``u ← u · (v_row/mean_{d1}(v_row))^(−1/2) · v_col^(−1/2)`` (broadcast back over
    ``d0`` and ``d1``); any other leaf keeps ``v ← β·v + (1−β)·g²`` and ``u ← u·v^(−1/2)``.

    A matrix stage (:mod:`ftopt.matrix`): leaves of one shape are computed in one batched
    torch call, and the elementwise stages around it in a chain fuse. With ``skip_zeros``
    the per-element ``v`` keeps its bits where the raw gradient is zero and the update is
    zero there; the row and column means are reductions (like norms, SPEC §3) and advance.

    On DTensor leaves split along one dim (FSDP2's ``Shard(0)``, ``Shard(1)``) each rank
    keeps the statistic of its own slices (sharded as the leaf) and the one reduced over
    the split dim is summed over the mesh (replicated): the same result as one process.

    Args:
        factored: factor the second moment of leaves with >= 2 dims (default: True).
        decay_rate: the exponent of the decay schedule, >= 0 (default: 0.8).
        step_offset: subtracted from the count (fine-tuning from a step) (default: 0).
        min_dim_size_to_factor: factor only when the two largest dims are at least this
            (default: 128).
        epsilon: added to u², >= 0 (default: 1e-30).
        decay_rate_fn: ``(step, decay_rate) -> β``, with ``step`` a float (or a 0-d
            tensor when the count is only on the device) (default: the power schedule).
    """
    decay_rate = check_finite("scale_by_factored_rms", "decay_rate", decay_rate, NONNEG)
    epsilon = check_finite("scale_by_factored_rms", "epsilon", epsilon, NONNEG)
    if not isinstance(min_dim_size_to_factor, int) or min_dim_size_to_factor < 0:
        raise ValueError("scale_by_factored_rms: min_dim_size_to_factor must be an int >= 0, "
                         f"got {min_dim_size_to_factor!r}")
    if not isinstance(step_offset, int):
        raise TypeError(f"scale_by_factored_rms: step_offset must be an int, got "
                        f"{type(step_offset).__name__}")
    obj = FactoredRms(bool(factored), decay_rate, step_offset, min_dim_size_to_factor,
                      epsilon, decay_rate_fn)
    return GradientTransformation(obj.init, obj.update)


def _leaf_rms(o, x):
    """The RMS of each leaf of ``x``: ‖x‖/√n, with √n the norm of a leaf of ones (the
    rule language reads leaves through norms only; where(x≠x, 1, 1) is 1 even at NaN)."""
    return o.leaf_norm(x) / o.leaf_norm(o.where(x != x, 1.0, 1.0))


def _block_rms_clip_body(o, x):
    return x.u / o.maximum(1.0, _leaf_rms(o, x.u) / x.threshold), {}


def clip_by_block_rms(threshold: float | torch.Tensor) -> GradientTransformation:
    """Per leaf, as optax: u ← u / max(1, rms(u)/threshold), rms(u) = √(mean(u²)).

    Elementwise with a per-leaf norm, so it fuses. ``threshold`` > 0.
    """
    return rule_transform(
        Rule("clip_by_block_rms", _block_rms_clip_body, hparams={"threshold": threshold},
             domains={"threshold": POSITIVE}))


def _param_block_rms_body(o, x):
    rms = _leaf_rms(o, x.p)
    return x.u * o.where(rms <= x.min_scale, x.min_scale, rms), {}


def scale_by_param_block_rms(min_scale: float | torch.Tensor = 1e-3) -> GradientTransformation:
    """Per leaf, as optax: u ← u · max(rms(p), min_scale), rms(p) = √(mean(p²)).

    Adafactor's relative step (``multiply_by_parameter_scale``). Elementwise with a
    per-leaf norm of the params, so it fuses. ``min_scale`` >= 0 (default: 1e-3).
    """
    return rule_transform(
        Rule("scale_by_param_block_rms", _param_block_rms_body,
             hparams={"min_scale": min_scale}, domains={"min_scale": NONNEG},
             uses_params=True))


def _param_block_norm_body(o, x):
    norm = o.leaf_norm(x.p)
    return x.u * o.where(norm <= x.min_scale, x.min_scale, norm), {}


def scale_by_param_block_norm(min_scale: float | torch.Tensor = 1e-3) -> GradientTransformation:
    """Per leaf, as optax: u ← u · max(‖p‖, min_scale), ‖p‖ the leaf's L2 norm.

    Elementwise with a per-leaf norm of the params, so it fuses. ``min_scale`` >= 0
    (default: 1e-3).
    """
    return rule_transform(
        Rule("scale_by_param_block_norm", _param_block_norm_body,
             hparams={"min_scale": min_scale}, domains={"min_scale": NONNEG},
             uses_params=True))

