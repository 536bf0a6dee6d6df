"""What the core knows of sharded (``DTensor``) leaves: how to spot them, and two hooks.

A ``torch.distributed.tensor.DTensor`` param (FSDP2, HSDP, tensor parallel) is stepped on
each rank's local shard. The distributed backend (:mod:`ftopt.distributed`, installed in
:mod:`ftopt.dispatch` as ``distributed``) unwraps the DTensor leaves of a call, runs the
ordinary step or update on the local tensors inside :func:`local_shards`, and wraps the
results again. While it runs, two things differ from a single-process call, and the core
asks this module about them:

* a norm (``leaf_norm``, ``global_norm``) sums the squares of a leaf's shards over the
  ranks: eager and fused backends pass their per-leaf partial sums to
  :func:`reduce_squares` (one buffer, one all-reduce);
* the 8-bit decision (``min_size``) is made from a leaf's full size, which the local
  shard no longer shows: :func:`full_numel`.

This module imports nothing from ``torch.distributed``: ``DTensor`` is looked up only if
the program has imported it already, so a single-process step pays one dict lookup. Once
it is imported, :func:`any_dtensor` flattens the trees; ``ftopt.step`` and ``update``
first try the fused tables of an earlier call, whose tensor check proves plain tensors,
and scan only when those do not fit.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import optree
import torch

__all__ = ["dtensor_class", "is_dtensor", "any_dtensor", "LocalShards", "local_shards",
           "full_numel", "leaf_split", "reduce_squares", "all_ranks", "in_local_shards",
           "on_local_shards", "split_dims", "norm_leaves", "element_offset",
           "flat_offset", "full_shape", "reduce_sums", "strided"]


def dtensor_class() -> type | None:
    """``DTensor`` if ``torch.distributed.tensor`` is imported, else ``None``."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def is_dtensor(x: Any) -> bool:
    cls = dtensor_class()
    return cls is not None and isinstance(x, cls)


def any_dtensor(*trees: Any) -> bool:
    """Whether any leaf of ``trees`` is a ``DTensor`` (8-bit slots looked into)."""
    cls = dtensor_class()
    if cls is None:
        return False
    for tree in trees:
        for leaf in optree.tree_leaves(tree, none_is_leaf=False, namespace="ftopt"):
            if isinstance(leaf, cls):
                return True
    return False


def strided(placements: tuple) -> bool:
    """Whether ``placements`` hold a shard that is not a plain ``Shard`` (FSDP2 over
    tensor parallel makes a strided one: a rank's part is not one block of the dim). By
    the class name: this module imports nothing of ``torch.distributed``."""
    return any(p.is_shard() and type(p).__name__ != "Shard" for p in placements)


def split_dims(x: Any) -> frozenset[int]:
    """The dims of the DTensor ``x`` that its shards split (a ``Shard`` over more than one
    rank); empty for any other tensor."""
    if not is_dtensor(x):
        return frozenset()
    return frozenset(p.dim % max(x.ndim, 1) for i, p in enumerate(x.placements)
                     if p.is_shard() and x.device_mesh.size(i) > 1)


@dataclass
class LocalShards:
    """The context of a call on local shards (built by :mod:`ftopt.distributed`).

    ``full_numels``: id of a local tensor -> the element count of its full tensor (the
    tensors are kept alive in ``keep``). ``reduce``: sums a 1-D buffer of per-leaf
    squared norms (or of any per-leaf partial sums) over the ranks that hold the leaves'
    shards (given the leaves' paths, or ``None``, and optionally each leaf's number of
    entries: one each if not given). ``agree``: a 0-d bool that
    holds on every rank (a logical AND over the mesh).
    """

    full_numels: dict[int, int] = field(default_factory=dict)
    keep: list = field(default_factory=list)
    reduce: Callable[..., torch.Tensor] | None = None
    agree: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Pytree path of a param, gradient or update leaf -> (its placements, the tensor dims
    # its shards split over more than one rank).
    splits: dict[str, tuple[tuple, frozenset[int]]] = field(default_factory=dict)
    # Pytree path of a param, gradient or update leaf -> where its local shard starts in
    # the full tensor's row-major order (``None``: the shard is not one run of it).
    # Computed on first use (see :func:`element_offset`).
    offset: Callable[[str], int | None] | None = None
    # Pytree path of a param, gradient or update leaf -> the shape of its full tensor.
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # (path, a tensor laid out as that leaf's local shard) -> the DTensor it is a shard of
    # (no collective), for math that reads whole leaves (see :func:`global_view`).
    as_global: Callable[[str, torch.Tensor], Any] | None = None

    def record(self, local: torch.Tensor, numel: int) -> None:
        self.full_numels[id(local)] = numel
        self.keep.append(local)


_CURRENT: contextvars.ContextVar[LocalShards | None] = contextvars.ContextVar(
    "ftopt_local_shards", default=None)


@contextlib.contextmanager
def local_shards(context: LocalShards) -> Iterator[LocalShards]:
    """Within it, the core runs on local shards described by ``context``."""
    token = _CURRENT.set(context)
    try:
        yield context
    finally:
        _CURRENT.reset(token)


def full_numel(t: torch.Tensor) -> int | None:
    """The element count of the full tensor ``t`` is (a shard of): ``t.numel()`` outside
    a call on local shards; inside one, ``None`` for a tensor it does not know (a value
    computed from shards), so a check that needs the full size is left out."""
    context = _CURRENT.get()
    if context is None:
        return t.numel()
    return context.full_numels.get(id(t))


def leaf_split(path: str) -> tuple[tuple, frozenset[int]] | None:
    """``(placements, split dims)`` of the leaf at ``path`` (a param, gradient or update)
    in a call on local shards: the dims of the full tensor that its shards split; ``None``
    outside such a call, or for a leaf that is not a DTensor."""
    context = _CURRENT.get()
    return None if context is None else context.splits.get(path)


def full_shape(path: str) -> tuple[int, ...] | None:
    """The shape of the full tensor of the leaf at ``path`` (a param, gradient or update)
    in a call on local shards; ``None`` outside such a call, or for a leaf that is not a
    DTensor (its local tensor is the full one)."""
    context = _CURRENT.get()
    return None if context is None else context.shapes.get(path)


_NORM_PATHS: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "ftopt_norm_paths", default=None)


