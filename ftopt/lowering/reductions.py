"""The reduction passes of a step with norms: per-leaf sums, then global sums.

Every level of reductions (a norm whose input needs the norms of the level before, as
LAMB's trust ratio after a global clip) is one reduction kernel per group (each program
writes its block's partial sums), one ``_leaf_sums`` launch per group that sums each
leaf's partials in a fixed order into the group's buffer, and, where the level holds a
global reduction, one ``_global_sums`` launch over the leaves of every group. The sums
land in one zeroed allocation (the global sums, then each group's rows, each part
16-byte aligned), so a level costs three launches however many reductions it holds:
GPT-2's DoG step ran 15 small torch kernels more a step (a copy per reduction into its
column, four ops per global sum), ~0.2 ms of the host's time.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from ftopt import shards
from ftopt.lowering import codegen, launch

__all__ = ["run_reductions"]

# One program sums a leaf's partials, R_BLOCK a load, in a loop whose iterations each wait
# for their load: 256 a load took GPT-2's embedding (75,400 partials of 512 elements) ~300
# dependent loads, ~0.1 ms of one SM while the others idled (Fromage, LARS and NovoGrad at
# 0.84-0.90 of copy on an H200); 4096 a load over 8 warps takes 19.
_LEAF_SUMS_BLOCK = 4096
_LEAF_SUMS = (("R_BLOCK", _LEAF_SUMS_BLOCK), ("num_warps", 8))
_GLOBAL_SUMS = (("R_BLOCK", 1024), ("num_warps", 4))


@triton.jit
def _leaf_sums(partials_ptr, first_block_ptr, num_blocks_ptr, cols_ptr, out_ptr,
               N_PART: tl.constexpr, OUT_STRIDE: tl.constexpr, R_BLOCK: tl.constexpr):
    # Sum the per-block partials of one leaf in a fixed order (deterministic norms), into
    # the reduction's column of the leaf's row.
    leaf = tl.program_id(0)
    j = tl.program_id(1)
    first = tl.load(first_block_ptr + leaf)
    count = tl.load(num_blocks_ptr + leaf)
    acc = tl.zeros([R_BLOCK], tl.float32)
    for s in range(0, count, R_BLOCK):
        idx = s + tl.arange(0, R_BLOCK)
        acc += tl.load(partials_ptr + (first + idx) * N_PART + j, mask=idx < count, other=0.0)
    tl.store(out_ptr + leaf * OUT_STRIDE + tl.load(cols_ptr + j), tl.sum(acc))


@triton.jit
def _global_sums(rows_ptr, row_of_ptr, cols_ptr, out_ptr, N_LEAVES: tl.constexpr,
                 N_RED: tl.constexpr, R_BLOCK: tl.constexpr):
    # Sum one column over the rows of every leaf of every group, in the leaves' order in
    # the tree (``row_of``: each leaf's row): the same order, so the same sum, however the
    # leaves are grouped and their rows padded (a chain and its skip_zeros twin, whose
    # extra reductions pad the groups' rows otherwise).
    col = tl.load(cols_ptr + tl.program_id(0))
    acc = tl.zeros([R_BLOCK], tl.float32)
    for s in range(0, N_LEAVES, R_BLOCK):
        idx = s + tl.arange(0, R_BLOCK)
        row = tl.load(row_of_ptr + idx, mask=idx < N_LEAVES, other=0)
        acc += tl.load(rows_ptr + row * N_RED + col, mask=idx < N_LEAVES, other=0.0)
    tl.store(out_ptr + col, tl.sum(acc))


@lru_cache(maxsize=256)
def _columns(traced, level: int, scope: str | None, device: torch.device) -> torch.Tensor:
    """The buffer columns of a level's reductions (``scope``: of that scope only)."""
    return launch.to_device([r.index for r in codegen.level_reductions(traced, level)
                             if scope in (None, r.scope)], device)


@lru_cache(maxsize=64)
def _in_order(n: int, device: torch.device) -> torch.Tensor:
    return launch.to_device(list(range(n)), device)


@lru_cache(maxsize=256)
def _row_of(leaves: tuple, rows: tuple, device: torch.device) -> torch.Tensor:
    """Each leaf's row in the buffer after the global sums, in the leaves' order in the
    tree (``leaves``: each group's leaves, ``rows``: each group's rows, padding
    included)."""
    at, pairs = 0, []
    for group, n in zip(leaves, rows):
        pairs += [(leaf, at + j) for j, leaf in enumerate(group)]
        at += n
    return launch.to_device([row for _, row in sorted(pairs)], device)


