"""Matrix stages: transforms whose math reads a whole leaf (rows, columns, matrix products).

An elementwise rule (:mod:`ftopt.rules`) sees one element at a time; a matrix stage sees
whole leaves. :class:`MatrixTransform` is one: ``fn`` maps a batch of equal-shaped leaves
(a ``(B, *shape)`` tensor, in the compute dtype) to the batch of their new updates, and
leaves it does not apply to (``applies(leaf)`` false: by default any leaf that is not
2-D) pass through. Leaves of one shape, dtype and device are stacked into one call, so a
model's dozens of equal-shaped matrices cost one batched torch call, not one each.

In a chain, the fused backend runs the elementwise stages around a matrix stage as fused
kernels (one segment before it, one after, see :mod:`ftopt.lowering.segments`) and the
matrix stage between them with torch ops on the segment's output. ``skip_zeros`` is the
same on both backends (SPEC §3): the mask is the raw gradient's, and the stage's update
is ``-0.0`` where it is zero.

A stage may keep state (Adafactor's factored second moments,
:mod:`ftopt.transforms.factored`): it has ``init`` and ``update`` as any transform, and
``run_flat(u_flat, zero_flat, state, p_flat, spec, paths) -> (u_flat, state)``
(``spec``: the updates' tree structure; :func:`flatten_call` makes these of an ``update``
call) and may have ``check_state`` (same arguments
but ``zero_flat``; raises on a bad state before any kernel writes), which the
segmented fused step calls with the stage's part of the chain's state (found by the
state path that :func:`ftopt.stages.chain_stages` records). Statistics that are not per
element (row and column means) are reductions, like norms under SPEC §3: they see the
masked update (a skipped element contributes 0) and advance as usual; per-element states
keep their bits where the raw gradient is zero.

On ``DTensor`` leaves (FSDP2 and the like, :mod:`ftopt.distributed`) each rank runs the
stage on its local shard, which is right only where the stage's math never reads across
the split. A stage declares what it reads, ``reads``:

* ``"rows"``: each slice ``u[i, ...]`` on its own (a row norm, a mean over all dims but
  the first): a leaf split on dim 0 (FSDP2's ``Shard(0)``) is fine, any other split
  is refused;
* ``"leaf"`` (the default): the whole leaf (its RMS, a matrix product): only
  leaves whose shards split no dim (``Replicate``) are accepted.

A refused leaf raises before anything is written, naming its path and placements.

A stage given ``dims`` (:mod:`ftopt.matrix_views`) runs on the leaves they name, each
seen as a ``(b, m, n)`` batch of matrices (its batch, reduction and output axes), and
passes the others through; on local shards a leaf may be split on its batch axes only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch

from ftopt import matrix_views, shards
from ftopt import tree as tree_lib
from ftopt.base import EmptyState, GradientTransformation, register_owner
from ftopt.program import skip_update
from ftopt.rule_transform import flatten_params_like
from ftopt.rules import check_param, compute_dtype
from ftopt.validate import check_leaf

__all__ = ["MatrixTransform", "StatefulStage", "matrix_transform", "is_matrix_2d", "READS"]

# What a stage's math reads -> the tensor dims a leaf's shards may split.
READS = {"rows": frozenset({0}), "leaf": frozenset()}
_READ_WORDS = {"rows": "each row u[i, ...] whole (a leaf may be split on dim 0 only, as "
                       "FSDP2's Shard(0))",
               "leaf": "the whole leaf (its shards may split no dim: Replicate only)"}


def is_matrix_2d(leaf: torch.Tensor) -> bool:
    """The default ``applies``: 2-D leaves with no empty dimension."""
    return leaf.dim() == 2 and leaf.numel() > 0


class MatrixTransform:
    """A stateless matrix stage (see the module docstring).

    ``fn(batch) -> batch``: a ``(B, *shape)`` float tensor (fp32 or wider) in, the same
    shape out. ``reads``: ``"rows"`` or ``"leaf"``, what ``fn`` reads of a leaf (decides
    which ``DTensor`` shards it may run on). ``mask_aware``: the chain's ``skip_zeros``
    mask reaches :meth:`update`, which applies it to this stage's output itself.
    ``dims``: the leaves as batches of matrices (:mod:`ftopt.matrix_views`; ``fn`` then
    gets ``(B, m, n)`` batches), instead of ``applies``.
    """

    matrix_stage = True
    mask_aware = True
    uses_params = False  # (a stage whose math reads the params: an update needs them)

    def __init__(self, name: str, fn: Callable[[torch.Tensor], torch.Tensor],
                 applies: Callable[[torch.Tensor], bool] = is_matrix_2d,
                 reads: str = "leaf", dims: Any = None):
        if reads not in READS:
            raise ValueError(f"{name}: reads must be one of {sorted(READS)}, got {reads!r}")
        self.name, self.fn, self.applies, self.reads = name, fn, applies, reads
        self.dims = dims
        register_owner(self)

    def check_shards(self, paths: Sequence[str], u_flat: Sequence[Any]) -> None:
        """Refuse a leaf this stage applies to whose shards (in a call on local shards)
        split a dim its math reads across (see the module docstring)."""
        if self.dims is None:  # (with dims: :meth:`check_state` and :meth:`views`)
            check_shards(self.name, self.reads, self.applies, paths, u_flat)

    def check_state(self, state: Any, u_flat: Sequence[Any] = (), p_flat: Sequence[Any] = (),
                    spec: Any = None, paths: Sequence[str] = ()) -> None:
        """Before a segmented fused step writes anything: with ``dims``, each leaf's
        matrices, its shards split on batch axes only (:func:`ftopt.matrix_views.views`)."""
        del state
        if self.dims is not None and spec is not None:
            self.views(spec, paths, u_flat, p_flat)

    def views(self, spec: Any, paths: Sequence[str], u_flat: Sequence[Any],
              p_flat: Sequence[Any]) -> list | None:
        """Each leaf's :class:`ftopt.matrix_views.MatrixView` (``None`` without ``dims``)."""
        if self.dims is None:
            return None
        return matrix_views.views(self.name, self.dims, spec, paths, u_flat, p_flat)

    def init(self, params) -> EmptyState:
        del params
        return EmptyState()

    def apply_flat(self, u_flat: Sequence[Any], zero_flat: Sequence[Any] | None = None,
                   views: Sequence[Any] | None = None) -> list:
        """The stage on a list of leaves (``None`` stays ``None``), batched by shape, dtype
        and device; ``zero_flat``: per leaf, where the raw gradient is zero (the update
        there becomes ``-0.0``); ``views``: per leaf, its matrices (:meth:`views`)."""
        out = list(u_flat)
        groups: dict[tuple, list[int]] = {}
        for i, u in enumerate(u_flat):
            if u is None:
                continue
            if not isinstance(u, torch.Tensor):
                raise TypeError(f"{self.name}: expected tensors, got {type(u).__name__}")
            dtype = compute_dtype(u)
            if views is not None and views[i] is not None:
                groups.setdefault((views[i].shape[1:], dtype, u.device), []).append(i)
            elif views is None and self.applies(u):
                groups.setdefault((tuple(u.shape), dtype, u.device), []).append(i)
            else:
                out[i] = u.to(dtype)
        for (_, dtype, _), leaves in groups.items():
            if views is None:
                parts = [u_flat[i].to(dtype).unsqueeze(0) for i in leaves]
            else:
                parts = [views[i].to_batch(u_flat[i].to(dtype)) for i in leaves]
            batch = torch.cat(parts)
            result = self.fn(batch)
            if result.shape != batch.shape:
                raise ValueError(f"{self.name}: the stage returned shape "
                                 f"{tuple(result.shape)} for a batch of {tuple(batch.shape)}")
            for i, part in zip(leaves, result.split([x.shape[0] for x in parts])):
                out[i] = part[0] if views is None else views[i].from_batch(part)
        if zero_flat is not None:
            out = [u if u is None or z is None else skip_update(u, z)
                   for u, z in zip(out, zero_flat)]
        return out

    def update(self, updates, state, params=None, **extra):
        spec, paths, leaves, p_flat, zero_flat = checked_call(self, updates, params, extra)
        out = self.apply_flat(leaves, zero_flat, self.views(spec, paths, leaves, p_flat))
        return tree_lib.unflatten(spec, out), state

    def run_flat(self, u_flat: Sequence[Any], zero_flat: Sequence[Any] | None, state: Any,
                 p_flat: Sequence[Any], spec: Any, paths: Sequence[str]) -> tuple[list, Any]:
        """The stage in a segmented fused step (:mod:`ftopt.lowering.segments`): the new
        updates and the stage's new state (``state`` is the stage's own part of the
        chain's state; a stateless stage returns it as it is)."""
        return self.apply_flat(u_flat, zero_flat, self.views(spec, paths, u_flat, p_flat)), state


