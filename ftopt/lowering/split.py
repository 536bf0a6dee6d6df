"""The main kernels of "split" skip_zeros steps (:data:`ftopt.lowering.tiles.SKIP_MODES`).

A donated step of a skip_zeros chain whose all-zero programs may write nothing: a program
with no zero gradient runs the plain body (the skip masks constant, so its selects fold
away), one with only zeros writes nothing, and one with some zeros either runs the
select body in the same kernel ("split") or is deferred ("split+defer"): it stores a flag,
and a second launch of the same chain runs only the flagged programs, with the select
body. The main kernel then holds the plain body alone, and needs the registers of the
kernel without skip_zeros (an 8-bit select body needs more: the two bodies in one kernel
spill, or run at fewer warps a multiprocessor). Tail programs (a leaf's last, partial
block) are always deferred.

The deferred kernel is the chain's main kernel in a loop: program ``k`` reads the flags
of programs ``k * DEFER_FLAGS`` to ``(k + 1) * DEFER_FLAGS - 1`` at once and returns
where none is 1 (the common case: a flag byte a main program, read four to a word here:
:data:`tiles.DEFER_WORDS`), else runs each flagged program's body in turn. The flags
need no reset: every main program writes its own, each step (0: no zero gradient, 1:
some, or a tail, 2: only zeros, which :mod:`ftopt.lowering.skip_watch` counts).

On an H200 (GPT-2 8-bit Adam, dense gradients) this kernel, 3,800 programs of 128 flags
of which 18 are set (exact zeros among the benchmark's random gradients), takes 7.2-7.9
us after its main kernel, at 4, 2 or 1 warps alike. Re-run alone (the carve's other
leaves, 2,616 programs, 13 set): 4.0-5.6 us; at one program 0.9; a kernel that only
reads the flags, 2.4; with no flag set (1,178 programs) 1.7-2.2. So it costs its
programs' start and one flagged block's chain of dependent loads (flags, work table,
addresses, the block's data); fewer programs of more flags, or the body in more warps
without spills, do not shorten it in the step (``benchmarks/RESULTS.md``). Measured and
not taken: a queue of the deferred programs' numbers (an atomic count in the main
kernel; 528 programs reading it) took 6.5 us but the main kernel ~4 us more, and 3.8 ms
a step where every block was deferred (485k atomic adds on one count); marks of the
flagged runs (a byte a run of 128, read 32 a program) 16.6 us, the main kernel 23 us
more (that version also failed its tests on the GPU, not diagnosed:
benchmarks/RESULTS.md). Nor, 2026-12-02: the select body in the main kernel for full
blocks and only the tails deferred (the compiler merges the two bodies' encoders: 67
registers; at the cap of 72 fewer programs a multiprocessor, dense +7.0%; at 64, 8 bytes
spilled, dense +3.6% against +2.3%, 90% of the embedding's rows zero 1.252x against
1.242-1.250x); the parameter's load before the check (dense +4.7% against +2.5%); the
deferred kernel in 4 warps; the carve's spanned kernel checking only (its live blocks all
deferred: 1.11-1.17x against 1.24x).

A layout of :data:`tiles.SPANS` runs several consecutive blocks a main program
(:func:`spanned`): the program checks all their gradients with one wait on memory and
ends where every one is zero (their flags 2), else runs each block as a
program of one block would. Flags, work tables and the deferred kernel stay per block.
"""

from __future__ import annotations

from ftopt.lowering import quantized, tiles

# In a program without zero gradients, the skip masks as constants: the compiler folds
# the selects of old values (and the masks of in-place loads and stores) away.
_NO_ZEROS = {"zero = g == 0.0": "zero = tl.full([BLOCK], 0, tl.int1)",
             "keep = g != 0.0": "keep = tl.full([BLOCK], 1, tl.int1)"}

# The main kernel's flag of a program the deferred kernel runs (1), of one with only
# zeros (2), of one without (0).
_FLAG = "tl.store(flags_ptr + pid, ({}).to(tl.uint8))"
_DEFER_FLAG = "(live_lanes < BLOCK).to(tl.uint8) + (live_lanes == 0).to(tl.uint8)"
# The flag of a "split" program that counts (1: some zero gradients, 2: all zero).
_COUNT = "tl.store(flags_ptr + pid, tl.full([], {}, tl.uint8))"


def _indent(lines: list[str], depth: int = 1) -> list[str]:
    return ["    " * depth + x for x in lines]


