"""Tiles of the generated kernels: elements and warps per program, per kernel kind.

Tuned on an H200 (``benchmarks/RESULTS.md``); environment variables override them for
new hardware. Under the Triton interpreter every program costs Python time, so blocks
are larger there.
"""

from __future__ import annotations

import os

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# Elements per program and warps per program of every kernel (FTOPT_BLOCK and
# FTOPT_NUM_WARPS override them, for tuning on new hardware). On an H200, 512/4 is as
# fast as 1024/4 with fp32 params and 12% faster with bf16 ones (benchmarks/RESULTS.md).
# Under the Triton interpreter every program costs Python time, so blocks are larger.
BLOCK = int(os.environ.get("FTOPT_BLOCK", "4096" if INTERPRETING else "512"))
NUM_WARPS = int(os.environ.get("FTOPT_NUM_WARPS", "4"))
# In-place skip_zeros kernels load p and the states only after g (their masks depend on
# it, so those loads are not vectorized): their own tile, tuned apart (H200, dense
# gradients, 1024/4: +3.0% over no skip_zeros where 512/4 gave -0.3%).
# FTOPT_IN_PLACE_TILE ("BLOCKxWARPS") overrides it.
IN_PLACE_TILE = tuple(int(x) for x in os.environ.get(
    "FTOPT_IN_PLACE_TILE", "2048x4" if INTERPRETING else "512x4").split("x"))
# Kernels with 8-bit slots are bound by their code-map lookups, not by memory: 1024/4
# is 3% faster than 512/4 there (H200). A multiple of every 8-bit block size that fuses.
# FTOPT_QUANT_TILE overrides it.
QUANT_TILE = tuple(int(x) for x in os.environ.get(
    "FTOPT_QUANT_TILE", "4096x4" if INTERPRETING else "1024x4").split("x"))


def tile(traced, quant_block: int = 0) -> tuple[int, int]:
    """(elements, warps) per program of ``traced``'s kernels (``quant_block``: the
    group's 8-bit block size, 0 for fp32 slots)."""
    if quant_block:
        return QUANT_TILE
    if traced.in_place:
        return IN_PLACE_TILE
    return BLOCK, NUM_WARPS
