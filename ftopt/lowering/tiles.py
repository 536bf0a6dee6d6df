"""Tiles of the generated kernels: elements and warps per program, per kernel kind.

Tuned on an H200 (``benchmarks/RESULTS.md``); environment variables override them for
new hardware. Under the Triton interpreter every program costs Python time, so blocks
are larger there.
"""

from __future__ import annotations

import os

from ftopt.lowering import half_tiles, knobs

INTERPRETING = knobs.INTERPRETING


# Every kernel's tile (larger under the interpreter); H200: 512/4 = 1024/4 fp32, 12% faster bf16.
BLOCK = knobs.power_of_two("FTOPT_BLOCK", 4096 if INTERPRETING else 512, "elements a program")
NUM_WARPS = knobs.power_of_two("FTOPT_NUM_WARPS", 4, "warps a program of the fused kernels")
# fp32 and 16-bit main kernels issue every load before the arithmetic (Graph.loads_first):
# a load after a correctly rounded division or sqrt waits on its branches. H200, ms:
# optimistic_adam_v2 1.78 -> 0.63, none slower (benchmarks/RESULTS.md, 2026-12-03). 8-bit
# kernels keep their order (quantized.hoisted).
LOADS_FIRST = knobs.switch("FTOPT_LOADS_FIRST", True, "fp32 and 16-bit kernels issue "
                           "every load before the arithmetic (0: in the chain's order)")
# In-place skip_zeros kernels load p and the states only after g (masked on it: not
# vectorized): their own tile (H200, dense gradients, 1024/4 +3.0% over no skip_zeros,
# 512/4 -0.3%).
IN_PLACE_TILE = knobs.tile("FTOPT_IN_PLACE_TILE", "2048x4" if INTERPRETING else "512x4",
                           "in-place skip_zeros kernels' tile, every layout's when set")
# Layouts (:func:`layout`) whose in-place tile differs. H200, GPT-2 Adam, split+in_place,
# dense / 90% of the embedding's rows zero against no skip_zeros (benchmarks/RESULTS.md):
# fp32 512x4 +1.6-2.2% / 1.24x, 1024x4 -0.2..+0.5% / 1.25-1.26x; bf16 params 512x4 +1.4%
# / 1.293x, 256x2 +0.0% / 1.329x (2026-12-04). bf16/fp16 states run in place where blocks
# are all zero (a carved embedding; stochastic rounding's dense steps too), 512x4 / 512x8
# / 256x4 / 256x2: GPT-2 step 1.244x / 1.183x / 1.224x / 1.259x by kernel time (stochastic
# rounding 1.185x / 0.80x / 0.87x / 1.204x).
IN_PLACE_TILES = ({} if INTERPRETING or "FTOPT_IN_PLACE_TILE" in os.environ
                  else {"fp32": (1024, 4), "16-bit": (256, 2), "16-bit states": (256, 2)})
# Register caps (Triton's ``maxnreg``) of in-place kernels on NVIDIA GPUs, per layout
# (none: the compiler's choice). H200, GPT-2 Adam with skip_zeros, dense / 90% of the
# embedding's rows zero against no skip_zeros: fp32 at 1024x4 takes 58 registers (8
# programs a multiprocessor), +0.2% / 1.25-1.27x; capped at 56 (9 programs, no spills)
# -1.0..+0.5% / 1.27-1.29x in four sweeps. bf16 params at 1024x4 take 108 registers
# (+31%), capped at 64 spill (+17%). bf16/fp16 states' in-place kernels run where blocks
# are all zero (rounded to nearest, dense gradients run select), spanned ones hold the
# span loop; H200, GPT-2's embedding alone with 90% of its rows zero (leaf_split_gpu.py,
# kernel time) uncapped / 40 / 32: 48.0 / 42.7 / 45.6 us (stochastic rounding 61.1 /
# 58.0 / 59.2); GPT-2 steps against no skip_zeros, that embedding sparse: 1.23x / 1.24x.
IN_PLACE_MAXNREG = knobs.per_layout("FTOPT_IN_PLACE_MAXNREG", "fp32=56,16-bit states=40",
                                    "register caps of in-place skip_zeros kernels (NVIDIA)")
