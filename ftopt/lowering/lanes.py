"""Which lanes a generated kernel loads and stores: the masks of full and tail blocks,
of in-place steps (zero-gradient lanes untouched) and of slots a per-leaf flag turns
off; the 16-bit stores (bf16 rounded as torch rounds, a NaN's bits kept); the
approximate math of fast-math layouts."""

from __future__ import annotations

import re

import torch

from ftopt.lowering import knobs, tiles, word_selects

__all__ = ["masks", "flag_mask", "load_mask", "bf16_store_lines", "bf16_convert", "nan_from_word",
           "half_load_lines", "half_value", "rows", "with_live_rows", "fast_math", "FAST_SQRT",
           "volatile_loads"]


def flag_mask(traced, flag: str, load: bool) -> str:
    """The load (or store) mask of a slot whose leaves a per-leaf ``flag`` may leave out:
    lanes below the leaf's size where the flag is on, below 0 where it is off (in full
    blocks too; the tail's ``in_range`` is implied)."""
    conds = [f"(offs < tl.where({flag}, n, 0))"] + (["keep"] if traced.in_place else [])
    return f", mask={' & '.join(conds)}" + (", other=0.0" if load else "")


def load_mask(traced, masks: dict, tail: bool, role: str) -> str:
    flag = traced.slot_flags.get(role)
    return masks["LMASK"] if flag is None else flag_mask(traced, flag, True)


def masks(traced, tail: bool, chunks: bool = False) -> dict[str, str]:
    """Load and store masks of the full-block and the tail-block code (``chunks``: the
    rows of a "chunks" kernel, :func:`with_live_rows`)."""
    keep = " & keep" if traced.in_place else ""
    if chunks:
        both = "in_range & live" if tail else "live"
        return {"GMASK": ", mask=in_range, other=0.0" if tail else "",
                "LMASK": f", mask={both}, other=0.0", "SMASK": f", mask={both}"}
    if tail:
        return {"GMASK": ", mask=in_range, other=0.0",
                "LMASK": f", mask=in_range{keep}, other=0.0",
                "SMASK": f", mask=in_range{keep}"}
    if traced.in_place:
        return {"GMASK": "", "LMASK": ", mask=keep, other=0.0", "SMASK": ", mask=keep"}
    return {"GMASK": "", "LMASK": "", "SMASK": ""}


# A bf16 state's store rounds by the conversion instruction (an H200's converts two
# values) where kernels compile for a device, by integer operations under the
# interpreter, whose cast truncates. Both round to nearest even; a NaN is written by a
# select either way. The integer lines cost ~6 instructions a value: static SASS, sm_90,
# Adam with bf16 states 546 -> 494 instructions a thread, with skip_zeros' select body
# 600 -> 545. As fast between the step's own launches with dense gradients (H200, GPT-2:
# 0.465 ms, 0.469 with the instruction), but a loop's step runs at the lower clock of a
# device at its power limit, where these kernels are bound by their instructions: the
# watch against no skip_zeros, dense / 90% of the embedding's rows zero, between
# launches +3.7% / 1.252x -> +1.3% / 1.276x, in a loop's position (skip_in_loop_gpu.py)
# +6.8% / 1.200x -> +2.4% / 1.258x (benchmarks/RESULTS.md, 2026-12-04); stochastic
# rounding: :func:`bf16_convert`.
BF16_CONVERT = knobs.switch("FTOPT_BF16_CONVERT", not tiles.INTERPRETING, "fp32 -> bf16 "
                            "by the GPU's instruction (0: by integer operations)")


def bf16_convert(traced) -> bool:
    """Whether the bf16 stores of this chain's kernels take the conversion instruction.
    Stochastic rounding (a rule that reads the element's index) stores values that are
    bf16 values already, whose low 16 bits the integer lines' compiler knows are zero:
    without skip_zeros it folds them into a shift, and the instruction is slower (H200,
    GPT-2 Adam, bf16 states rounded stochastically, no skip_zeros: 0.652-0.660 ms,
    0.716-0.721 with the instruction); its skip_zeros kernels are faster with it
    (0.723-0.732 ms against 0.751-0.759). The watch against no skip_zeros, dense, then
    +10.9% between launches and +9.7% in a loop's position (+15.7% and +12.9% with the
    integer lines in both kernels)."""
    return BF16_CONVERT and (any(traced.skips) or not tiles.indexed(traced))


