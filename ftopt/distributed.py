"""Multi-GPU: ``DTensor`` params (FSDP2, HSDP, tensor parallel) stepped on their shards.

Installed in :mod:`ftopt.dispatch` as the ``distributed`` backend; the core calls it when
a leaf of a step or an update is a ``torch.distributed.tensor.DTensor``
(:mod:`ftopt.shards`). A call

1. checks every DTensor leaf's placements (``Shard`` or ``Replicate`` on each mesh
   dimension; a ``Partial`` gradient is refused, naming its path);
2. replaces each DTensor by its local tensor (``to_local()``: the shard's own storage,
   so a donated step writes the shards in place) and 8-bit absmax by a flat view;
3. runs the ordinary step or update on the local tensors (fused kernels on a GPU, eager
   elsewhere), with :class:`ftopt.shards.LocalShards` telling the core how to sum a
   norm's squares over the ranks (one all-reduce per norm pass, over the sharded mesh
   dimensions only) and each local tensor's full size (the 8-bit ``min_size`` decision);
4. wraps every new local tensor as a DTensor with the placements, global shape and
   stride of the leaf it replaces (``DTensor.from_local``: no collective), and hands
   back the given DTensor objects where the step wrote in place.

Elementwise math never communicates. A norm sums the per-leaf squares over the mesh
dimensions any leaf is sharded on, in one all-reduce; where leaves of one mesh are
sharded over different mesh dimensions (tensor parallel ``Shard(1)`` next to
``Replicate()``, HSDP next to a replicated leaf), a leaf's squares are kept only on the
ranks at coordinate 0 of the dimensions it is replicated over, so it counts once (the
reducer is told each entry's leaf path). Adafactor's row and column sums over a split
dim go through the same reducer (:func:`ftopt.shards.reduce_sums`, one buffer for all
leaves), and its statistics of a split leaf are DTensors (:func:`reduced_zeros`). Leaves
on two meshes, or DTensors next to plain
tensors, raise, naming two leaves and their placements.

A donated step over the same DTensors as the last one skips all of this
(:mod:`ftopt.dtensor_cache`).

8-bit states on shards (:func:`quantize_shards`): a leaf's blocks are those of its full
tensor's flat layout, so codes and absmax equal a single-process run's and a checkpoint
loads on any number of ranks. That needs every shard to start on a block boundary (true
for FSDP2's dim-0 shards whenever a row is a multiple of 256 elements, e.g. every 2-D
weight of a GPT-2); a leaf whose shards start inside a block is refused at ``init``,
naming its shape and placements (``quantize_states(..., min_size=...)`` keeps it 32-bit).
The absmax is a DTensor of shape :func:`ftopt.quant.absmax_layout` sharded like the
leaf's rows.
"""

from __future__ import annotations

from typing import Any

import optree
import torch
import torch.distributed as dist
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ftopt import dtensor_cache, shards
from ftopt import tree as tree_lib
from ftopt import update as update_lib
from ftopt.combine import owner
from ftopt.dtensor_cache import as_dtensor, dtensor_of_spec
from ftopt.quant import absmax_layout, quantize_blockwise
from ftopt.rules import QuantizedSlot

__all__ = ["step", "cached_step", "cached_call", "update", "cached_update",
           "quantize_shards", "reduced_zeros"]


def step(tx, params, grads, state, donate: bool, backend: str):
    """:func:`ftopt.step` over trees holding DTensors (see the module docstring)."""
    call = _Call()
    local_params = call.unwrap(params, "params")
    local_grads = call.unwrap(grads, "grads", record=True)
    local_state = call.unwrap(state, "state")
    context = call.context()
    with shards.local_shards(context):
        new_params, new_state = update_lib.step(tx, local_params, local_grads, local_state,
                                                donate=donate, backend=backend)
    out = call.wrap(new_params, "params"), call.wrap(new_state, "state")
    if donate and backend != "eager":
        dtensor_cache.remember(tx, params, grads, state, backend, context)
    elif not donate:
        dtensor_cache.remember_call("step", owner(tx), (params, grads), state, backend,
                                    context)
    return out


def cached_step(tx, params, grads, state, backend: str):
    """The donated step over the DTensors of the last one, written in place, or ``None``
    (:mod:`ftopt.dtensor_cache`)."""
    return dtensor_cache.cached_step(tx, params, grads, state, backend)


def cached_call(tx, params, grads, state, backend: str):
    """The non-donated step over DTensors laid out as the last one's, or ``None``
    (:class:`ftopt.dtensor_cache.CallCache`)."""
    def inner(local_params, local_grads, local_state):
        return update_lib.step(tx, local_params, local_grads, local_state, donate=False,
                               backend=backend)
    return dtensor_cache.cached_call("step", owner(tx), (params, grads), state, backend,
                                     inner)


