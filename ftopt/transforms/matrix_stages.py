"""Matrix stages (see :mod:`ftopt.matrix`): ``scale_by_row_norm`` and
``adaptive_grad_clip``, and the latter's unit-wise helpers ``unitwise_norm`` and
``unitwise_clip``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ftopt import shards
from ftopt import tree as tree_lib
from ftopt.base import GradientTransformation
from ftopt.domains import NONNEG, check_finite
from ftopt.matrix import MatrixTransform, check_shards, flatten_call, matrix_transform
from ftopt.program import skip_update
from ftopt.rules import compute_dtype
from ftopt.validate import check_leaf


def scale_by_row_norm(eps: float = 1e-8) -> GradientTransformation:
    """Each row of a 2-D leaf over its L2 norm: ``u[i, :] ← u[i, :] / (‖u[i, :]‖ + eps)``.

    Leaves that are not 2-D pass through. Equal-shaped leaves are computed in one batched
    call; in a chain the elementwise stages around it stay fused (:mod:`ftopt.matrix`).
    On DTensor leaves, rows must be whole on each rank: ``Shard(0)`` (FSDP2) or
    ``Replicate``; another split raises, naming the leaf.

    Args:
        eps: added to each row's norm, >= 0 (default: 1e-8). A zero row stays zero.
    """
    eps = check_finite("scale_by_row_norm", "eps", eps, NONNEG)

    def fn(batch: torch.Tensor) -> torch.Tensor:
        denom = torch.linalg.vector_norm(batch, dim=-1, keepdim=True) + eps
        return batch / torch.where(denom == 0, 1.0, denom)  # a zero row (eps 0) stays 0

    return matrix_transform("scale_by_row_norm", fn, reads="rows")


def unit_axes(x: torch.Tensor, axis: Sequence[int] | None, where: str) -> tuple[int, ...]:
    """The dims of ``x`` a unit spans (those its norm sums over): ``axis`` (each in range,
    ``where`` names the caller in the error), or by layout: a leaf with at most one dim
    larger than 1 is one unit, any other has one unit an index of its first dim."""
    if axis is None:
        if x.squeeze().ndim <= 1:  # scalars and vectors: the whole leaf
            return tuple(range(x.ndim))
        return tuple(range(1, x.ndim))  # torch's (out, in, ...): one unit an output
    out = []
    for a in axis:
        if not -x.ndim <= a < x.ndim:
            raise ValueError(f"{where}: axis {a} is out of range for a leaf of shape "
                             f"{tuple(x.shape)}")
        out.append(a % x.ndim)
    return tuple(sorted(set(out)))


def _axes_argument(name: str, axis: int | Sequence[int] | None) -> tuple[int, ...] | None:
    if axis is None:
        return None
    axes = (axis,) if isinstance(axis, int) else tuple(axis) if isinstance(
        axis, Sequence) else ()
    if not axes or not all(isinstance(a, int) and not isinstance(a, bool) for a in axes):
        raise TypeError(f"{name}: axis must be an int or a non-empty sequence of ints, got "
                        f"{axis!r}")
    return axes


def unitwise_norm(x: torch.Tensor, axis: int | Sequence[int] | None = None) -> torch.Tensor:
    """The L2 norm of each unit of ``x``, broadcast to ``x``'s shape (optax's
    ``unitwise_norm``): a unit is a slice over the dims ``axis`` lists, by default as
    :func:`adaptive_grad_clip`'s (torch's layouts: the whole of a vector, a row ``x[i,
    ...]`` of anything else; optax's default reads JAX's ``(in, out)`` kernels, the same
    units written ``axis=0`` there). Computed in ``x``'s compute dtype (fp32 for 16-bit)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"unitwise_norm: expected a floating-point tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    dims = unit_axes(x, _axes_argument("unitwise_norm", axis), "unitwise_norm")
    x = x.to(compute_dtype(x))
    if len(dims) == x.ndim:  # (one unit: as adaptive_grad_clip sums a whole leaf's squares)
        return x.square().sum().sqrt().expand(x.shape)
    return torch.linalg.vector_norm(x, dim=dims, keepdim=True).expand(x.shape)


def unitwise_clip(g_norm: torch.Tensor, max_norm: torch.Tensor, grad: torch.Tensor,
                  div_eps: float = 1e-6) -> torch.Tensor:
    """``grad`` where ``g_norm < max_norm``, else ``grad · max_norm / max(g_norm,
    div_eps)`` (optax's ``unitwise_clip``; ``div_eps`` only keeps the division finite): the
    clip of :func:`adaptive_grad_clip`. The norms broadcast against ``grad`` (optax asks
    for equal shapes: :func:`unitwise_norm`'s are)."""
    return torch.where(g_norm < max_norm, grad, grad * (max_norm / g_norm.clamp_min(div_eps)))