# The same for skip_zeros kernels that keep old values by selects (not in place), per
# layout. Static SASS (sm_90, Triton 3.9, benchmarks/sass_count.py), Adam with bf16
# states: the select kernel takes 44 registers, the kernel without skip_zeros 40 (11
# and 12 programs a multiprocessor); capped at 40 it spills nothing (+12 instructions).
# H200, GPT-2 with the watch, two A/Bs each (uncapped / 40): dense +4.9%, +2.2% / +2.1%,
# +2.9%, 90% of the embedding's rows zero 1.227x, 1.229x / 1.228x, 1.217x: no gain, so
# no cap by default (benchmarks/RESULTS.md, 2026-12-02).
# Not those whose rules read the element's index (stochastic rounding: capped at 40 on the
# H200, GPT-2 with every block part zero ran 1.144 ms against 0.687 uncapped).
SELECT_MAXNREG = knobs.per_layout("FTOPT_SELECT_MAXNREG", "", "register caps of "
                                  "skip_zeros kernels that select (no element index)")
# Blocks a program of a "split" main kernel runs, per layout (a power of two;
# :func:`ftopt.lowering.split.spanned`): it loads the gradients of all of them, returns
# where every one is zero, else runs them one after another. A program whose gradients
# are all zero waits on three dependent loads (its work-table entry, the gradients'
# address, the gradients) and ends, so an all-zero stretch runs at the rate the GPU
# starts programs, not at its bytes' bandwidth (1.9-3.5x the time of reading them; H200:
# 0.61 ns a program whatever it does, benchmarks/dispatch_gpu.py): fewer programs, less
# time. H200, GPT-2 Adam with skip_zeros, dense / 90% of the embedding's rows zero
# against no skip_zeros / all zero (ms): bf16 params 1 block +1.8% / 1.24x / 0.205, 2
# +2.2% / 1.27x / 0.128, 4 +1.0..1.3% / 1.30x / 0.096; the loop costs registers (bf16
# params 39 -> 56 a thread; Adam with bf16 states 32 -> 40, 4 fewer programs a
# multiprocessor: +9.6% dense, 1.13x); fp32 at 512x4, 2 blocks +1.2% / 1.27x, as its
# 1024x4 tile. 8-bit "split+defer", against off (ms, dense / sparse / all zero): 1 block
# 0.615 / 0.526 / 0.319 (off 0.603), 2 0.694 / 0.551 / 0.171, 4 0.674-0.681 / 0.536 /
# 0.133-0.182: its check becomes a trip to memory of its own (with one block it loads
# the gradients with the codes).
SPANS = knobs.unless_set("FTOPT_SPAN", knobs.per_layout("FTOPT_SPAN", "16-bit=4", "blocks a "
                         "program of a \"split\" main kernel (none under the interpreter)",
                         powers=True), INTERPRETING)
# Kernels with 8-bit slots are not bound by memory: one 256-element block per program
# with one warp is the fastest tile (H200, Adam, log2-rcp encoder, one 64M tensor / GPT-2
# tree: 256/1 0.514 / 0.949 ms, 256/2 0.572 / 1.056, 512/1 0.743 / 1.329, 1024/1 0.718 /
# 1.343); a block's absmax is then one reduction within a warp, and its scale one load.
# Larger 8-bit blocks get one block per program (quant_tile).
QUANT_TILE = knobs.tile("FTOPT_QUANT_TILE", "4096x4" if INTERPRETING else "256x1",
                        "8-bit kernels' tile")
# The most registers a thread of an 8-bit kernel may use (Triton's ``maxnreg``; 0: the
# compiler's choice). These kernels are bound by latency at the occupancy their registers
# allow: H200, GPT-2 8-bit Adam, 256x1 tile (benchmarks/quant_regs_gpu.py), the compiler's
# 96 registers 0.945 ms, 80 0.912, 72 0.876 (14 spills), 64 0.883; with skip_zeros
# ("stores") its 120 registers 1.371 ms, 72 0.983. With FAST_MATH (fewer registers
# live), 64 is fastest (eight_bit_ablation.py, 64M tensor / GPT-2: 56 0.422 / 0.789 ms,
# 64 0.412 / 0.757, 72 0.423 / 0.776, 80 0.446 / 0.810, none 0.483 / 0.800); with the
# "lg2" encoder, GPT-2 64 0.605-0.609 ms, 72 0.627, 80 0.665.
QUANT_MAXNREG = knobs.integer("FTOPT_QUANT_MAXNREG", 64, "8-bit kernels' register cap (0: none)")
# The same for 8-bit kernels with skip_zeros (their "split" body holds the update twice);
# H200, GPT-2, split+select under FAST_MATH, dense / sparse (quant_regs_gpu.py): 64
# 0.839 / 0.678 ms (38 registers spilled; 24 since the skipped update's -0.0 is a
# constant), 72 0.861 / 0.697, 80 0.877 / 0.706, 96 0.934 / 0.764 (none spilled), none
# (142) 1.264 / 1.048. With the "lg2" encoder and the all-finite absmax (two runs): 64
# 0.695 / 0.588-0.591 ms (44 spilled), 72 0.676 / 0.570-0.577 (28), 80 0.723 / 0.614.
QUANT_SKIP_MAXNREG = knobs.integer("FTOPT_QUANT_SKIP_MAXNREG", 72, "with skip_zeros, the same")