def update(obj, updates, state, params, extra: dict):
    """``tx.update`` over trees holding DTensors (see the module docstring)."""
    call = _Call()
    local_updates = call.unwrap(updates, "updates", record=True)
    local_state = call.unwrap(state, "state")
    local_params = call.unwrap(params, "params") if params is not None else None
    context = call.context()
    with shards.local_shards(context):
        new_updates, new_state = obj.update(local_updates, local_state, local_params,
                                            **extra)
    out = call.wrap(new_updates, "updates"), call.wrap(new_state, "state")
    dtensor_cache.remember_call("update", obj, (updates, params), state,
                                extra.get("backend", "auto"), context, extra)
    return out


def cached_update(obj, updates, state, params, extra: dict):
    """``tx.update`` over DTensors laid out as the last call's, or ``None``
    (:class:`ftopt.dtensor_cache.CallCache`)."""
    def inner(local_updates, local_params, local_state):
        return obj.update(local_updates, local_state, local_params, **extra)
    return dtensor_cache.cached_call("update", obj, (updates, params), state,
                                     extra.get("backend", "auto"), inner, extra)


def _is_slot(x: Any) -> bool:
    return isinstance(x, QuantizedSlot)


def _flatten(tree: Any):
    return optree.tree_flatten_with_path(tree, is_leaf=_is_slot, none_is_leaf=False,
                                         namespace="ftopt")


def local_tensor(d: DTensor) -> torch.Tensor:
    """The shard of ``d`` held by this rank: its own storage, outside autograd."""
    with torch.no_grad():
        return d.to_local()


def check_placements(what: str, path: str, d: DTensor) -> None:
    """Shard or Replicate on every mesh dimension (a Partial sum is not a value yet)."""
    for dim, placement in enumerate(d.placements):
        if not (placement.is_shard() or placement.is_replicate()):
            raise ValueError(
                f"{what} at {path}: placement {placement} on mesh dimension {dim} is not "
                f"supported (placements {tuple(d.placements)}): expected Shard or "
                "Replicate (reduce a Partial gradient first, e.g. "
                "grad.redistribute(placements=[Replicate()]))")


class _Call:
    """The DTensor leaves of one call: unwrapped on the way in, wrapped on the way out."""

    def __init__(self):
        self.given: dict[str, list] = {}  # tree -> per leaf: (original, local) or None
        self.local_shards = shards.LocalShards()
        self.norm_leaves: list[tuple[str, Any]] = []  # (path, leaf) deciding the norms
        self.specs: dict[str, Any] = {}  # path -> DTensorSpec of a param, grad or update

    def unwrap(self, tree: Any, what: str, *, record: bool = False) -> Any:
        paths, leaves, spec = _flatten(tree)
        given, local = [], []
        for path, leaf in zip(paths, leaves):
            where = tree_lib.path_str(path)
            if isinstance(leaf, DTensor):
                check_placements(what, where, leaf)
                mine = local_tensor(leaf)
                self.local_shards.record(mine, leaf.numel())
                if what in ("params", "grads", "updates"):
                    self.local_shards.splits[where] = (tuple(leaf.placements),
                                                       shards.split_dims(leaf))
                    self.specs[where] = leaf._spec
                    self.local_shards.shapes[where] = tuple(leaf.shape)
                given.append((leaf, mine))
                local.append(mine)
            elif _is_slot(leaf) and isinstance(leaf.codes, DTensor):
                for part, d in zip(("codes", "absmax"), leaf):
                    if not isinstance(d, DTensor):
                        raise TypeError(f"{what} at {where}: 8-bit {part} is a "
                                        f"{type(d).__name__}, expected a DTensor as the "
                                        "codes are")
                    check_placements(what, where, d)
                mine = QuantizedSlot(local_tensor(leaf.codes),
                                     local_tensor(leaf.absmax).view(-1))
                given.append((leaf, mine))
                local.append(mine)
            else:
                given.append(None)
                local.append(leaf)
            if what in ("params", "grads", "updates") and not _is_slot(leaf):
                self.norm_leaves.append((f"{what} at {where}", leaf))
        self.given[what] = given
        return spec.unflatten(local)

    def wrap(self, tree: Any, what: str) -> Any:
        """``tree`` (the local result for the ``what`` tree) with DTensors put back."""
        given = self.given[what]
        paths, leaves, spec = _flatten(tree)
        if len(leaves) != len(given):
            raise RuntimeError(f"{what}: the result has {len(leaves)} leaves, the input "
                               f"{len(given)}")
        return spec.unflatten([x if g is None else _rewrap(x, *g)
                               for x, g in zip(leaves, given)])

    def context(self) -> shards.LocalShards:
        context = self.local_shards
        layouts = _norm_layouts(self.norm_leaves)
        context.reduce = _reducer(layouts, context.splits)
        context.agree = _agreement(layouts)
        context.offset = shard_offsets(self.specs)
        specs = dict(self.specs)  # (specs, not tensors: a cached context keeps them)
        context.as_global = lambda path, t: dtensor_of_spec(t, specs[path])
        return context