class AdaptiveGradClip(MatrixTransform):
    """The stage behind :func:`adaptive_grad_clip` (a matrix stage that reads the params)."""

    uses_params = True

    def __init__(self, clipping: float, eps: float, axis: tuple[int, ...] | None):
        super().__init__("adaptive_grad_clip", _no_batch_fn, applies=_any_leaf, reads="rows")
        self.clipping, self.eps, self.axis = clipping, eps, axis

    def axes(self, path: str, x: torch.Tensor) -> tuple[int, ...]:
        """The dims of ``x`` a unit spans (those its norm sums over)."""
        return unit_axes(x, self.axis, f"adaptive_grad_clip at {path}")

    def check_shards(self, paths: Sequence[str], u_flat: Sequence[Any]) -> None:
        # A whole-leaf unit takes its norms over the ranks (shards.reduce_squares): any
        # split. Output rows (dim 0 not in the unit): a split on dim 0 only. Other units
        # read across any split.
        for path, u in zip(paths, u_flat):
            if u is not None:
                axes = self.axes(path, u)
                if len(axes) < u.ndim:
                    check_shards(self.name, "leaf" if 0 in axes else "rows", _any_leaf,
                                 [path], [u])

    def check_state(self, state: Any, u_flat: Sequence[Any], p_flat: Sequence[Any],
                    spec: Any, paths: Sequence[str]) -> None:
        """Before a segmented fused step writes anything: params given, axes valid."""
        del state, spec
        for path, u, p in zip(paths, u_flat, p_flat):
            if u is not None:
                if p is None:
                    raise ValueError("adaptive_grad_clip needs params: call "
                                     "update(updates, state, params)")
                self.axes(path, u)

    def clip_flat(self, u_flat: Sequence[Any], p_flat: Sequence[Any], paths: Sequence[str],
                  zero_flat: Sequence[Any] | None) -> list:
        out = list(u_flat)
        groups: dict[tuple, list[int]] = {}
        whole: list[int] = []
        for i, (path, u, p) in enumerate(zip(paths, u_flat, p_flat)):
            if u is None:
                continue
            if p is None:
                raise ValueError("adaptive_grad_clip needs params: call update(updates, "
                                 "state, params)")
            axes = self.axes(path, u)
            if len(axes) == u.ndim:
                whole.append(i)
            else:
                groups.setdefault((tuple(u.shape), compute_dtype(u), u.device, axes),
                                  []).append(i)
        for (_, dtype, _, axes), leaves in groups.items():
            u = torch.stack([u_flat[i].to(dtype) for i in leaves])
            p = torch.stack([p_flat[i].to(u.device, dtype) for i in leaves])
            dims = [a + 1 for a in axes]
            result = self._clip(u, torch.linalg.vector_norm(u, dim=dims, keepdim=True),
                                torch.linalg.vector_norm(p, dim=dims, keepdim=True))
            for j, i in enumerate(leaves):
                out[i] = result[j]
        if whole:  # one buffer of Σu² and Σp², summed over the ranks on local shards
            first = u_flat[whole[0]]
            wide = torch.float32
            for i in whole:
                wide = torch.promote_types(wide, u_flat[i].dtype)
            squares = torch.stack(
                [x.to(first.device, wide).square().sum()
                 for x in [u_flat[i] for i in whole] + [p_flat[i] for i in whole]])
            norms = shards.reduce_squares(squares, [paths[i] for i in whole] * 2).sqrt()
            for k, i in enumerate(whole):
                u = u_flat[i].to(compute_dtype(u_flat[i]))
                out[i] = self._clip(u, norms[k].to(u.device, u.dtype),
                                    norms[len(whole) + k].to(u.device, u.dtype))
        if zero_flat is not None:
            out = [u if u is None or z is None else skip_update(u, z)
                   for u, z in zip(out, zero_flat)]
        return out

    def _clip(self, u: torch.Tensor, g_norm: torch.Tensor, p_norm: torch.Tensor
              ) -> torch.Tensor:
        return unitwise_clip(g_norm, self.clipping * p_norm.clamp_min(self.eps), u)

    def update(self, updates, state, params=None, **extra):
        if params is None:
            raise ValueError("adaptive_grad_clip needs params: call update(updates, state, "
                             "params)")
        spec, paths, leaves, p_flat, zero_flat = flatten_call(updates, params, extra)
        for path, u, p in zip(paths, leaves, p_flat):
            if u is not None:
                check_leaf(path, u, p)
        self.check_shards(paths, leaves)
        return tree_lib.unflatten(spec, self.clip_flat(leaves, p_flat, paths, zero_flat)), state

    def run_flat(self, u_flat, zero_flat, state, p_flat, spec, paths):
        del spec
        return self.clip_flat(u_flat, p_flat, paths, zero_flat), state


def _no_batch_fn(batch: torch.Tensor) -> torch.Tensor:
    raise TypeError("adaptive_grad_clip reads the params: it runs through clip_flat")


def _any_leaf(leaf: torch.Tensor) -> bool:
    return True


def adaptive_grad_clip(clipping: float | torch.Tensor, eps: float | torch.Tensor = 1e-3,
                       axis: int | Sequence[int] | None = None) -> GradientTransformation:
    """Clips each unit of an update to at most ``clipping`` times its param's norm
    (Brock et al. 2021, as optax): ``u ← u · clipping·max(‖p‖, eps)/‖u‖`` where ``‖u‖``
    exceeds that, unit by unit.

    A unit is a slice of the leaf over the dims ``axis`` lists (its norm sums over them).
    The default follows torch's layouts: a leaf with at most one dim larger than 1 is one
    unit; any other leaf has one unit for each index of its first dim (an output row of a
    ``Linear`` weight ``(out, in)``, a filter of a ``Conv`` weight ``(out, in, *kernel)``),
    as timm's ``adaptive_clip_grad``. optax's default reads JAX's ``(in, out)`` kernels:
    the same units, written ``axis=0`` there. Runs eagerly (torch ops, leaves of one shape
    batched); the elementwise stages around it stay fused.

    Args:
        clipping: the largest ratio of a unit's update norm to its param norm, >= 0.
        eps: the smallest param norm used, >= 0 (default: 1e-3), so zero-initialised
            params still move.
        axis: the dims a unit spans, for every leaf (default: by layout, above).
    """
    clipping = check_finite("adaptive_grad_clip", "clipping", clipping, NONNEG)
    eps = check_finite("adaptive_grad_clip", "eps", eps, NONNEG)
    stage = AdaptiveGradClip(clipping, eps, _axes_argument("adaptive_grad_clip", axis))
    return GradientTransformation(stage.init, stage.update)