# The same for the main kernel of a "split+defer" step (ftopt.lowering.split: it holds
# the plain body alone; its deferred kernel takes QUANT_SKIP_MAXNREG). Static SASS (sm_90,
# 8-bit Adam, benchmarks/sass_count.py): the split kernel's select bodies spill 96 bytes
# at 72 registers; the main kernel without them needs 64 registers and spills nothing
# (on the H200 too, at caps 64 and 72; at 64 it takes 59). H200, GPT-2 8-bit Adam, 64
# against 72, three runs: 90% of the embedding's rows zero 1.249x vs 1.234x, 1.250x vs
# 1.242x, primed 1.251x vs 1.239x; dense +2.3% vs +2.3%, +1.9% vs +2.3%, +1.3% vs +2.0%
# (benchmarks/RESULTS.md, 2026-12-02).
QUANT_DEFER_MAXNREG = knobs.integer("FTOPT_QUANT_DEFER_MAXNREG", 64, "register cap of "
                                    "8-bit \"split+defer\" main kernels")
# A capped kernel spilling more than CAP_SPILLS registers (Triton's n_spills) runs at its
# cap + k * CAP_STEP that fits (to 128, guessed from its spills: launch._fit_cap; step 0:
# none), else uncapped: past their caps ptxas 12.8 miscompiled 8-bit chains (AdEMAMix ->
# Adadelta -> AMSGrad at 64, 174 spilled; AdEMAMix -> stddev -> Lion, split+defer, 64, 44:
# fuzz seed 102). Step 8 vs 0 (H100, GPT-2 8-bit Adam, skip_zeros vs off, one gradient in
# 97 zero): +14.0..14.9% vs +33.6..33.8%; both chains pass at its caps (RESULTS 12-06).
CAP_SPILLS = knobs.integer("FTOPT_CAP_SPILLS", 16, "a capped kernel spilling more "
                           "registers than this compiles at a higher cap or uncapped")
CAP_STEP = knobs.integer("FTOPT_CAP_STEP", 8, "register cap step past spills (0: uncapped)")
# Flags (main programs) a program of the deferred kernel reads at once; where one is set
# it runs their bodies in turn. H200, GPT-2 8-bit Adam, dense / 90% of the embedding's
# rows zero / every block part zero (ms; off 0.607-0.613): 8 0.644 / 0.550 / 1.002, 16
# 0.624 / 0.539 / 1.011, 32 0.613 / 0.523 / 1.031, 64 0.607 / 0.527 / 1.111, 256 0.623-0.628
# / 0.539 / 1.339 (fewer programs, each running more flagged blocks in turn). With the
# flagged programs taken from the loaded flags (split.deferred), 32 / 128: dense +4.1..4.2%
# / +2.6..3.2%, every block part zero without the watch 0.98-1.00 / 1.44-1.45 ms (off
# 0.60).
DEFER_FLAGS = knobs.power_of_two("FTOPT_DEFER_FLAGS", 32, "flags a deferred program reads")
# The deferred kernel's flags a program while the group's last count
# (ftopt.lowering.skip_watch) found fewer than DEFER_FEW_BELOW of its blocks deferred:
# fewer programs where few run a body. 128 for every step measured dense +2.6..3.2%
# above, but is slow where many are flagged, which the count avoids. H200, GPT-2 8-bit
# Adam with the watch, against off, four A/Bs each (32 for every step / 128 while few):
# dense +2.2..4.1% (mean 3.3) / +2.1..3.3% (mean 2.6), 90% of the embedding's rows zero
# 1.19x / 1.20x, every block part zero +12.5..14.8% / +14.4..17.0% (benchmarks/RESULTS.md,
# 2026-12-02). More a program while few are flagged does not shorten it (512 to 2048:
# dense +2.5..4.5%, RESULTS.md 2026-12-02).
DEFER_FLAGS_FEW = knobs.power_of_two("FTOPT_DEFER_FLAGS_FEW", 128, "flags a deferred "
                                     "program reads while few were (FTOPT_DEFER_FEW_BELOW)")