class StatefulStage:
    """The ``update`` of a stateful matrix stage, from its ``check_state`` and
    ``run_flat`` (see the module docstring)."""

    matrix_stage = True
    mask_aware = True

    def update(self, updates, state, params=None, **extra):
        spec, paths, u_flat, p_flat, zero_flat = flatten_call(updates, params, extra)
        self.check_state(state, u_flat, p_flat, spec, paths)
        out, new = self.run_flat(u_flat, zero_flat, state, p_flat, spec, paths)
        return tree_lib.unflatten(spec, out), new


class FlatCall(NamedTuple):
    """A stage's ``update`` call on flat leaves: the updates' tree structure (``None``
    leaves included), the leaves' paths, the updates, the params (``None`` each when the
    call has none) and the ``skip_zeros`` mask of the raw gradient (``None`` outside a
    ``skip_zeros`` chain)."""

    spec: Any
    paths: list[str]
    u_flat: list
    p_flat: list
    zero_flat: list | None


def flatten_call(updates: Any, params: Any, extra: dict) -> FlatCall:
    """Flatten a stage's ``update(updates, state, params, **extra)`` call; the params and
    the mask must match the updates' tree (errors name the path)."""
    spec = optree.tree_structure(updates, none_is_leaf=True, namespace="ftopt")
    paths = [tree_lib.path_str(p) for p in optree.tree_paths(
        updates, none_is_leaf=True, namespace="ftopt")]
    u_flat = spec.flatten_up_to(updates)
    p_flat = (flatten_params_like(spec, params, paths, updates) if params is not None
              else [None] * len(u_flat))
    zero = extra.get("zero_mask")
    zero_flat = (tree_lib.flatten_like(spec, zero, "zero_mask", paths)
                 if zero is not None else None)
    return FlatCall(spec, paths, u_flat, p_flat, zero_flat)