def split_on_zeros(body: list[str], dense: list[str], defer: bool = False,
                   count: bool = False) -> list[str]:
    """A full block's code of a "split" kernel: after the gradient's load, ``dense`` (the
    same body with the skip masks constant, no gating of stores) where every gradient is
    non-zero, ``body`` where some are (``defer``: a flag 1 for the deferred kernel in its
    place), nothing where all are zero (``count``, or ``defer``: flags 1 where some are,
    2 where all are, for :mod:`ftopt.lowering.skip_watch`; ``defer``: 0 where none
    is).

    8-bit slots are loaded and decoded before the check (:func:`quantized.hoisted`): a
    program would otherwise wait for its gradients before it starts the loads its math
    needs first, two trips to memory in a row (H200, GPT-2 8-bit Adam with skip_zeros:
    0.843 -> 0.832 ms; without skip_zeros 0.767); an all-zero program then reads its codes
    too (1 byte an element each)."""
    at = next(i for i, line in enumerate(body) if line.startswith("g = "))
    assert dense[:at + 1] == body[:at + 1]
    early, rest = quantized.hoisted(body[at + 1:])
    early_dense, dense = quantized.hoisted([_NO_ZEROS.get(x, x) for x in dense[at + 1:]])
    assert early == early_dense
    head = body[:at + 1] + early + ["live_lanes = tl.sum((g != 0.0).to(tl.int32))"]
    if defer:
        return (head + [_FLAG.format(_DEFER_FLAG),
                        "if live_lanes == BLOCK:"] + _indent(dense))
    return (head + ["if live_lanes == BLOCK:"] + _indent(dense)
            + ["elif live_lanes > 0:"] + _indent([_COUNT.format(1)] * count + rest)
            + ["else:", "    " + _COUNT.format(2)] * count)


def deferred_tail() -> list[str]:
    """A tail program's code in the main kernel of a "split+defer" step: its flag."""
    return [_FLAG.format("tl.full([], 1, tl.int1)")]


def full_or_tail(full: list[str], tail: list[str]) -> list[str]:
    """A program's code of one block: its ``full`` block's, or its leaf's partial last
    block's (``tail``)."""
    return (["if start + BLOCK <= n:"] + _indent(full)
            + ["else:", "    in_range = offs < n"] + _indent(tail))


def deferred_blocks(full: list[str], tail: list[str]) -> list[str]:
    """The deferred kernel's full and tail blocks: two ``if``s, not one with an ``else``
    (in a loop, Triton would carry the names both define out of the ``if``, and a one-block
    program's absmax is a scalar where a tail's is a tensor)."""
    return (["if start + BLOCK <= n:"] + _indent(full)
            + ["if start + BLOCK > n:", "    in_range = offs < n"] + _indent(tail))


def deferred(prelude: list[str], body: list[str], flags: int) -> list[str]:
    """The deferred kernel's code: ``prelude`` (the main kernel's, from its ``pid``) and
    ``body`` (its select body of full and tail blocks) for each flagged program of this
    program's run of ``flags`` (:data:`tiles.DEFER_FLAGS`, or
    :data:`tiles.DEFER_FLAGS_FEW` while few are flagged)."""
    assert prelude[0] == "pid = tl.program_id(0)"
    if tiles.DEFER_WORDS and flags >= 4:
        return _deferred_words(prelude, body, flags)
    following = f"at = tl.min(tl.where(todo, tl.arange(0, {flags}), {flags}))"
    # The flagged programs are taken from the flags in registers, one after another: a
    # load of each flag in turn made a program with a flag wait on memory DEFER_FLAGS
    # times (H200, GPT-2 8-bit Adam, dense gradients, this kernel's time at 32 / 64 / 128
    # flags: 13.8 / 11.8 / 14.4 us -> 11.8 / 9.6 / 7.9; every gradient zero, no flag 1:
    # 10.5 / 5.9 / 3.5 both).
    return ([f"first = tl.program_id(0) * {flags}",
             f"todo = tl.load(flags_ptr + first + tl.arange(0, {flags})) == 1",
             following,
             f"while at < {flags}:",
             "    pid = first + at"]
            + _indent(prelude[1:] + body)
            + [f"    todo = todo & (tl.arange(0, {flags}) != at)", "    " + following])


def _deferred_words(prelude: list[str], body: list[str], flags: int) -> list[str]:
    """:func:`deferred`'s code with the flags read four to an int32 word
    (:data:`tiles.DEFER_WORDS`): a flag 1 has its low bit set, 0 and 2 do not, so a word
    holds one where it has a bit of ``0x01010101`` (its byte ``k`` the flag of program
    ``4 * word + k``, little-endian); a thread holds a quarter of the registers."""
    words = flags // 4
    assert words * 4 == flags
    index = f"tl.arange(0, {words})"
    following = f"at = tl.min(tl.where(marks != 0, {index}, {words}))"
    # (the pointer's alignment restated after the cast: the loads then vectorize; the
    # loop under an ``if``: what its body precomputes, a program with no flag skips)
    loop = ([following,
             f"while at < {words}:",
             f"    word = tl.sum(tl.where({index} == at, marks, 0))",
             "    for k in range(4):",
             "        if ((word >> (8 * k)) & 1) != 0:",
             "            pid = first + at * 4 + k"]
            + _indent(prelude[1:] + body, 3)
            + [f"    marks = tl.where({index} == at, 0, marks)", "    " + following])
    return ([f"first = tl.program_id(0) * {flags}",
             "marks = tl.load(tl.multiple_of(flags_ptr.to(tl.pointer_type(tl.int32)), 16)"
             f" + tl.program_id(0) * {words} + {index}) & 0x01010101",
             "if tl.max(marks, 0) != 0:"] + _indent(loop))