DEFER_FEW_BELOW = knobs.real("FTOPT_DEFER_FEW_BELOW", 0.01, "what fraction deferred is few")
# The deferred kernel reads its flags four to an int32 word (split._deferred_words): a
# program of 128 flags then holds one register of them a thread, not four. H200, GPT-2
# 8-bit Adam with the watch against off (four A/Bs a setting, three runs, 2026-12-02),
# bytes / words: dense +2.7% / +2.0..2.2%, 90% of the embedding's rows zero 1.229x /
# 1.237-1.240x, every block part zero +14.9% (words). More flags a program or 4 or 8
# warps uncapped were no faster (one flagged block's loads, ~5.5 us).
DEFER_WORDS = knobs.switch("FTOPT_DEFER_WORDS", True, "deferred flags four to a word")
# A "split+defer" group runs "split+select" while more than DEFER_SELECT_ABOVE of its
# blocks were deferred when last counted (ftopt.lowering.skip_watch): counted every
# WATCH_PERIOD steps, and every WATCH_PROBE steps while it runs "split+select". H200,
# GPT-2 8-bit Adam, a zero in a fraction f of the blocks (ms; off 0.598-0.611):
# f = 0 / 0.02 / 0.05 / 0.1 / 0.2 / 1: split+defer 0.625-0.629 / 0.640-0.645 /
# 0.654-0.664 / 0.681-0.683 / 0.722-0.724 / 1.011-1.035, split+select 0.642-0.648 /
# 0.645-0.655 / 0.646-0.654 / 0.653-0.662 / 0.664-0.666 / 0.692-0.700 (two rounds).
# The first probe at a step 1 mod WATCH_FIRST_PROBE (its counting kernels compile in a
# loop's first steps).
DEFER_SELECT_ABOVE = knobs.real("FTOPT_DEFER_SELECT_ABOVE", 0.04, "\"split+defer\" runs "
                                "\"split+select\" above this fraction deferred (1: never)")
WATCH_PERIOD = knobs.integer("FTOPT_WATCH_PERIOD", 16, "steps between the skip watch's "
                             "counts", minimum=1)
WATCH_PROBE = knobs.integer("FTOPT_WATCH_PROBE", 64, "the same while a group runs its "
                            "alternate", minimum=1)
WATCH_FIRST_PROBE = knobs.integer("FTOPT_WATCH_FIRST_PROBE", 16, "the skip watch's first "
                                  "probe of a mode, at a step 1 mod this", minimum=1)
# Another "split" group (fp32 and 16-bit layouts: "split+in_place") runs "select" while
# f - SPLIT_ZERO_WEIGHT * z > SPLIT_SELECT_ABOVE, f the fraction of its blocks with some
# zero gradients and z of those with only zeros, counted as above. H200, GPT-2 Adam
# (skipmodes_h200_modes_mixed.json), against no skip_zeros with dense gradients / 90% of
# the embedding's rows zero (z ~ 0.28) / every block part zero (f = 1):
# split+in_place fp32 -0.4% / 1.27x / +7.5%, bf16 params +1.5% / 1.30x / +11.5%, bf16
# states +3.3% / 1.17x / +13.6%, stochastic rounding +6.9% / 1.15x / +17.6%; select
# +1.1% / +2.4% / +2.9%, +3.8% / +3.8% / +4.0%, +1.8% / +1.9% / +2.5%, +8.1% / +8.2% /
# +8.1%: select costs split+in_place ~0.1 f - 0.75 z + ~0.02 less (the weight 7.5 and
# threshold 0.2).
WATCH = knobs.switch("FTOPT_SKIP_WATCH", True, "the skip watch (0: every \"split\" "
                     "group keeps its mode and counts nothing)")
SPLIT_SELECT_ABOVE = knobs.real("FTOPT_SPLIT_SELECT_ABOVE", 0.2, "a \"split\" group runs "
                                "select while f - weight * z > this (blocks: f some zero, z all)")
SPLIT_ZERO_WEIGHT = knobs.real("FTOPT_SPLIT_ZERO_WEIGHT", 7.5, "z's weight in that")
# 16-bit states rounded to nearest run select unless ~1% of the blocks are all zero: dense,
# against none, it beats split+in_place (H200 +5.5% vs +8.7%; H100 in a loop -0.9% vs
# +3.3% (256x1, uncapped, its best) and split+defer +3.5%: RESULTS 12-04, 12-06).
# Stochastic rounding keeps SPLIT_SELECT_ABOVE (select +8.1% against +6.9%).
SPLIT_SELECT_ABOVE_STATES = knobs.real("FTOPT_SPLIT_SELECT_ABOVE_STATES", -0.08, "FTOPT_SPLIT_"
                                       "SELECT_ABOVE of 16-bit states rounded to nearest")