def _rewrap(x: Any, original: Any, local: Any) -> Any:
    if x is local:
        return original
    if _is_slot(original):
        if not _is_slot(x):
            return x
        codes = original.codes if x.codes is local.codes else as_dtensor(x.codes,
                                                                         original.codes)
        if x.absmax is local.absmax:
            absmax = original.absmax
        else:
            shape = local_tensor(original.absmax).shape
            absmax = as_dtensor(x.absmax.view(shape), original.absmax)
        return QuantizedSlot(codes, absmax)
    if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
        return as_dtensor(x, original)
    return x


def shard_offsets(specs: dict[str, Any]):
    """``path -> `` where this rank's shard of the leaf at ``path`` starts in the full
    tensor's row-major order, or ``None`` where the shard is not one run of it
    (:func:`ftopt.shards.flat_offset`); computed on first use, then kept."""
    known: dict[str, int | None] = {}

    def offset(path: str) -> int | None:
        if path not in known:
            spec = specs.get(path)
            known[path] = 0 if spec is None else _flat_offset(spec)
        return known[path]
    return offset


def _flat_offset(spec) -> int | None:
    shape = tuple(spec.shape)
    if not any(p.is_shard() for p in spec.placements):
        return 0
    if any(p.is_shard() and type(p) is not Shard for p in spec.placements):
        return None  # (a strided shard: not one run)
    local, start = compute_local_shape_and_global_offset(shape, spec.mesh, spec.placements)
    return shards.flat_offset(shape, tuple(local), tuple(start))


def _norm_layouts(leaves: list[tuple[str, Any]]) -> dict:
    """(mesh, sharded mesh dimensions) -> the first leaf with that layout."""
    layouts: dict = {}
    for where, leaf in leaves:
        if isinstance(leaf, DTensor):
            dims = tuple(i for i, p in enumerate(leaf.placements) if p.is_shard())
            key = (leaf.device_mesh, dims)
            layouts.setdefault(key, (where, tuple(leaf.placements)))
        elif isinstance(leaf, torch.Tensor):
            layouts.setdefault((None, ()), (where, "a plain tensor (not a DTensor)"))
    return layouts