def checked_call(stage: Any, updates: Any, params: Any, extra: dict) -> FlatCall:
    """:func:`flatten_call`, each update checked against its param (naming the path), and
    ``stage.check_shards`` on the leaves: a stage's ``update`` before its math."""
    call = flatten_call(updates, params, extra)
    for path, u, p in zip(call.paths, call.u_flat, call.p_flat):
        if u is not None:
            check_leaf(path, u, p, params is not None)
    stage.check_shards(call.paths, call.u_flat)
    return call


def flat_params(params: Any) -> tuple[Any, list[str], list]:
    """A stateful stage's ``init``: the params' structure (``None`` a leaf), paths and
    leaves, each param checked (naming its path)."""
    spec = optree.tree_structure(params, none_is_leaf=True, namespace="ftopt")
    paths = [tree_lib.path_str(p) for p in optree.tree_paths(
        params, none_is_leaf=True, namespace="ftopt")]
    flat = spec.flatten_up_to(params)
    for path, p in zip(paths, flat):
        if p is not None:
            check_param(path, p)
    return spec, paths, flat


def decompose_finite(fn: Callable[[torch.Tensor], Any], x: torch.Tensor,
                     stand_in: torch.Tensor) -> Any:
    """``fn(x)`` of a batch of matrices ``x`` ``(..., m, n)`` by a LAPACK decomposition
    that refuses a matrix holding a NaN or an infinity (``eigh``, ``svd``: "failed to
    converge"): such a matrix is decomposed as ``stand_in`` instead and its outputs are
    NaN, as a non-finite gradient makes every other state, with no host synchronisation.
    ``fn`` returns a tensor or a tuple of tensors, each batched as ``x``."""
    finite = torch.isfinite(x).flatten(-2).all(-1)
    out = fn(torch.where(finite[..., None, None], x, stand_in))

    def nan_where_not(y: torch.Tensor) -> torch.Tensor:
        keep = finite.reshape(finite.shape + (1,) * (y.dim() - finite.dim()))
        return torch.where(keep, y, y.new_full((), float("nan")))

    if isinstance(out, tuple):
        return tuple(nan_where_not(y) for y in out)
    return nan_where_not(out)


def refuse_split(name: str, path: str, placements: Any, reads: str) -> None:
    """Raise for a leaf split over ranks that a stage keeps whole state of (``reads``:
    what of it the stage's state reads)."""
    raise ValueError(f"{name} at {path}: the leaf is sharded with placements {placements}; "
                     f"{reads}, which are not sharded: replicate this leaf, or leave it "
                     "out (partition)")


def check_shards(name: str, reads: str, applies: Callable[[Any], bool],
                 paths: Sequence[str], u_flat: Sequence[Any]) -> None:
    """Raise for a leaf that ``applies`` to a stage reading ``reads`` of it (``"rows"``
    or ``"leaf"``) whose shards, in a call on local shards, split a dim it reads across."""
    allowed = READS[reads]
    for path, u in zip(paths, u_flat):
        split = shards.leaf_split(path) if u is not None else None
        if split is None or split[1] <= allowed or not applies(u):
            continue
        placements, dims = split
        raise ValueError(
            f"{name} at {path}: the leaf is sharded with placements {placements}, "
            f"splitting dim {sorted(dims - allowed)[0]}, but {name} reads "
            f"{_READ_WORDS[reads]}: each rank would compute on a part of what "
            "it needs. Shard this leaf otherwise, or leave it out of the stage "
            "(masked / partition)")


def matrix_transform(name: str, fn: Callable[[torch.Tensor], torch.Tensor],
                     applies: Callable[[torch.Tensor], bool] = is_matrix_2d,
                     reads: str = "leaf", dims: Any = None) -> GradientTransformation:
    """A :class:`MatrixTransform` as a ``GradientTransformation``."""
    obj = MatrixTransform(name, fn, applies, reads, dims)
    return GradientTransformation(obj.init, obj.update)