# A "split" group of these layouts whose programs hold one block (not in SPANS) runs
# programs of that many blocks (its spanned alternate) while more than SPAN_ABOVE of its
# blocks were all zero when last counted: an all-zero stretch then waits on memory once
# per that many blocks, and the blocks with gradients pay the span loop's registers.
# H200, GPT-2 Adam, a fraction of the rows of every matrix zero (benchmarks/
# span_cross_gpu.py), span 1 / span 4 against no skip_zeros, by z (the fraction of
# blocks all zero): bf16 states z 0 0.968x / 0.904x, 0.26 1.193x / 1.114x, 0.44 1.407x /
# 1.341x, 0.88 2.20x / 2.96x; stochastic rounding 0.44 1.334x / 1.265x, 0.88 2.34x /
# 3.28x; 8-bit 0.30 1.134x / 1.079x, 0.50 1.298x / 1.302x, 0.90 1.81x / 2.49x: they
# cross at z ~ 0.55 and ~ 0.5.
SPAN_ALTERNATES = knobs.per_layout("FTOPT_SPAN_ALTERNATE", "16-bit states=4,8-bit=4",
                                   "the span of a \"split\" group's spanned alternate", True)
SPAN_ABOVE = knobs.real("FTOPT_SPAN_ABOVE", 0.6, "a group runs its spanned alternate "
                        "above this fraction of blocks all zero")
# Below that, the leaves of such a group that are each over SPAN_ABOVE all zero (an
# embedding's unused rows) run in a spanned group of their own, the others as before
# (two launches), where those leaves hold at least CARVE_MIN_BLOCKS all-zero blocks (what
# saves more than the second launch costs: ~0.35 ns an all-zero block, H200).
# H200, GPT-2 Adam with 90% of the embedding's rows zero, by the profiler's kernel times
# (benchmarks/leaf_split_gpu.py): bf16 states 1.171x -> 1.207x, 8-bit 1.126x -> 1.179x
# against no skip_zeros.
CARVE_MIN_BLOCKS = knobs.integer("FTOPT_CARVE_MIN_BLOCKS", 16384, "all-zero blocks of "
                                 "mostly-zero leaves that make a carve")
# Blocks a program of a carved group runs, per layout (else its SPAN_ALTERNATES span).
# H200, GPT-2's embedding alone, 90% of its rows zero, kernel time (us; leaf_split_gpu.py,
# its blocks of one leaf: split.spanned), span 2 / 4 / 8: bf16 states 52 / 48 / 61,
# stochastic rounding 67 / 61 / 74, 8-bit 64 / 71 / 84.
CARVE_SPANS = knobs.per_layout("FTOPT_CARVE_SPAN", "8-bit=2", "blocks a program of a carve", True)
# Warps a program of a carved group runs, per layout (none: the layout's tile). An 8-bit
# program of one warp holds a span's gradients in its registers for the zero check (64 a
# thread at span 8), which slowed spans over 2 (above); with more warps a thread holds
# fewer, but the body runs slower for the blocks with gradients. H200, GPT-2 8-bit Adam,
# 90% of the embedding's rows zero, against off, two rounds (benchmarks/carve_sweep_gpu.py,
# 2026-12-02), warps 1 (the tile) / 2 / 4 / 8: span 2 1.226x / 1.174x / 1.144x / 0.963x,
# span 4 1.226x / 1.198x / 1.168x / 1.032x, span 8 1.19x / 1.19x / 1.18x / 1.04x.
CARVE_WARPS = knobs.per_layout("FTOPT_CARVE_WARPS", "", "warps a program of a carved "
                               "group (none: the layout's tile)", powers=True)
# Programs a multiprocessor of a carve's spanned group, per layout (none: a program a
# span): each then loops over spans (split.spanned's ``looped``). Launched first, its few
# programs stay resident beside the other leaves' kernel, which fills the rest of each
# multiprocessor, and read the mostly-zero leaves with what memory bandwidth that kernel
# leaves over; a program a span instead fills the device before the others' kernel
# starts. On an H200 none is left over: GPT-2 8-bit Adam, 90% of the embedding's rows
# zero, against off (benchmarks/carve_sweep_gpu.py, two rounds, 2026-12-02), none / 1 / 2
# / 4 / 8 a multiprocessor: span 2 1.221x / 0.650x / 0.988x / 1.221x / 1.218x, span 4
# 1.211x / 0.654x / 0.980x / 1.193x / 1.195x; bf16 states, span 4, none / 2 / 4: 1.241x
# / 0.996x / 1.129x. At 2 the others' kernel runs 467 us instead of 411 beside a spanned
# kernel of 581 us: the two share ~3.3 TB/s, as each alone runs (step_timeline_gpu.py).
CARVE_PROGRAMS = knobs.per_layout("FTOPT_CARVE_PROGRAMS", "", "programs a "
                                  "multiprocessor of a carve (none: a program a span)")