def nan_from_word(traced) -> bool:
    """Whether a bf16 store takes a NaN's old bits from the slot's loaded 16-bit word
    rather than from its widened fp32 value, which then need not stay in registers to the
    store: Adam with bf16 states and no skip_zeros 48 -> 40 registers a thread, H200
    GPT-2 0.486 -> 0.461-0.466 ms. Kernels with skip_zeros keep the fp32 value (their
    selects read it anyway; 0.490 ms either way), and so do stochastic rounding's (0.647
    -> 1.01 ms with the word) (benchmarks/RESULTS.md, 2026-12-04 12:05 UTC)."""
    return not (any(traced.skips) or tiles.indexed(traced))


def bf16_store_lines(role: str, slot: str, value: str, mask: str,
                     old: str | None = None, convert: bool = False,
                     raw: bool = False, keep: str | None = None,
                     packed: bool = False) -> list[str]:
    """Stores fp32 ``value`` as bf16 bits, rounded to nearest even (NaN: 0x7FC0), as
    torch's ``.to(torch.bfloat16)`` rounds: by the conversion instruction (``convert``:
    :func:`bf16_convert`) or by integer operations, exact on every backend (Triton's
    interpreter converts by truncation). ``old``: the slot's loaded value (fp32, widened
    exactly), whose bits a NaN that stays a NaN keeps (``ftopt.numerics.keep_nan_bits``);
    ``raw``: read them from its loaded 16-bit word (``{old}_raw``; :func:`nan_from_word`).
    ``keep``: the word stored where ``zero`` holds (``ftopt.lowering.word_selects``;
    ``packed``: picked in pairs, a NaN's bits kept in the pick,
    :func:`ftopt.lowering.word_selects.keep`).
    """
    b = f"b_{slot}"
    nan = "32704" if old is None else (
        f"tl.where(({old}_raw & 32767) > 32640, {old}_raw.to(tl.uint32), 32704)" if raw
        else f"tl.where({old} != {old}, {old}.to(tl.uint32, bitcast=True) >> 16, 32704)")
    # (* 1.0: a broadcast that keeps every value, -0.0 included; a sum with a -0.0
    # literal becomes +0.0 in Triton 3.6 on an H200)
    lines = [f"{b}_x = {value} * tl.full([BLOCK], 1.0, tl.float32)"]
    if convert:
        lines.append(f"{b}_u = {b}_x.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)")
    else:
        lines += [f"{b}_u = {b}_x.to(tl.uint32, bitcast=True)",
                  f"{b}_u = ({b}_u + 32767 + (({b}_u >> 16) & 1)) >> 16"]
    word = f"{b}_u.to(tl.uint16)"
    if keep and packed:  # (the NaN's bits kept in the pick)
        word = word_selects.keep("state_bf16", word, keep, f"{b}_x", old or keep)
        return lines + [f"tl.store({role} + offs, {word}{mask})"]
    word = word_selects.pick(keep, word) if keep else word
    return lines + [f"{b}_u = tl.where({b}_x == {b}_x, {b}_u, {nan})",
                    f"tl.store({role} + offs, {word}{mask})"]


def half_load_lines(name: str, load: str, dtype, as_bits: bool,
                    raw: bool = False) -> list[str]:
    """``name``, a 16-bit value ``load`` gives, in fp32 with a NaN's bits kept: bf16
    widened by a shift (``as_bits``: loaded as its bits, uint16; ``raw``: the loaded
    value kept as ``{name}_raw`` too); fp16 converted, its bits kept beside as
    ``{name}_raw`` (the GPU's conversion of a NaN gives the canonical one), for
    :func:`half_value`."""
    if dtype == torch.bfloat16 and as_bits:
        return [f"{name}_raw = {load}",
                f"{name} = ({name}_raw.to(tl.uint32) << 16).to(tl.float32, bitcast=True)"]
    if dtype == torch.bfloat16:
        bits = f"{name}_raw.to(tl.uint16, bitcast=True)" if raw else (
            f"{load}.to(tl.uint16, bitcast=True)")
        return [f"{name}_raw = {load}"] * raw + [
            f"{name} = ({bits}.to(tl.uint32) << 16).to(tl.float32, bitcast=True)"]
    return [f"{name}_raw = {load}", f"{name} = {name}_raw.to(tl.float32)"]


