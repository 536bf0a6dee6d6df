"""Launching a traced chain: work and address tables per group, reductions, main kernel.

A group is the set of active leaves sharing (device, param dtype, grad dtype). For each
group one int64 host tensor holds the work table (leaf and start of every block), the
numel of every leaf and one address per (leaf, role); it reaches the device in one copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ftopt.lowering import codegen

BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _leaf_sums(partials_ptr, first_block_ptr, num_blocks_ptr, out_ptr, N_PART: tl.constexpr,
               N_REDUCTIONS: tl.constexpr, R_BLOCK: tl.constexpr):
    # Sum the per-block partials of one leaf in a fixed order (deterministic norms).
    leaf = tl.program_id(0)
    j = tl.program_id(1)
    first = tl.load(first_block_ptr + leaf)
    count = tl.load(num_blocks_ptr + leaf)
    acc = tl.zeros([R_BLOCK], tl.float32)
    for s in range(0, count, R_BLOCK):
        idx = s + tl.arange(0, R_BLOCK)
        acc += tl.load(partials_ptr + (first + idx) * N_PART + j, mask=idx < count, other=0.0)
    tl.store(out_ptr + leaf * N_REDUCTIONS + j, tl.sum(acc))


@dataclass
class Group:
    """Active leaves of one (device, param dtype, grad dtype)."""

    device: torch.device
    p_dtype: torch.dtype
    g_dtype: torch.dtype
    leaves: list[int]


def make_groups(p_flat, g_flat, active: list[int]) -> list[Group]:
    groups: dict[tuple, Group] = {}
    for i in active:
        p, g = p_flat[i], g_flat[i]
        key = (p.device, p.dtype, g.dtype)
        if key not in groups:
            groups[key] = Group(p.device, p.dtype, g.dtype, [])
        groups[key].leaves.append(i)
    return list(groups.values())


class GroupTables:
    """Device tables of one group for one step."""

    def __init__(self, group: Group, numels: list[int], addresses: dict[str, list[int]]):
        blocks_per_leaf = [triton.cdiv(n, BLOCK) for n in numels]
        block_leaf, block_start, first_block = [], [], []
        for leaf, nb in enumerate(blocks_per_leaf):
            first_block.append(len(block_leaf))
            block_leaf.extend([leaf] * nb)
            block_start.extend(range(0, nb * BLOCK, BLOCK))
        self.num_blocks = len(block_leaf)
        self.num_leaves = len(numels)
        parts = {"block_leaf": block_leaf, "block_start": block_start, "numel": numels,
                 "first_block": first_block, "blocks_per_leaf": blocks_per_leaf, **addresses}
        flat: list[int] = []
        offsets = {}
        for name, values in parts.items():
            offsets[name] = (len(flat), len(values))
            flat.extend(values)
            if len(flat) % 2:  # keep every table 16-byte aligned
                flat.append(0)
        host = torch.tensor(flat, dtype=torch.int64)
        if group.device.type != "cpu":
            host = host.pin_memory()
        table = host.to(group.device, non_blocking=True)
        self._table = table
        self.views = {name: table[o:o + n] for name, (o, n) in offsets.items()}


def run_reductions(traced, groups, tables, args_of, device):
    """Fill each group's per-leaf reduction buffer and the global buffer, level by level."""
    n_red = len(traced.graph.reductions)
    global_buf = torch.zeros(max(n_red, 1), dtype=torch.float32, device=device)
    leaf_bufs = [torch.zeros(max(t.num_leaves * n_red, 1), dtype=torch.float32, device=device)
                 for t in tables]
    for level in range(1, traced.levels + 1):
        reds = codegen.level_reductions(traced, level)
        for group, tab, buf in zip(groups, tables, leaf_bufs):
            if tab.num_blocks == 0:
                continue
            source = codegen.reduction_source(traced, level, group.p_dtype, group.g_dtype)
            kernel = codegen.compile_source(source, f"ftopt_reduce_{level}")
            partials = torch.empty(tab.num_blocks * len(reds), dtype=torch.float32,
                                   device=device)
            kernel[(tab.num_blocks,)](*args_of(group, tab, buf, global_buf,
                                               codegen.input_roles(traced)), partials,
                                      **_constants(traced))
            sums = torch.empty(tab.num_leaves * len(reds), dtype=torch.float32, device=device)
            _leaf_sums[(tab.num_leaves, len(reds))](
                partials, tab.views["first_block"], tab.views["blocks_per_leaf"], sums,
                N_PART=len(reds), N_REDUCTIONS=len(reds), R_BLOCK=256)
            view = buf[: tab.num_leaves * n_red].view(tab.num_leaves, n_red)
            for j, red in enumerate(reds):
                view[:, red.index] = sums.view(tab.num_leaves, len(reds))[:, j]
        for red in reds:
            if red.scope == "global":
                total = [b[: t.num_leaves * n_red].view(t.num_leaves, n_red)[:, red.index].sum()
                         for b, t in zip(leaf_bufs, tables)]
                global_buf[red.index] = torch.stack(total).sum() if total else 0.0
    return leaf_bufs, global_buf


def _constants(traced) -> dict:
    return {
        "N_LEAF_VALUES": max(len(traced.graph.leaf_values), 1),
        "N_REDUCTIONS": max(len(traced.graph.reductions), 1),
        "BLOCK": BLOCK,
        "num_warps": NUM_WARPS,
    }


def run_main(traced, groups, tables, args_of, leaf_bufs, global_buf):
    for group, tab, buf in zip(groups, tables, leaf_bufs):
        if tab.num_blocks == 0:
            continue
        source = codegen.main_source(traced, group.p_dtype, group.g_dtype)
        kernel = codegen.compile_source(source, "ftopt_main")
        roles = codegen.input_roles(traced) + codegen.output_roles(traced)
        kernel[(tab.num_blocks,)](*args_of(group, tab, buf, global_buf, roles),
                                  **_constants(traced))