def split_select_above(traced, kind: str) -> float:
    """The threshold of a "split" group's watch (ftopt.lowering.skip_watch) of this
    layout (``kind``: :func:`layout`) and chain."""
    if kind == "16-bit states" and not indexed(traced):
        return SPLIT_SELECT_ABOVE_STATES
    return SPLIT_SELECT_ABOVE


def skip_maxnreg(traced, kind: str, elem_bytes: int = 4) -> int | None:
    """The register cap of ``traced``'s kernels of the fp32 and 16-bit layouts (``kind``:
    :func:`layout`; ``elem_bytes``: as :func:`tile`'s): IN_PLACE_MAXNREG's in place,
    half_tiles' where it sets a tile, SELECT_MAXNREG's for a skip_zeros chain that selects
    and reads no element index (None: the compiler's choice)."""
    if traced.in_place:
        return IN_PLACE_MAXNREG.get(kind)
    if indexed(traced):
        return None
    if half_kernel(traced, elem_bytes) and (half := half_tiles.tile(traced, kind)):
        return half[2] or None
    return SELECT_MAXNREG.get(kind) if any(traced.skips) else None


def half_kernel(traced, elem_bytes: int, indexed_too: bool = False) -> bool:
    """Whether ``traced``'s main kernel over params and gradients ``elem_bytes`` wide takes
    half_tiles' settings: 16-bit, not in place, no norms, no element index (but where
    ``indexed_too``)."""
    return elem_bytes == 2 and not (traced.in_place or traced.levels
                                    or (indexed(traced) and not indexed_too))


def quant_maxnreg(traced, defer: int = 0) -> int:
    """The register cap of ``traced``'s 8-bit kernels (0: the compiler's choice);
    ``defer``: 1 for the main kernel of a "split+defer" step."""
    if defer == 1:
        return QUANT_DEFER_MAXNREG
    return QUANT_SKIP_MAXNREG if any(traced.skips) else QUANT_MAXNREG


# The main kernels' programs take their blocks in runs of INTERLEAVE consecutive blocks,
# the runs in a low-discrepancy order (ftopt.lowering.work.interleaved; 0: in order, the
# default). GPUs start programs roughly in launch order, so in order a stretch of blocks
# whose gradients are all zero (an embedding's unused rows under skip_zeros) runs alone:
# programs that load their gradients and return, each a chain of dependent loads, the
# memory bus mostly idle (H200, GPT-2 Adam, every gradient zero: 1.9-3.5x the time of
# reading them). Interleaved block by block they hid under the other blocks' transfers,
# but the dense step lost as much (fp32 +4%: benchmarks/RESULTS.md). Runs of 4 to 256
# blocks lost too (fp32 dense +4.7-6.6%, sparse no faster).
INTERLEAVE = knobs.integer("FTOPT_INTERLEAVE", 0, "interleave all-zero leaves' blocks "
                           "with the others' (0: no)")


# Kernels with per-program work beyond their elements (norms' partial sums, per-leaf ratios:
# LARS, LAMB, NovoGrad, Fromage, Prodigy; noise keys): twice the elements halve it (H200,
# GPT-2 fp32: Fromage 0.676 -> 0.601 ms, noisy_sgd 0.418 -> 0.367; 1024x8, 256x2 no faster
# than 512x4). The interpreter's, as a GPU's, twice the block (8-bit norms' own table).
HEAVY_TILE = knobs.tile("FTOPT_HEAVY_TILE", f"{2 * BLOCK}x{NUM_WARPS}" if INTERPRETING else
                        f"{BLOCK}x{NUM_WARPS}" if "FTOPT_BLOCK" in os.environ else "1024x4",
                        "the tile of kernels with per-program work (norms, noise keys)")


def tile(traced, quant_block: int = 0, kind: str = "", elem_bytes: int = 4) -> tuple[int, int]:
    """(elements, warps) per program of ``traced``'s kernels (``quant_block``: the
    group's 8-bit block size, 0 for fp32 slots; ``kind``: the group's :func:`layout`;
    ``elem_bytes``: the larger element size of its params and gradients)."""
    if quant_block:
        return quant_tile(quant_block)
    if traced.in_place:
        return IN_PLACE_TILES.get(kind, IN_PLACE_TILE)
    if traced.levels or indexed(traced):
        return HEAVY_TILE
    if half_kernel(traced, elem_bytes) and (half := half_tiles.tile(traced, kind)):
        return half[:2]
    return BLOCK, NUM_WARPS