def flag_count(num_blocks: int) -> int:
    """Bytes of a group's flags: one per main program, in whole runs of
    :data:`tiles.DEFER_FLAGS` and of :data:`tiles.DEFER_FLAGS_FEW` (the padding stays
    zero)."""
    run = max(tiles.DEFER_FLAGS, tiles.DEFER_FLAGS_FEW)
    return -(-num_blocks // run) * run


def spanned(prelude: list[str], full: list[str], tail: list[str], span: int,
            g_dtype: str, zero_flag: int | None = None, one_leaf: bool = False,
            looped: int = 0) -> list[str]:
    """The code of a "split" main kernel whose program runs ``span`` consecutive blocks
    of its work table (:data:`tiles.SPANS`; the table padded with empty blocks to whole
    spans: :func:`ftopt.lowering.work.work_table`): the gradients of all of them are
    loaded at once, and the program ends where every one is zero (after setting its
    blocks' flags to ``zero_flag``, where given: 2 in a "split+defer" main kernel and in
    one that counts them); else each block in turn
    runs as the program of one block would (``prelude``, the main kernel's from its
    ``pid``, then its full or tail block; its gradients again, from the cache).

    An all-zero program waits on the same chain of dependent loads (work table, addresses,
    gradients) for ``span`` times the bytes; where the group's blocks are one leaf's in
    order (``one_leaf``) on one load less, their starts computed (H200, GPT-2's embedding
    with 90% of its rows zero alone, span 4: bf16 states 54 -> 48 us, stochastic rounding
    69 -> 61, 8-bit 71 -> 71). Each block loads its own addresses in the
    loop (from the cache): a span may cross leaves. The loop itself costs registers
    (static SASS, sm_90, Adam with bf16 states: 32 a thread without it, 40 with it, with
    the addresses loaded in it or before it alike). Two ``if``s in the loop, as in
    :func:`deferred_blocks`.

    ``looped``: the kernel's spans, over which each program loops (from its own, one in
    every grid's length: a persistent kernel of fewer programs than spans,
    :data:`tiles.CARVE_PROGRAMS`); else a program runs one."""
    assert prelude[0] == "pid = tl.program_id(0)" and prelude[1].startswith("leaf = ")
    if one_leaf:
        locate = ["span_offs = (span_blocks.to(tl.int64)[:, None] * BLOCK"
                  " + tl.arange(0, BLOCK)[None, :])",
                  f"span_g = tl.load(g_addr_ptr).to(tl.pointer_type({g_dtype})) + span_offs",
                  "span_n = tl.load(numel_ptr)"]
    else:
        locate = ["span_leaf = tl.load(block_leaf_ptr + span_blocks)",
                  "span_offs = (tl.load(block_start_ptr + span_blocks)[:, None]"
                  " + tl.arange(0, BLOCK)[None, :])",
                  "span_g = tl.load(g_addr_ptr + span_leaf).to(tl.pointer_type("
                  f"{g_dtype}))[:, None] + span_offs",
                  "span_n = tl.load(numel_ptr + span_leaf)[:, None]"]
    code = ([f"span_blocks = span_at * {span} + tl.arange(0, {span})"] + locate
            + ["span_live = (tl.load(span_g, mask=span_offs < span_n, other=0.0)"
               ".to(tl.float32) != 0.0).to(tl.int32)",  # (-0.0 too, interpreted)
               "if tl.max(tl.max(span_live, 1), 0) > 0:",
               f"    for sub in range({span}):",
               f"        pid = span_at * {span} + sub"]
            + _indent(prelude[1:], 2)
            + ["        if start + BLOCK <= n:"] + _indent(full, 3)
            + ["        if (start + BLOCK > n) & (start < n):",
               "            in_range = offs < n"] + _indent(tail, 3)
            + ["else:", f"    tl.store(flags_ptr + span_blocks, "
               f"tl.full([{span}], {zero_flag or 0}, tl.uint8))"] * (zero_flag is not None))
    if looped:
        return ([f"for span_at in range(tl.program_id(0), {looped}, tl.num_programs(0)):"]
                + _indent(code))
    return ["span_at = tl.program_id(0)"] + code