def _reducer(layouts: dict, splits: dict):
    if not layouts:
        return None
    meshes = {mesh for mesh, _ in layouts}
    if len(layouts) > 1 and (None in meshes or len(meshes) > 1):
        return _refusal(layouts)
    mesh = next(iter(meshes))
    union = sorted({dim for _, dims in layouts for dim in dims})
    if mesh is None or not union:
        return None  # every rank holds whole leaves: local norms are the norms
    mixed = _refusal(layouts) if len(layouts) > 1 else None
    coordinate = mesh.get_coordinate() or []

    def reduce(squares: torch.Tensor, paths: list | None,
               sizes: list[int] | None = None) -> torch.Tensor:
        if mixed is not None:
            # Leaves sharded over different mesh dims of one mesh: a leaf replicated
            # over a dim in ``union`` counts on the ranks at coordinate 0 of it only.
            if sizes is None and paths and squares.numel() % len(paths) == 0:
                sizes = [squares.numel() // len(paths)] * len(paths)
            if not paths or sizes is None or sum(sizes) != squares.numel() or any(
                    path not in splits for path in paths):
                mixed(squares)  # which leaf an entry is of is not known: refused
            keep = []
            for path in paths:
                dims = {i for i, p in enumerate(splits[path][0]) if p.is_shard()}
                keep.append(all(coordinate[d] == 0 for d in union if d not in dims))
            mask = torch.tensor(keep, dtype=squares.dtype).repeat_interleave(
                torch.tensor(sizes))
            squares = squares * mask.to(squares.device)
        for dim in union:
            dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
        return squares
    return reduce


def _refusal(layouts: dict):
    (_, (a, pa)), (_, (b, pb)) = list(layouts.items())[:2]

    def refuse(squares: torch.Tensor, paths: list | None = None):
        raise ValueError(
            f"a norm over leaves sharded differently: {a} has placements {pa}, {b} "
            f"has {pb}; a norm (clip_by_global_norm, trust ratios, "
            "clip_by_param_norm_ratio) needs every leaf a DTensor of one mesh")
    return refuse


def _agreement(layouts: dict):
    meshes = [mesh for mesh, _ in layouts if mesh is not None]
    if not meshes:
        return None
    mesh: DeviceMesh = meshes[0]

    def agree(flag: torch.Tensor) -> torch.Tensor:
        value = flag.to(torch.float32).reshape(1)
        for dim in range(mesh.ndim):
            dist.all_reduce(value, op=dist.ReduceOp.MIN, group=mesh.get_group(dim))
        return value.reshape(()) > 0.5
    return agree


# -- states of per-slice statistics -------------------------------------------------------

def reduced_zeros(x: DTensor, dim: int, dtype: torch.dtype) -> DTensor:
    """Zeros of the shape of ``x`` without ``dim`` (a statistic reduced over ``dim``, as
    Adafactor's row and column second moments), a DTensor on the mesh of ``x``: sharded
    as ``x`` where ``x`` is split on another dim (each rank keeps the statistics of its
    own slices), replicated where ``x`` is split on ``dim`` (the statistic is summed over
    the ranks, so every rank holds all of it)."""
    placements = []
    for p in x.placements:
        split = p.dim % x.ndim if p.is_shard() else dim
        placements.append(Replicate() if split == dim else Shard(split - (split > dim)))
    shape = tuple(n for k, n in enumerate(x.shape) if k != dim)
    local, _ = compute_local_shape_and_global_offset(shape, x.device_mesh, placements)
    stride = torch.empty(shape, device="meta").stride()
    zeros = torch.zeros(local, dtype=dtype, device=local_tensor(x).device)
    return DTensor.from_local(zeros, x.device_mesh, placements, run_check=False,
                              shape=torch.Size(shape), stride=stride)


# -- 8-bit states ---------------------------------------------------------------------

def quantize_shards(x: DTensor, qmap: torch.Tensor, block_size: int) -> QuantizedSlot:
    """8-bit codes and absmax of the DTensor ``x``, blocks of its full flat layout, built
    on each rank from its shard (see the module docstring)."""
    reason = _block_misfit(x, block_size)
    if reason is not None:
        raise ValueError(
            f"8-bit states of a leaf of shape {tuple(x.shape)} with placements "
            f"{tuple(x.placements)}: {reason}. Keep it 32-bit (quantize_states(..., "
            "min_size=...) above its size) or shard it so that every shard starts on a "
            f"block boundary ({block_size} elements)")
    local = local_tensor(x)
    codes, absmax = quantize_blockwise(local.float(), qmap, block_size)
    layout = absmax_layout(x.shape, block_size)
    local_layout = (local.shape[0], layout[1]) if len(layout) == 2 else (absmax.numel(),)
    placements = [p if p.is_shard() else Replicate() for p in x.placements]
    mesh = x.device_mesh
    stride = (layout[1], 1) if len(layout) == 2 else (1,)
    return QuantizedSlot(
        DTensor.from_local(codes, mesh, x.placements, run_check=False, shape=x.shape,
                           stride=x.stride()),
        DTensor.from_local(absmax.view(local_layout), mesh, placements, run_check=False,
                           shape=torch.Size(layout), stride=stride))


def _block_misfit(x: DTensor, block: int) -> str | None:
    """Why the shards of ``x`` cannot hold whole blocks of its flat layout (or None)."""
    sharded = [(i, p) for i, p in enumerate(x.placements) if p.is_shard()]
    if not sharded:
        return None
    if len(sharded) > 1 or type(sharded[0][1]) is not Shard or sharded[0][1].dim != 0:
        return ("8-bit states on shards need the leaf sharded on dim 0 (Shard(0)) over "
                "one mesh dimension")
    ranks = x.device_mesh.size(sharded[0][0])
    rows = x.shape[0]
    row = x.numel() // rows if rows else 0
    per = -(-rows // ranks)
    spans = [(min(r * per, rows), min((r + 1) * per, rows)) for r in range(ranks)]
    for r, (start, end) in enumerate(spans):
        if start < end and (start * row) % block:
            return f"shard {r} starts at element {start * row}, inside a block"
    layout = absmax_layout(x.shape, block)
    if len(layout) == 1:
        total = layout[0]
        per_block = -(-total // ranks)
        for r, (start, end) in enumerate(spans):
            first, count = start * row // block, -(-(end - start) * row // block)
            chunk = (min(r * per_block, total), min((r + 1) * per_block, total))
            if count and (first, first + count) != chunk:
                return (f"the blocks of shard {r} ({first}..{first + count}) are not "
                        "the even split of the absmax a DTensor describes")
    return None