def half_value(value: str, old: str, dtype: str, keep: str | None = None,
               packed: bool = False) -> str:
    """fp32 ``value`` converted to the 16-bit ``dtype`` (``"tl.float16"`` or
    ``"tl.bfloat16"``), with the bits of ``old`` (loaded by :func:`half_load_lines`)
    where both are NaN: the GPU's conversions and arithmetic give the canonical NaN, and
    a skipped element keeps its bytes, a NaN's too (``ftopt.numerics.keep_nan_bits``).
    ``keep``: ``old``'s loaded word, stored there and where ``zero`` holds
    (``ftopt.lowering.word_selects``; ``packed``: picked in pairs)."""
    if keep and packed:
        kind = "bf16" if dtype == "tl.bfloat16" else "fp16"
        word = word_selects.keep(kind, f"({value}).to({dtype})", keep, value, old)
        return f"{word}.to({dtype}, bitcast=True)"
    if keep:
        return (f"tl.where(zero | (({value} != {value}) & ({old} != {old})), {keep}, "
                f"({value}).to({dtype}))")
    kept = (f"({old}.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to({dtype}, "
            f"bitcast=True)" if dtype == "tl.bfloat16" else f"{old}_raw")
    return (f"tl.where(({value} != {value}) & ({old} != {old}), {kept}, "
            f"({value}).to({dtype}))")


def rows(lanes: int) -> str:
    """A tile's offsets as ``(BLOCK // lanes, lanes)`` rows: each row is contiguous, so a
    mask constant along it (:func:`with_live_rows`) keeps its loads vectorized."""
    return (f"tl.arange(0, BLOCK // {lanes})[:, None] * {lanes} + "
            f"tl.arange(0, {lanes})[None, :]")


def with_live_rows(body: list[str], lanes: int) -> list[str]:
    """A "chunks" body: ``live`` (a row with a non-zero gradient) right after the
    gradient's load, before any load masked by it, and 2-d broadcasts."""
    at = next(i for i, line in enumerate(body) if line.startswith("g = "))
    assert not any("live" in line for line in body[:at])
    live = "live = tl.max((g != 0.0).to(tl.int32), axis=1)[:, None] != 0"
    shape = f"[BLOCK // {lanes}, {lanes}]"
    body = [line.replace("tl.full([BLOCK],", f"tl.full({shape},")
            .replace("tl.zeros([BLOCK],", f"tl.zeros({shape},") for line in body]
    return body[:at + 1] + [live] + body[at + 1:]


def fast_math(line: str) -> str:
    """``line`` with the approximate square root and division (tiles.FAST_MATH)."""
    # (Not in an 8-bit encoder, ``q_*``: its division by the block's absmax must give the
    # codes eager gives.)
    if line.lstrip().startswith("q_"):
        return line
    return line.replace("tl.sqrt_rn(", "ftopt_fast_sqrt(").replace("tl.div_rn(", "tl.fdiv(")


_STREAM_LOAD = re.compile(
    r"tl\.load\(((?:g_ptr|p_ptr|st\w+_in) \+ offs(?:, mask=[^,]+, other=[\w.]+)?)\)")


def volatile_loads(line: str) -> str:
    """``line`` with its loads of params, gradients and states volatile
    (:data:`ftopt.lowering.half_tiles.VOLATILE`)."""
    return _STREAM_LOAD.sub(r"tl.load(\1, volatile=True)", line)


# The approximate square root flushes denormal inputs to zero (``sqrt.approx.ftz.f32`` on
# NVIDIA GPUs: with eps=0 a gradient below ~1e-19 would then divide by zero). Below the
# smallest normal, x * 2**64 (exact) is normal, and its root times 2**-32 (exact) is x's.
# (The approximate division, ``div.full.f32``, keeps denormals.)
FAST_SQRT = """@triton.jit
def ftopt_fast_sqrt(x):
    tiny = x < 1.1754943508222875e-38
    root = tl.sqrt(tl.where(tiny, x * 18446744073709551616.0, x))
    return tl.where(tiny, root * 2.3283064365386963e-10, root)
"""