def indexed(traced) -> bool:
    """A stage's rule reads the element's index (noise keys)."""
    return any(getattr(st, "rule", None) is not None and st.rule.indexed
               for st in traced.stages)


def quant_tile(quant_block: int) -> tuple[int, int]:
    """(elements, warps) per program of a kernel with 8-bit slots of ``quant_block``
    elements per absmax: :data:`QUANT_TILE`, or one block per program (warps scaled up to
    8) for blocks larger than its tile. A block size that divides neither cannot fuse
    (:func:`ftopt.lowering.plan.slot_reason`)."""
    block, warps = QUANT_TILE
    if quant_block > block and quant_block % block == 0:
        return quant_block, min(8, warps * (quant_block // block))
    return block, warps


# How a donated step of a skip_zeros chain skips zero gradients, per layout of a group
# ("fp32", "16-bit": 16-bit params or states, "8-bit"): "in_place" (loads and stores
# masked by g != 0: zero lanes move no bytes, but the masked loads are not vectorized),
# "tiles" (a program whose gradients are all zero returns at once; other lanes keep their
# old values by selects), "in_place+tiles", "select" (selects only), or "stores" (selects,
# and a program whose gradients are all zero writes nothing: its loads are not delayed,
# and 8-bit blocks of one program need no select of their old codes and absmax), also
# "in_place+stores", or "chunks" (the tile is rows of CHUNK_LANES elements, a warp's
# vectorized loads: a row whose gradients are all zero is neither loaded nor stored,
# the zero lanes of other rows keep their old values by selects; plain elementwise chains
# only, the others select). 8-bit blocks need every lane, so neither "in_place" nor
# "chunks" applies to them.
# FTOPT_SKIP_MODES overrides ("fp32=tiles,16-bit=select"). H200, GPT-2 Adam, skip_zeros
# against no skip_zeros with dense gradients / with 90% of the embedding's rows zero
# (benchmarks/RESULTS.md):
#   fp32:        in_place +2.0% / -11.7%, in_place+tiles +3.8% / -16.9%, tiles +7.0% /
#                -12.0%, select +2.4% / +4.0%
#   bf16 params: in_place +9.7% / -3.3%, in_place+tiles +11.7% / -10.8%, select +6.6% /
#                +7.1%; bf16 states: in_place +39.9% / +27.5%, tiles +33.7% / +9.8%,
#                select +11.2% / +14.3%
#   8-bit:       tiles +90.6% / +41.9%, select +38.3% / +36.0%
#   "stores" (benchmarks/quant_regs_gpu.py, skip_modes_gpu.py): fp32 +1.3% / -10.9%,
#   bf16 params +7.6% / -6.1%, bf16 states +21.5% / +3.1%; 8-bit at 72 registers
#   +12.2% / -19.3% (select +28.3% / +22.8%).
#   "chunks" (skipmodes_h200_chunks*.json, same run as in_place +1.9% / -12.2%, stores
#   +7.8% / -6.6%, select +12.6% / +13.0% for bf16 states): fp32 +4.7% / -6.8%, bf16
#   params +12.5% / +3.3%, bf16 states +25.7% / +19.0%; with FAST_MATH, bf16 params
#   +5.1% / -11.3% (in_place +8.0% / -11.7%, stores +7.3% / -3.9%, select +1.7% / +1.6%)
#   and bf16 states +11.0% / +2.0% (select +6.3% / +7.3%); rows of 256 lanes lose more.
#   "split+MODE" (skipmodes_h200_split.json; with FAST_MATH for 16-bit states): a program
#   with no zero gradient runs the body with the skip masks constant, so its selects and
#   load masks fold away; one with some runs MODE; one with only zeros returns after
#   loading its gradients. fp32 split+in_place +2.3% / -18.5% (in_place +2.3% / -12.0%),
#   bf16 params split+in_place +0.8% / -20.3% (stores +6.7% / -6.5%), bf16 states
#   split+in_place +2.1% / -15.0% (select +7.9% / +8.2%), 8-bit split+select -0.5% /
#   -24.4% (stores +3.6% / -21.1%); split+select and split+stores lose elsewhere.
#   "split+defer" (ftopt.lowering.split; benchmarks/RESULTS.md, 2026-12-01 afternoon):
#   as "split", but a program with some zero gradients (and a tail program) only flags
#   itself, and a second launch runs the flagged ones with the select body, so the main
#   kernel holds the plain body alone. 8-bit, GPT-2 Adam, against off (profiled, 0.601-
#   0.613 ms): dense 0.613-0.621 (+0-3%; split+select 0.648-0.650, +7.5%), 90% of the
#   embedding's rows zero 0.523-0.535 (1.14-1.17x; split+select 0.549-0.564), but every
#   block part zero (one gradient in 97) 1.01-1.03 ms (split+select 0.689): pruned
#   weights with scattered zeros may want "8-bit=split+select".
# "16-bit" covers 16-bit params with fp32 states; "16-bit states" any 16-bit state slot.
# A "chunks" row: 32 threads of 4 elements (16-byte fp32 loads).
CHUNK_LANES = knobs.power_of_two("FTOPT_CHUNK_LANES", 128, "lanes of a \"chunks\" row")
SKIP_MODES = {"fp32": "split+in_place", "16-bit": "split+in_place",
              "16-bit states": "split+in_place", "8-bit": "split+defer"}
SKIP_MODES.update(knobs.skip_modes("FTOPT_SKIP_MODES", "", "skip_zeros' mode per layout"))


# Layouts whose main kernels take square roots and quotients with the GPU's approximate
# instructions (within 1-2 fp32 ulps, as SPEC's tolerance allows) in place of correctly
# rounded ones, whose refinement steps and special-case branches make up most of a 16-bit
# kernel's instructions (static SASS, sm_90, Adam with bf16 states: 824 -> 493). By
# default "16-bit states" (H200, GPT-2 Adam, bf16 params and states: 0.469 -> 0.454 ms,
# 0.87 -> 0.90 of copy; stochastic rounding 0.744 -> 0.633), whose stored values round
# to 8 bits of mantissa anyway; bf16 params with fp32 states gain nothing (0.678 ->
# 0.677). "8-bit" (a default too) approximates the update's math only: the encoder's
# division by the block's absmax stays correctly rounded, so a state computed without
# sqrt or division (Adam's) gets eager's codes (static SASS of 8-bit Adam, sm_90: 3039 ->
# 2686 instructions, 198 -> 42 of them control; H200, 64M tensor 0.464 -> 0.420 ms,
# GPT-2 0.842 -> 0.761, with skip_zeros 0.851 -> 0.857: its kernels gained nothing, and
# 0.816 since their 8-bit loads come before the zero check; the fuzz at these defaults,
# seeds 24 and 25: 6,778 examples, no failure).
FAST_MATH = knobs.layout_set("FTOPT_FAST_MATH", "16-bit states,8-bit", "layouts whose "
                             "kernels take approximate sqrt and division")


def layout(p_dtype, quant_block: int, slot_dtypes: tuple) -> str:
    """The layout of a kernel group: "8-bit", "16-bit states", "16-bit" or "fp32"."""
    if quant_block:
        return "8-bit"
    if slot_dtypes:
        return "16-bit states"
    return "16-bit" if p_dtype.itemsize == 2 else "fp32"


def skip_mode(p_dtype, quant_block: int,
              slot_dtypes: tuple) -> tuple[bool, bool, bool, bool, bool, bool]:
    """(in place, skip tiles, skip stores, chunks, split, defer) for a donated skip_zeros
    group of this layout."""
    mode = SKIP_MODES[layout(p_dtype, quant_block, slot_dtypes)]
    in_place = "in_place" in mode and not quant_block
    return (in_place, "tiles" in mode, "stores" in mode,
            "chunks" in mode and not quant_block, "split" in mode,
            "split" in mode and "defer" in mode and not in_place)


def may_return_early(traced) -> bool:
    """Whether a program of ``traced``'s main kernel may skip its body or part of it
    ("tiles", "split"): not where it may be the one that stores a per-leaf slot (the
    leaf's first program) or a running scalar (program 0)."""
    return not (traced.leaf_slots or traced.running_stores)


def chunk_lanes(traced) -> int:
    """Lanes of the rows of ``traced``'s "chunks" kernel; 0 where it keeps the select
    mode: norms, per-leaf or running values, flags, seeded segments and indexed rules
    (whose code is not only per element), or a tile that does not split into rows of
    :data:`CHUNK_LANES`."""
    if (traced.in_place or traced.levels or traced.leaf_slots or traced.running_stores
            or traced.slot_flags or traced.seeded or indexed(traced)):
        return 0
    block = tile(traced)[0]
    return CHUNK_LANES if block % CHUNK_LANES == 0 and block >= CHUNK_LANES else 0


def fast_math(p_dtype, quant_block: int, slot_dtypes: tuple) -> bool:
    """Whether this layout's main kernel uses approximate sqrt and division
    (:data:`FAST_MATH`)."""
    kind = layout(p_dtype, quant_block, slot_dtypes)
    return kind in FAST_MATH

