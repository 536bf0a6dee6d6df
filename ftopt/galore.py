"""GaLore (Zhao et al. 2024, optax.contrib's ``scale_by_galore`` and ``galore``): the base
optimizer runs on low-rank projections of the matrix gradients, its update is projected
back.

A leaf taken as a matrix ``G`` (``m × n``, its axes split by a
:class:`GaLoreDimensionNumbers`) is projected with ``P``, the first ``r = min(rank, m, n)``
left singular vectors of ``G`` when ``m >= n`` (``R = Pᵀ G``, ``r × n``) or right ones
otherwise (``R = G P``, ``m × r``); ``P`` is recomputed from the gradient every
``update_proj_gap`` steps (the first step included) and kept in between. The base
optimizer's state lives in the projected shapes. Leaves of one shape and layout are
stacked: one batched ``torch.linalg.svd`` and one batched matrix product each.

Eager torch ops around the base optimizer's own update, which runs (and fuses, where its
chain can) as any ftopt update does on the tree of projected gradients. On ``DTensor``
leaves (a call on local shards) a projected leaf must be unsplit (``Replicate``): the SVD
reads all of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import optree
import torch

from ftopt import tree as tree_lib
from ftopt._counts import host_count, remember_count
from ftopt.alias import check_state_options
from ftopt.base import GradientTransformation, check_transform, register_owner, register_state
from ftopt.combine import chain
from ftopt.combine import skip_zeros as skip_zeros_marker
from ftopt.domains import check_finite, check_int
from ftopt.finite import safe_increment
from ftopt.matrix import check_shards, decompose_finite
from ftopt.program import skip_update
from ftopt.quantize import quantize_states
from ftopt.rules import checked_params, compute_dtype
from ftopt.schedules import ScalarOrSchedule
from ftopt.transforms import add_decayed_weights, scale_by_adam, scale_by_learning_rate
from ftopt.validate import check_leaf

__all__ = ["GaLoreDimensionNumbers", "GaLoreState", "scale_by_galore", "galore"]

_INT32_MAX = 2**31 - 1


class GaLoreDimensionNumbers(NamedTuple):
    """Which axes of a leaf form the matrix's rows (``reduction_axis``, the input) and
    columns (``output_axis``); an axis or a sequence of axes each, together every axis
    of the leaf exactly once (negative axes count from the end)."""

    reduction_axis: int | Sequence[int] = 0
    output_axis: int | Sequence[int] = 1


@register_state
class GaLoreState(NamedTuple):
    """optax.contrib's ``GaLoreState``: the step count, the base optimizer's state (over
    the projected gradients; the others' full shape) and the projectors (``(m, r)`` or
    ``(n, r)`` per projected leaf, an empty ``(0, 0)`` tensor for the others)."""

    count: torch.Tensor
    base_optimizer_state: Any
    projector: Any


class _Layout(NamedTuple):
    """A leaf as a matrix: ``perm`` puts the reduction axes first, then ``(m, n)``."""

    perm: tuple[int, ...]
    m: int
    n: int
    rank: int

    @property
    def left(self) -> bool:
        return self.m >= self.n

    def projector_shape(self) -> tuple[int, int]:
        return (self.m if self.left else self.n, self.rank)

    def low_shape(self) -> tuple[int, int]:
        return (self.rank, self.n) if self.left else (self.m, self.rank)


def _axes(value: Any, ndim: int, path: str, which: str) -> tuple[int, ...]:
    axes = (value,) if isinstance(value, int) else tuple(value)
    if not all(isinstance(a, int) and not isinstance(a, bool) for a in axes):
        raise TypeError(f"scale_by_galore: weight_dimension_numbers at {path}: {which} must "
                        f"be an int or a sequence of ints, got {value!r}")
    return tuple(a % ndim for a in axes)


def _layout(shape: tuple[int, ...], dims: GaLoreDimensionNumbers, rank: int,
            path: str) -> _Layout:
    ndim = len(shape)
    if ndim < 2:
        raise ValueError(f"scale_by_galore: GaLore requires tensors with rank >= 2, got shape "
                         f"{shape} at {path}")
    red = _axes(dims.reduction_axis, ndim, path, "reduction_axis")
    out = _axes(dims.output_axis, ndim, path, "output_axis")
    if set(red) & set(out):
        raise ValueError(f"scale_by_galore: at {path}, reduction axes {red} and output axes "
                         f"{out} must be disjoint (shape {shape})")
    if sorted(red + out) != list(range(ndim)):
        raise ValueError(f"scale_by_galore: at {path}, all axes must be specified exactly "
                         f"once: got reduction={red}, output={out} for shape {shape}")
    m = math.prod(shape[a] for a in red)
    n = math.prod(shape[a] for a in out)
    return _Layout(red + out, m, n, min(rank, m, n))


def _to_matrix(batch: torch.Tensor, lay: _Layout) -> torch.Tensor:
    """``(B, *shape)`` -> ``(B, m, n)``."""
    perm = (0, *(1 + a for a in lay.perm))
    return batch.permute(perm).reshape(batch.shape[0], lay.m, lay.n)


def _from_matrix(batch: torch.Tensor, lay: _Layout, shape: tuple[int, ...]) -> torch.Tensor:
    """``(B, m, n)`` -> ``(B, *shape)``."""
    moved = batch.reshape(batch.shape[0], *(shape[a] for a in lay.perm))
    inverse = sorted(range(len(shape)), key=lambda i: lay.perm[i])
    return moved.permute((0, *(1 + a for a in inverse)))


class ScaleByGaLore:
    """The object behind :func:`scale_by_galore` (see there)."""

    mask_aware = True
    unfused_reason = ("scale_by_galore runs eagerly: it projects the gradients (batched SVD "
                      "and matrix products) around its base optimizer, whose update fuses")
    name = "scale_by_galore"

    def __init__(self, rank, update_proj_gap, scale, base_optimizer,
                 weight_dimension_numbers):
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise TypeError(f"{self.name}: rank must be an int, got {type(rank).__name__}")
        if rank <= 0:
            raise ValueError(f"{self.name}: rank must be positive, got {rank}")
        self.rank = rank
        self.gap = check_int(self.name, "update_proj_gap", update_proj_gap, 1)
        self.scale = check_finite(self.name, "scale", scale)
        self.base = scale_by_adam() if base_optimizer is None else base_optimizer
        check_transform(self.base, f"{self.name}: argument base_optimizer")
        self.dims = weight_dimension_numbers
        register_owner(self)

    def _dims(self, tree: Any, spec, flat: list, paths: list[str]) -> list:
        """Per leaf, its :class:`GaLoreDimensionNumbers` or ``None`` (not projected)."""
        dims = self.dims
        if dims is None:
            return [GaLoreDimensionNumbers() if x is not None and x.ndim == 2 else None
                    for x in flat]
        if isinstance(dims, GaLoreDimensionNumbers):
            return [dims if x is not None and x.ndim >= 2 else None for x in flat]
        if callable(dims):
            dims = dims(tree)
        found = tree_lib.flatten_like(spec, dims, "weight_dimension_numbers", paths)
        for path, d in zip(paths, found):
            if d is not None and not isinstance(d, GaLoreDimensionNumbers):
                raise TypeError(f"{self.name}: weight_dimension_numbers at {path}: expected "
                                f"a GaLoreDimensionNumbers or None, got {type(d).__name__}")
        return found

    def init(self, params) -> GaLoreState:
        paths, flat, spec = checked_params(params)
        count = torch.zeros((), dtype=torch.int32, device=tree_lib.state_device(flat))
        remember_count(count, 0)
        if not flat:
            return GaLoreState(count, self.base.init(params), params)
        dims = self._dims(params, spec, flat, paths)
        projectors, proxies = [], []
        for path, p, d in zip(paths, flat, dims):
            if d is None:
                projectors.append(torch.zeros((0, 0), dtype=p.dtype, device=p.device))
                proxies.append(torch.zeros_like(p))
                continue
            lay = _layout(tuple(p.shape), d, self.rank, path)
            projectors.append(torch.zeros(lay.projector_shape(), dtype=p.dtype,
                                          device=p.device))
            proxies.append(torch.zeros(lay.low_shape(), dtype=p.dtype, device=p.device))
        return GaLoreState(count, self.base.init(tree_lib.unflatten(spec, proxies)),
                           tree_lib.unflatten(spec, projectors))

    def update(self, updates, state, params=None, **extra):
        # (As optax, the base optimizer sees no params; given ones check the updates' tree.)
        if not isinstance(state, GaLoreState):
            raise TypeError(f"{self.name}: expected a GaLoreState, got {type(state).__name__}")
        if params is not None:
            paths, p_flat, spec = tree_lib.flatten_with_paths(params)
            u_flat = tree_lib.flatten_like(spec, updates, "updates", paths)
        else:
            spec = optree.tree_structure(updates, none_is_leaf=True, namespace="ftopt")
            paths = [tree_lib.path_str(p) for p in optree.tree_paths(
                updates, none_is_leaf=True, namespace="ftopt")]
            u_flat, p_flat = spec.flatten_up_to(updates), [None] * len(paths)
        for path, u, p in zip(paths, u_flat, p_flat):
            if u is not None:
                check_leaf(path, u, p, params is not None)
        proj = tree_lib.flatten_like(spec, state.projector, "state projector", paths)
        zero_mask = extra.pop("zero_mask", None)
        zero = (tree_lib.flatten_like(spec, zero_mask, "zero_mask", paths)
                if zero_mask is not None else None)
        dims = self._dims(updates, spec, u_flat, paths)
        layouts = {}
        for i, (path, u, d) in enumerate(zip(paths, u_flat, dims)):
            if u is None or d is None:
                continue
            lay = layouts[i] = _layout(tuple(u.shape), d, self.rank, path)
            _check_projector(path, proj[i], u, lay)
        # An SVD reads the whole leaf: a projected leaf's shards may split no dim.
        check_shards(self.name, "leaf", lambda u: True, [paths[i] for i in layouts],
                     [u_flat[i] for i in layouts])
        count = host_count(state.count)
        count = int(state.count) if count is None else count
        new_count = safe_increment(state.count)
        remember_count(new_count, min(count + 1, _INT32_MAX))
        refresh = count % self.gap == 0
        low, new_proj = list(u_flat), list(proj)
        groups: dict[tuple, list[int]] = {}
        for i, lay in layouts.items():
            u = u_flat[i]
            groups.setdefault((tuple(u.shape), lay, compute_dtype(u), u.device), []).append(i)
        for (_, lay, dtype, _), idx in groups.items():
            g = _to_matrix(torch.stack([u_flat[i].to(dtype) for i in idx]), lay)
            if refresh:
                p = self._projectors(g, lay)
                for j, i in enumerate(idx):
                    new_proj[i] = p[j].to(proj[i].dtype)
            p = torch.stack([new_proj[i].to(dtype) for i in idx])
            r = p.transpose(-1, -2) @ g if lay.left else g @ p
            for j, i in enumerate(idx):
                low[i] = r[j]
        low_zero = None
        if zero is not None:  # nothing in a projected gradient is a raw zero gradient
            low_zero = [z if i not in layouts else torch.zeros(low[i].shape, dtype=torch.bool,
                                                              device=low[i].device)
                        for i, z in enumerate(zero)]
            extra["zero_mask"] = tree_lib.unflatten(spec, low_zero)
        try:
            low_upd, base_state = self.base.update(tree_lib.unflatten(spec, low),
                                                   state.base_optimizer_state, None, **extra)
        except ValueError as err:
            shown = "; ".join(f"{paths[i]}: shape {tuple(u_flat[i].shape)} as "
                              f"{tuple(low[i].shape)}" for i in list(layouts)[:3])
            raise ValueError(f"{self.name}: base_optimizer failed on the projected gradients "
                             f"({shown or 'none projected'}; a state made by init for other "
                             f"shapes?): {err}") from err
        out = tree_lib.flatten_like(spec, low_upd, "the base optimizer's updates", paths,
                                    against="updates")
        for (shape, lay, dtype, _), idx in groups.items():
            r = torch.stack([out[i].to(dtype) for i in idx])
            p = torch.stack([new_proj[i].to(dtype) for i in idx])
            full = p @ r if lay.left else r @ p.transpose(-1, -2)
            full = self.scale * _from_matrix(full, lay, shape)
            for j, i in enumerate(idx):
                out[i] = full[j]
        if zero is not None:
            out = [x if x is None or z is None else skip_update(x, z)
                   for x, z in zip(out, zero)]
        return tree_lib.unflatten(spec, out), GaLoreState(
            new_count, base_state, tree_lib.unflatten(spec, new_proj))

    @staticmethod
    def _projectors(g: torch.Tensor, lay: _Layout) -> torch.Tensor:
        """The batch's new projectors from the SVD of its gradients (fp32, fp64 for fp64
        gradients)."""
        svd_dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
        # (a gradient with a NaN or an infinity: NaN projectors, where LAPACK refuses it)
        u, _, vh = decompose_finite(lambda x: torch.linalg.svd(x, full_matrices=False),
                                    g.to(svd_dtype), torch.zeros((), dtype=svd_dtype))
        if lay.left:
            return u[..., :, :lay.rank]
        return vh[..., :lay.rank, :].transpose(-1, -2)


def _check_projector(path: str, got: Any, u: torch.Tensor, lay: _Layout) -> None:
    want = lay.projector_shape()
    where = f"state projector at {path} (a leaf of shape {tuple(u.shape)})"
    if not isinstance(got, torch.Tensor):
        raise TypeError(f"{where}: expected a tensor, got {type(got).__name__}")
    if not got.is_floating_point():
        raise TypeError(f"{where}: expected a floating-point tensor, got {got.dtype}")
    if tuple(got.shape) != want or got.device != u.device:
        raise ValueError(f"{where}: expected shape {want} on {u.device}, got "
                         f"{_describe(got)}")


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    return type(x).__name__


def scale_by_galore(rank: int = 128, update_proj_gap: int = 200, scale: float = 1.0,
                    base_optimizer: GradientTransformation | None = None,
                    weight_dimension_numbers: Any = None) -> GradientTransformation:
    """GaLore's scaling (optax.contrib's ``scale_by_galore``; see the module docstring).

    Per projected leaf (``G`` its ``m × n`` matrix, ``t`` the steps before this one): when
    ``t % update_proj_gap == 0``, ``P ←`` the first ``r = min(rank, m, n)`` left singular
    vectors of ``G`` if ``m >= n``, else its first ``r`` right ones; ``R = PᵀG`` (or
    ``G P``); the base optimizer maps the tree of the ``R`` (and of the other leaves'
    gradients, as they are) to updates ``U``, and the leaf's update is ``scale·P U`` (or
    ``scale·U Pᵀ``) in its own shape; the other leaves' updates are the base's (no
    ``scale``, as optax). The base optimizer must not need params (``scale_by_adam``, not
    ``adamw``); it is called with ``params=None``.

    Differences from optax: the SVD runs in fp32 (fp64 for fp64 gradients; optax rounds
    those to fp32 first), the projections in the compute dtype (fp32 for 16-bit gradients);
    singular vectors' signs are LAPACK's (or cuSOLVER's), so a state carried across a
    projector refresh may see other signs than under XLA. ``skip_zeros``: a zero raw
    gradient's update is ``-0.0`` (its param stays bit-identical); the base state of a leaf
    that is not projected keeps its bits there (the base sees the raw mask); a projected
    leaf's low-rank states and projector mix all of its elements (reductions, like SM3's
    maxima) and advance, the base seeing no element of ``R`` as skipped.

    Args:
        rank: the projection's rank, an int > 0. update_proj_gap: steps between projector
            refreshes, >= 1. scale: the projected leaves' factor.
        base_optimizer: a gradient-only transform (default ``scale_by_adam()``).
        weight_dimension_numbers: ``None`` (project the 2-D leaves), one
            :class:`GaLoreDimensionNumbers` (every leaf with >= 2 dims), a tree of them
            (``None`` for a leaf not projected) or a callable of the updates making one.
    """
    obj = ScaleByGaLore(rank, update_proj_gap, scale, base_optimizer,
                        weight_dimension_numbers)
    return GradientTransformation(obj.init, obj.update)


def galore(learning_rate: ScalarOrSchedule, rank: int = 128, update_proj_gap: int = 200,
           scale: float = 1.0, base_optimizer: GradientTransformation | None = None,
           weight_decay: float | torch.Tensor = 0.0, mask: Any = None,
           weight_dimension_numbers: Any = None, *, skip_zeros: bool = False,
           state_bits: int = 32, state_dtype: torch.dtype | None = None,
           state_rounding: str = "nearest") -> GradientTransformation:
    """GaLore (optax.contrib): ``chain(scale_by_galore(rank, update_proj_gap, scale,
    base_optimizer, weight_dimension_numbers), add_decayed_weights(weight_decay, mask),
    scale_by_learning_rate(learning_rate))``; weight decay in the full space (never in the
    base optimizer).

    ``state_bits`` / ``state_dtype`` / ``state_rounding`` apply to the base optimizer's
    states (in the projected shapes: ``quantize_states(base_optimizer, ...)``, so 8-bit
    codes for those with >= 4096 elements); the projectors keep the params' dtype.
    ``skip_zeros`` as :func:`scale_by_galore` says.
    """
    check_state_options("galore", state_bits, state_dtype, state_rounding)
    base = scale_by_adam() if base_optimizer is None else base_optimizer
    if state_bits != 32 or state_dtype is not None:
        base = quantize_states(base, bits=state_bits, state_dtype=state_dtype,
                               state_rounding=state_rounding)
    parts = [scale_by_galore(rank, update_proj_gap, scale, base, weight_dimension_numbers),
             add_decayed_weights(weight_decay, mask), scale_by_learning_rate(learning_rate)]
    if skip_zeros:
        parts.append(skip_zeros_marker())
    return chain(*parts)
