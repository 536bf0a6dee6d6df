"""Leaves seen as batches of matrices, for the matrix stages (optax's
``MuonDimensionNumbers``): a leaf's axes split into reduction axes (the matrix's rows),
output axes (its columns) and the rest, batch axes, each batch index one matrix.

A stage given ``dims`` (one :class:`MuonDimensionNumbers` for every leaf, a tree of them
and ``None`` shaped like the params or a prefix of them, or a function of the updates
giving such a tree) runs on the leaves it names, each transposed to (batch, reduction,
output) and reshaped to ``(b, m, n)``; a ``None`` leaf passes through. Leaves whose
matrices have one ``(m, n)`` are concatenated into one batch.

On local shards (FSDP2) a leaf may be split on its batch axes only (a stack of experts
sharded on its expert axis: each rank holds whole matrices); a split of a reduction or
output axis is refused, naming the leaf, before anything is written.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import optree
import torch

from ftopt import shards

__all__ = ["MuonDimensionNumbers", "MatrixView", "leaf_dims", "views"]


class MuonDimensionNumbers(NamedTuple):
    """Which axes of a leaf are a matrix's (optax's): ``reduction_axis`` (the rows: the
    input of ``x @ W``) and ``output_axis`` (the columns), an int or a sequence of ints
    each (negative counts from the end); every other axis is a batch axis, each index of
    it one matrix. The default is a 2-D leaf ``(in, out)``."""

    reduction_axis: int | Sequence[int] = 0
    output_axis: int | Sequence[int] = 1


def _is_dims(x: Any) -> bool:
    return x is None or isinstance(x, MuonDimensionNumbers)


class MatrixView:
    """One leaf as a ``(b, m, n)`` batch of matrices (see :class:`MuonDimensionNumbers`)."""

    def __init__(self, who: str, path: str, shape: tuple[int, ...],
                 dims: MuonDimensionNumbers):
        def axes(value, what):
            values = (value,) if isinstance(value, int) else tuple(value)
            if not values or not all(isinstance(a, int) and -len(shape) <= a < len(shape)
                                     for a in values):
                raise ValueError(f"{who} at {path}: {what} {value!r} does not name axes of "
                                 f"a leaf of shape {shape}")
            return tuple(a % len(shape) for a in values)

        if len(shape) < 2:
            raise ValueError(f"{who} at {path}: {dims} for a leaf of shape {shape}: a "
                             "matrix needs a leaf of rank 2 or more")
        rows, cols = axes(dims.reduction_axis, "reduction_axis"), axes(dims.output_axis,
                                                                      "output_axis")
        if set(rows) & set(cols) or len(set(rows)) < len(rows) or len(set(cols)) < len(cols):
            raise ValueError(f"{who} at {path}: the reduction axes {rows} and output axes "
                             f"{cols} must be distinct")
        batch = tuple(a for a in range(len(shape)) if a not in rows + cols)
        self.batch_axes = frozenset(batch)
        self.perm = batch + rows + cols
        self.inverse = tuple(sorted(range(len(shape)), key=self.perm.__getitem__))
        self.permuted = tuple(shape[a] for a in self.perm)
        self.fan_in = math.prod(shape[a] for a in rows)
        self.fan_out = math.prod(shape[a] for a in cols)
        self.shape = (math.prod(shape[a] for a in batch), self.fan_in, self.fan_out)

    def to_batch(self, u: torch.Tensor) -> torch.Tensor:
        return u.permute(self.perm).reshape(self.shape)

    def from_batch(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(self.permuted).permute(self.inverse)


def leaf_dims(who: str, dims: Any, tree: Any, spec: Any = None) -> list:
    """Per leaf of ``tree`` as ``spec`` flattens it (default: ``None`` a leaf, namespace
    ``"ftopt"``): its :class:`MuonDimensionNumbers` or ``None``. ``dims``: one for every
    leaf, a tree of them (or a prefix), or a function of ``tree`` giving one."""
    if callable(dims) and not isinstance(dims, MuonDimensionNumbers):
        dims = dims(tree)
    try:
        full = optree.tree_broadcast_prefix(dims, tree, is_leaf=_is_dims, none_is_leaf=True,
                                            namespace="ftopt")
    except (ValueError, TypeError) as err:
        raise ValueError(f"{who}: weight_dimension_numbers does not fit the params' tree "
                         f"(a MuonDimensionNumbers or None per leaf or subtree): "
                         f"{err}") from None
    # (None where the tree holds None: an empty subtree of ``spec``, or a leaf with none)
    full = optree.tree_map(lambda x, d: None if x is None else d, tree, full,
                           none_is_leaf=True, namespace="ftopt")
    if spec is None:
        spec = optree.tree_structure(tree, none_is_leaf=True, namespace="ftopt")
    out = spec.flatten_up_to(full)
    for d in out:
        if not _is_dims(d):
            raise TypeError(f"{who}: weight_dimension_numbers holds a "
                            f"{type(d).__name__}: expected MuonDimensionNumbers or None")
    return out


def views(who: str, dims: Any, spec: Any, paths: Sequence[str], u_flat: Sequence[Any],
          p_flat: Sequence[Any]) -> list:
    """A :class:`MatrixView` per leaf of a stage's call (``None`` where the leaf has no
    update or passes through, an empty leaf too). The tree ``dims`` is resolved against
    holds each leaf's update, or its param where it has none."""
    carrier = optree.tree_unflatten(spec, [u if u is not None else p
                                           for u, p in zip(u_flat, p_flat)])
    found = leaf_dims(who, dims, carrier, spec)
    out = [None if u is None or d is None or u.numel() == 0
           else MatrixView(who, path, tuple(u.shape), d)
           for path, u, d in zip(paths, u_flat, found)]
    for path, view, d in zip(paths, out, found):
        split = shards.leaf_split(path) if view is not None else None
        if split is not None and not split[1] <= view.batch_axes:
            raise ValueError(
                f"{who} at {path}: the leaf is sharded with placements {split[0]}, "
                f"splitting dim {sorted(split[1] - view.batch_axes)[0]}, which is not a "
                f"batch axis of its matrices ({d}): each rank would see part of a "
                "matrix. Shard it on a batch axis, or leave it out of the stage")
    return out