def _rows(num_leaves: int, n_red: int) -> int:
    """A group's rows: one a leaf, plus zero rows up to a 16-byte boundary."""
    rows = num_leaves
    while rows * n_red % 4:
        rows += 1
    return rows


def run_reductions(traced, groups: list, scalars, device: torch.device):
    """Per-leaf reduction buffers of every group and the global buffer, level by level."""
    n_red = max(len(traced.graph.reductions), 1)
    if traced.levels == 0:
        dummy = launch._dummy(device)
        return [dummy] * len(groups), dummy
    head = _rows(1, n_red) * n_red
    rows = [_rows(g.work.num_leaves, n_red) for g in groups]
    space = torch.zeros(head + sum(rows) * n_red, dtype=torch.float32, device=device)
    global_buf = space[:n_red]
    leaf_bufs, at = [], head
    for g, r in zip(groups, rows):
        leaf_bufs.append(space[at:at + g.work.num_leaves * n_red])
        at += r * n_red
    sharded = shards.in_local_shards()
    row_of = None  # (the global sums' table, looked up once a call)
    for level in range(1, traced.levels + 1):
        reds = codegen.level_reductions(traced, level)
        cols = _columns(traced, level, None, device)
        level_sums = []
        for group, buf in zip(groups, leaf_bufs):
            w = group.pass_work
            if w.num_blocks == 0:
                if sharded:  # (every rank takes part in the collective below)
                    level_sums.append(torch.zeros(w.num_leaves * len(reds),
                                                  dtype=torch.float32, device=device))
                continue
            roles = codegen.input_roles(group.traced, bool(group.quant_block))
            kernel = launch._kernel(group.traced, "reduce", level, group.variant(scalars))
            partials = torch.empty(w.num_blocks * len(reds), dtype=torch.float32,
                                   device=device)
            launch._launch(kernel, (w.num_blocks,),
                           [*group.args(roles, scalars, buf, global_buf, False), partials],
                           launch._constants_cached(group.traced, group.quant_block,
                                                    kind=group.kind,
                                                    tile=group.reduce_tile), device)
            # Local shards: a leaf's sums go to the collective first, in the level's order.
            out, stride = buf, n_red
            if sharded:
                out = torch.empty(w.num_leaves * len(reds), dtype=torch.float32,
                                  device=device)
                level_sums.append(out)
                stride = len(reds)
            launch._launch(_leaf_sums, (w.num_leaves, len(reds)),
                           [partials, w.first_block, w.blocks_per_leaf,
                            _in_order(len(reds), device) if sharded else cols, out],
                           (("N_PART", len(reds)), ("OUT_STRIDE", stride), *_LEAF_SUMS),
                           device)
        if sharded:
            _scatter(groups, leaf_bufs, level_sums, reds, n_red)
        global_cols = _columns(traced, level, "global", device)
        if global_cols.numel():
            if row_of is None:
                row_of = _row_of(tuple(tuple(g.leaves) for g in groups), tuple(rows),
                                 device)
            launch._launch(_global_sums, (global_cols.numel(),),
                           [space[head:], row_of, global_cols, global_buf],
                           (("N_LEAVES", row_of.numel()), ("N_RED", n_red), *_GLOBAL_SUMS),
                           device)
    return leaf_bufs, global_buf


def _scatter(groups: list, leaf_bufs: list, level_sums: list, reds: list, n_red: int):
    """Local shards: one all-reduce for every leaf of every group, between this level's
    reduction pass and the kernels that read it; then each sum to its column."""
    paths = [path for group in groups for path in group.paths for _ in reds]
    sums_of = iter(_reduced_over_shards(level_sums, paths))
    for group, buf in zip(groups, leaf_bufs):
        w = group.work
        sums = next(sums_of)
        view = buf.view(w.num_leaves, n_red)
        for j, red in enumerate(reds):
            view[:, red.index] = sums.view(w.num_leaves, len(reds))[:, j]


def _reduced_over_shards(parts: list[torch.Tensor], paths: list) -> list[torch.Tensor]:
    """The per-leaf sums of squares of the local shards, summed over the ranks (``paths``:
    each entry's leaf)."""
    if not parts:
        return parts
    total = shards.reduce_squares(torch.cat(parts) if len(parts) > 1 else parts[0],
                                  paths if len(paths) == sum(p.numel() for p in parts)
                                  else None)
    return list(total.split([p.numel() for p in parts]))