@contextlib.contextmanager
def norm_leaves(paths: list[str]) -> Iterator[None]:
    """Within it, a per-leaf buffer given to :func:`reduce_squares` without paths holds
    the leaves at ``paths``, in order (an eager rule sets this around its body)."""
    token = _NORM_PATHS.set(paths)
    try:
        yield
    finally:
        _NORM_PATHS.reset(token)


def reduce_squares(squares: torch.Tensor, paths: list[str] | None = None) -> torch.Tensor:
    """Per-leaf sums of squares of the local shards -> those of the full leaves (one
    all-reduce of the whole buffer; unchanged outside a call on local shards).

    ``paths``: the pytree path of each entry's leaf (else those of :func:`norm_leaves`),
    which leaves sharded over different mesh dimensions need: a leaf replicated over a
    mesh dimension that another leaf is sharded over counts once, not once per rank."""
    context = _CURRENT.get()
    if context is None or context.reduce is None:
        return squares
    return context.reduce(squares, paths if paths is not None else _NORM_PATHS.get())


def reduce_sums(sums: torch.Tensor, paths: list[str], sizes: list[int]) -> torch.Tensor:
    """Per-leaf partial sums over the local shards (a 1-D buffer: ``sizes[k]`` entries of
    the leaf at ``paths[k]``, in order) -> the sums over the full leaves, in one
    all-reduce (unchanged outside a call on local shards). Each leaf counts once, as in
    :func:`reduce_squares`."""
    context = _CURRENT.get()
    if context is None or context.reduce is None:
        return sums
    return context.reduce(sums, paths, sizes)


def all_ranks(flag: torch.Tensor) -> torch.Tensor:
    """A 0-d bool flag that holds on every rank (itself outside a call on shards)."""
    context = _CURRENT.get()
    if context is None or context.agree is None:
        return flag
    return context.agree(flag)


def flat_offset(shape: tuple, local_shape: tuple, offsets: tuple) -> int | None:
    """Where a block of a tensor of ``shape`` (``local_shape`` elements from the
    coordinates ``offsets``) starts in its row-major order, if the block is one run of
    it (a whole range of the first dim it splits, all dims before it of size 1); else
    ``None``. An empty block starts anywhere: 0."""
    if any(n == 0 for n in local_shape):
        return 0
    split = next((d for d, (a, b) in enumerate(zip(local_shape, shape)) if a != b), None)
    if split is None:
        return 0
    if any(n != 1 for n in shape[:split]) or tuple(local_shape[split + 1:]) != tuple(
            shape[split + 1:]):
        return None
    row = 1
    for n in shape[split + 1:]:
        row *= n
    return offsets[split] * row


def element_offset(path: str, who: str) -> int:
    """The row-major position in the full tensor of the first element of the local
    leaf at ``path`` (a param, gradient or update) in a call on local shards; 0 outside
    one or for a leaf that is not a DTensor. Rules that read element positions
    (``add_noise``) add it, so a shard's elements keep their single-process positions.

    Raises ``ValueError`` (naming ``who``, the path and the placements) where the shard
    is not one run of the full tensor (a split of a dim other than the first)."""
    context = _CURRENT.get()
    if context is None or context.offset is None:
        return 0
    start = context.offset(path)
    if start is None:
        placements = context.splits.get(path, ("?",))[0]
        raise ValueError(
            f"{who} at {path}: the leaf is sharded with placements {placements}, so its "
            "local shard is not one run of the full tensor's elements; the element "
            "positions it reads would not be the single-process ones. Shard it on its "
            "first dim (Shard(0)) or replicate it")
    return start


def can_view_globally() -> bool:
    """Whether :func:`global_view` gives DTensors here (outside a call on local shards
    every tensor is whole already)."""
    context = _CURRENT.get()
    return context is None or context.as_global is not None


def global_view(path: str, t: torch.Tensor) -> Any:
    """``t``, laid out as the local shard of the leaf at ``path``, as the DTensor it is
    a shard of in a call on local shards (torch's DTensor ops then compute over the whole
    leaf, communicating where they must); ``t`` itself elsewhere, or for a leaf that is
    not a DTensor."""
    context = _CURRENT.get()
    if context is None or context.as_global is None or path not in context.splits:
        return t
    return context.as_global(path, t)


def full_value(x: Any) -> Any:
    """A DTensor's full value on every rank (a collective where it is sharded or a
    partial sum); anything else as it is."""
    return x.full_tensor() if is_dtensor(x) else x


def in_local_shards() -> bool:
    """Whether a call on local shards is running (its norms need :func:`reduce_squares`)."""
    context = _CURRENT.get()
    return context is not None and context.reduce is not None


def on_local_shards() -> bool:
    """Whether a call on local shards is running (whatever its norms need)."""
    return _CURRENT.get() is not None
