"""Work tables: which block of which leaf each program of a group's kernels runs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton


@dataclass
class WorkTable:
    """Blocks of a group's leaves: program ``pid`` runs ``BLOCK`` elements of one leaf.
    The reduction pass takes the blocks in order (a leaf's partial sums lie together);
    the main kernel in the order of ``main_leaf``, ``main_start`` (:func:`interleaved`;
    the same tensors when in order)."""

    block_leaf: torch.Tensor
    block_start: torch.Tensor
    numel: torch.Tensor
    first_block: torch.Tensor
    blocks_per_leaf: torch.Tensor
    num_blocks: int
    num_leaves: int
    main_leaf: torch.Tensor
    main_start: torch.Tensor


def interleaved(total: int, chunk: int) -> torch.Tensor:
    """A permutation of ``range(total)`` in runs of ``chunk`` consecutive blocks, the
    runs in the order ``k -> k * stride mod runs`` (``stride`` the integer nearest ``runs``
    times the golden ratio's fraction that is coprime with it): consecutive runs fall far
    apart, and every window of them samples the whole group evenly."""
    runs = -(-total // chunk) if chunk else 0
    if runs < 3:
        return torch.arange(total)
    stride = round(runs * 0.6180339887498949)
    while math.gcd(stride, runs) != 1:
        stride += 1
    order = torch.arange(runs) * stride % runs
    blocks = (order[:, None] * chunk + torch.arange(chunk)[None, :]).flatten()
    return blocks[blocks < total]


# The start of a padding block: past any leaf's end, and a multiple of any tile.
PAST_THE_END = 1 << 40


def is_interleaved(total: int, interleave: int) -> bool:
    """Whether a table of ``total`` blocks runs them in runs of ``interleave``."""
    return bool(interleave) and total > 2 * interleave


@lru_cache(maxsize=64)
def work_table(numels: tuple[int, ...], device: torch.device, block: int,
               every_leaf: bool = False, interleave: int = 0, span: int = 1) -> WorkTable:
    """Programs of ``block`` elements over the leaves; ``every_leaf``: an empty leaf gets
    one program too (its lanes all masked), where a leaf's first program writes a
    per-leaf value; ``interleave``: the main kernel takes the blocks in runs of that many
    (:func:`interleaved`; 0: in order); ``span``: the main kernel's programs take that
    many blocks each (:func:`ftopt.lowering.split.spanned`), its blocks padded to whole
    spans with empty ones (leaf 0, from :data:`PAST_THE_END`)."""
    counts = torch.tensor([max(triton.cdiv(n, block), int(every_leaf)) for n in numels],
                          dtype=torch.int64)
    first = torch.cumsum(counts, 0) - counts
    total = int(counts.sum())
    leaf = torch.repeat_interleave(torch.arange(len(numels)), counts)
    start = (torch.arange(total) - first[leaf]) * block
    move = lambda t, dt=torch.int64: t.to(dt).to(device)  # noqa: E731
    block_leaf, block_start = move(leaf, torch.int32), move(start)
    main_leaf, main_start = block_leaf, block_start
    if is_interleaved(total, interleave):
        order = interleaved(total, interleave)
        main_leaf, main_start = move(leaf[order], torch.int32), move(start[order])
    if span > 1 and total % span:
        pad = span - total % span
        main_leaf = torch.cat([main_leaf, main_leaf.new_zeros(pad)])
        main_start = torch.cat([main_start, main_start.new_full((pad,), PAST_THE_END)])
    return WorkTable(block_leaf, block_start, move(torch.tensor(numels)), move(first),
                     move(counts), total, len(numels), main_leaf, main_start)
