"""Triton source for 8-bit blockwise state slots (SPEC §5), used by :mod:`codegen`.

A quantized slot is read as ``qmap[code] * absmax[block]`` and written by taking each
256-element block's new absmax, normalising (``v = x / absmax``, NaN -> 0, clamped to
[-1, 1]) and picking the nearest code by the rule of :func:`ftopt.quant.nearest_code`
(the upper neighbour only if strictly nearer in float32). A block whose gradients are all
zero keeps its codes and absmax.

Arithmetic encoding (the default). The dynamic maps are a decade exponent plus a linear
fraction: decade ``d = 0..6`` covers ``[10**(d-7), 10**(d-6))`` with ``n`` equal bins
(``n = 2**d`` signed, ``2**(d+1)`` unsigned) whose midpoints are the codes. So with
``a = |v|`` (``max(v, 0)`` for the unsigned map), ``d`` = the number of the thresholds
``1e-6 .. 1e-1`` that ``a`` reaches (six compares) and two per-decade float32 constants,
``lo = trunc(a * A[d] - C[d])`` is the index of the code at or below ``a`` up to a
rounding of the guess (mirrored to ``253 - lo`` for negative ``v`` in the signed map).
The true nearest code is always ``lo`` or ``lo + 1``: the guess may err by a quarter of
a code in either direction (checked by ``tests/test_quant_arith.py``, which moves it by
that much; every float32 in [-1, 1] (signed map) and in [0, 1] (unsigned) was also
checked once against the table search). That is far beyond float32 rounding, and the
kernels are compiled without fma contraction, so the GPU rounds the guess as
:func:`arithmetic_codes` does anyway. The table search then takes ``lo + 1`` where
``qmap[lo+1] - v < v - qmap[lo]`` in float32. Both sides of that comparison are monotone
in ``v`` (float32 subtraction rounds monotonically), so it holds exactly from one float32
value on: ``v >= boundary[lo]``, the smallest such value, found once per map by a
bisection over the float32 bit patterns (:func:`boundaries`). The kernels read it from
the second half of a 512-entry table (:func:`kernel_table`: the map, then the
boundaries): ONE gather and one compare give the table search's codes bit for bit, ties
included, where two gathers did before.

The "log2" encoders take the decade as ``floor(log2(a) log10(2)) + 7`` (clamped to 0..6)
instead of the six compares, and ``A``, ``C`` from the table. An estimate of ``log2`` that
errs a little can only put ``a`` in the neighbouring decade close to a threshold, where
both decades' guesses are the same code (the guess is continuous across decades); the
tests move the estimate by 1e-4 decades and the codes stay. The default on NVIDIA GPUs
("lg2-rcp") takes ``log2`` from the GPU's approximate logarithm (``lg2.approx``, one
instruction, within 1e-7 decades); elsewhere ("poly-rcp") from a polynomial of the
float's mantissa plus its exponent (:data:`POLY_LOG2`, 3.3e-5 decades at worst). Both
divide by the block's absmax once per block, not per element (:func:`_rcp_lines`: the
same correctly rounded quotient), and a program of one block whose values are all finite
takes that absmax as the largest of the magnitudes' bit patterns, with nothing to clamp
(:func:`_finite_first`).

Gathers per element and quantized slot (all from the 2 KiB table, so L1 hits):
  arithmetic: 1 to decode + 1 to encode = 2 (Adam, two slots: 4); log2: also the
  decade's two constants, from one cache line;
  search (``ENCODER = "search"``, the former 8-step binary search plus the two
  neighbours): 1 + 10 = 11 (Adam: 22).
"""

from __future__ import annotations

import re

import torch

from ftopt.lowering import knobs, tiles
from ftopt.lowering.quant_tables import LOG10_2, POLY_LOG2, guess_constants

# The encoder of the kernels launched from now on (part of their variant, so switching it
# compiles the other kernel); all give the same codes. "arithmetic": the decade from six
# compares; "log2": the decade from the value's base-2 logarithm and the per-decade
# constants from the table; "poly": the same from a polynomial estimate of the logarithm
# (:data:`POLY_LOG2`); "lg2": from the GPU's approximate logarithm (one instruction,
# :data:`LG2_HELPER`; NVIDIA's libdevice only, so "poly" on other GPUs); "-rcp": one
# division per block, not per element (:func:`_rcp_lines`); "search": the former binary
# search (kept to time one against the others). H200, 8-bit Adam, one 64M tensor / GPT-2
# tree, 256 x 1 tile: arithmetic 0.606 / 0.977 ms, log2 0.548 / 0.990, log2-rcp 0.514 /
# 0.949; later, at fast math and a 64-register cap, poly-rcp 0.412 / 0.780, lg2-rcp 0.351 /
# 0.670 (benchmarks/RESULTS.md).
_NVIDIA_OR_INTERPRETED = tiles.INTERPRETING or (
    torch.version.cuda is not None and torch.version.hip is None)
ENCODERS = ("arithmetic", "log2", "log2-rcp", "poly", "poly-rcp", "lg2", "lg2-rcp", "search")
ENCODER = knobs.choice("FTOPT_QUANT_ENCODER", "lg2-rcp" if _NVIDIA_OR_INTERPRETED
                       else "poly-rcp", ENCODERS, "8-bit kernels' encoder (same codes)")

# The "lg2" decade: the GPU's approximate log2 (``lg2.approx``, one instruction; within
# 1e-7 decades), under the interpreter numpy's log2.
LG2_HELPER = {
    "interpreter": """@triton.jit
def ftopt_lg2(x):
    return tl.log2(tl.maximum(x, 1e-30))
""",
    "cuda": """from triton.language.extra import libdevice


@triton.jit
def ftopt_lg2(x):
    return libdevice.fast_log2f(x)
"""}

def _poly_lines(q: str, qmap: str, signed: bool) -> list[str]:
    """The decade from :func:`poly_log2` (integer and float32 multiply-adds only), ``A``
    and ``C`` from the table as the "log2" encoder."""
    a = f"tl.abs({q}_v)" if signed else f"tl.maximum({q}_v, 0.0)"
    c1, c2, c3, c4 = POLY_LOG2
    return [f"{q}_a = {a}",
            f"{q}_ab = tl.maximum({q}_a, 1e-30).to(tl.int32, bitcast=True)",
            f"{q}_t = (({q}_ab & 8388607) | 1065353216).to(tl.float32, bitcast=True) - 1.0",
            f"{q}_l = (({q}_ab >> 23) - 127).to(tl.float32) + {q}_t * ((({c4!r} * {q}_t "
            f"+ {c3!r}) * {q}_t + {c2!r}) * {q}_t + {c1!r})",
            f"{q}_d = tl.minimum(tl.maximum(tl.floor({q}_l * {LOG10_2!r} + 7.0), 0.0), "
            "6.0).to(tl.int32)",
            f"{q}_big = tl.load({qmap} + 512 + {q}_d)",
            f"{q}_off = tl.load({qmap} + 520 + {q}_d)"] + _guess_lines(q, qmap, signed)


def _lg2_lines(q: str, qmap: str, signed: bool) -> list[str]:
    a = f"tl.abs({q}_v)" if signed else f"tl.maximum({q}_v, 0.0)"
    return [f"{q}_a = {a}",
            f"{q}_d = tl.minimum(tl.maximum(tl.floor(ftopt_lg2({q}_a) * {LOG10_2!r} + 7.0), "
            "0.0), 6.0).to(tl.int32)",
            f"{q}_big = tl.load({qmap} + 512 + {q}_d)",
            f"{q}_off = tl.load({qmap} + 520 + {q}_d)"] + _guess_lines(q, qmap, signed)


def _arithmetic_lines(q: str, qmap: str, signed: bool, shape: str) -> list[str]:
    thresholds, a_consts, c_consts = guess_constants(signed)
    a = f"tl.abs({q}_v)" if signed else f"tl.maximum({q}_v, 0.0)"
    lines = [f"{q}_a = {a}",
             f"{q}_big = tl.full({shape}, {a_consts[0]!r}, tl.float32)",
             f"{q}_off = tl.full({shape}, {c_consts[0]!r}, tl.float32)"]
    for threshold, big_d, off_d in zip(thresholds, a_consts[1:], c_consts[1:]):
        lines += [f"{q}_big = tl.where({q}_a >= {threshold!r}, {big_d!r}, {q}_big)",
                  f"{q}_off = tl.where({q}_a >= {threshold!r}, {off_d!r}, {q}_off)"]
    return lines + _guess_lines(q, qmap, signed)


def _log2_lines(q: str, qmap: str, signed: bool) -> list[str]:
    """The decade from ``log2(a)`` (no compares or selects), ``A`` and ``C`` from the
    table (seven addresses: one cache line)."""
    a = f"tl.abs({q}_v)" if signed else f"tl.maximum({q}_v, 0.0)"
    lines = [f"{q}_a = {a}",
             f"{q}_d = tl.minimum(tl.maximum(tl.floor(tl.log2(tl.maximum({q}_a, 1e-30)) "
             f"* {LOG10_2!r} + 7.0), "
             "0.0), 6.0).to(tl.int32)",
             f"{q}_big = tl.load({qmap} + 512 + {q}_d)",
             f"{q}_off = tl.load({qmap} + 520 + {q}_d)"]
    return lines + _guess_lines(q, qmap, signed)


def _guess_lines(q: str, qmap: str, signed: bool) -> list[str]:
    lines = [f"{q}_lo = ({q}_a * {q}_big - {q}_off).to(tl.int32)"]
    if signed:
        lines.append(f"{q}_lo = tl.where({q}_v < 0.0, tl.maximum(253 - {q}_lo, 0), {q}_lo)")
    lines.append(f"{q}_code = tl.where({q}_v >= tl.load({qmap} + 256 + {q}_lo), "
                 f"{q}_lo + 1, {q}_lo)")
    return lines


def _rcp_lines(q: str, finite: str | None = None) -> list[str]:
    """``v = x / m`` rounded to nearest (as ``tl.div_rn``), NaN -> 0, clamped to [-1, 1],
    with one division per block instead of one per element.

    ``m`` (the block's absmax, 1 if 0) and ``x`` are first scaled by the power of two
    that brings ``m`` to [1, 4) (below 1 only if ``m`` is denormal; exact; an ``x`` that
    then underflows has a quotient far below the first nonzero code, which it keeps).
    With ``y = RN(1/m)``, ``q0 = RN(x y)`` is within an ulp of ``x / m``, the remainder
    ``r = x - m q0`` is exact in one fma, and ``RN(q0 + r y)`` is the correctly rounded
    quotient (Markstein's theorem; the
    division's own fast path). Clamping ``x`` to [-absmax, absmax] before dividing equals
    clamping the quotient to [-1, 1] (rounding is monotone and ``m / m = 1``), leaves no
    infinity to make the remainder NaN, and gives 0 where the absmax is 0 (a block of
    zeros and non-finite values: eager's codes of 0, not +-1, for its infinities).
    ``finite``: the values to divide, already clamped and without NaN
    (:func:`_finite_first`), in place of ``x``.
    """
    clamped = ([f"{q}_xc = tl.minimum(tl.maximum({q}_x, -{q}_amax[:, None]), "
                f"{q}_amax[:, None])",
                f"{q}_xc = tl.where({q}_x == {q}_x, {q}_xc, 0.0)"] if finite is None
               else [f"{q}_xc = {finite}"])
    return [
        f"{q}_m = tl.where({q}_amax > 0.0, {q}_amax, 1.0)",
        f"{q}_e = tl.minimum(({q}_m.to(tl.int32, bitcast=True) >> 23) & 255, 253)",
        f"{q}_k = ((254 - {q}_e) << 23).to(tl.float32, bitcast=True)",
        f"{q}_ms = {q}_m * {q}_k",
        f"{q}_y = tl.div_rn(1.0, {q}_ms)",
        *clamped,
        f"{q}_xs = {q}_xc * {q}_k[:, None]",
        f"{q}_q0 = {q}_xs * {q}_y[:, None]",
        f"{q}_r = tl.fma(-{q}_ms[:, None], {q}_q0, {q}_xs)",
        f"{q}_v = tl.fma({q}_r, {q}_y[:, None], {q}_q0)",
    ]


def _search_lines(q: str, qmap: str, shape: str) -> list[str]:
    lines = [f"{q}_pos = tl.zeros({shape}, tl.int32)"]
    for step in (128, 64, 32, 16, 8, 4, 2, 1):
        lines.append(f"{q}_pos = tl.where(tl.load({qmap} + {q}_pos + {step - 1}) < {q}_v, "
                     f"{q}_pos + {step}, {q}_pos)")
    return lines + [
        f"{q}_hi = tl.minimum(tl.maximum({q}_pos, 1), 255)",
        f"{q}_code = tl.where(tl.load({qmap} + {q}_hi) - {q}_v < "
        f"{q}_v - tl.load({qmap} + {q}_hi - 1), {q}_hi, {q}_hi - 1)",
    ]


def qmap_var(signed: bool) -> str:
    return "qmap_signed_ptr" if signed else "qmap_unsigned_ptr"


def load_lines(name: str, role: str, signed: bool, load_mask: str) -> list[str]:
    """Dequantize slot ``role`` into variable ``name``. A full program of one block loads
    its absmax once (one load, not one per element); a masked load (a tail, a slot a
    per-leaf flag may turn off, whose address is then 0) loads it per lane, masked."""
    scale = f"tl.load({role}_amax_in + offs // QBLOCK{load_mask})"
    lines = [f"{name}_code = tl.load({role}_in + offs{load_mask}).to(tl.int32)"]
    if load_mask:
        lines.append(f"{name}_scale = {scale}")
    else:
        # (Both branches are of the same type: Triton may type-check the one it drops.)
        lines += ["if BLOCK == QBLOCK:",
                  f"    {name}_scale = tl.load({role}_amax_in + start // QBLOCK) + "
                  "tl.zeros([BLOCK], tl.float32)",
                  "else:",
                  f"    {name}_scale = {scale}"]
    return lines + [f"{name} = tl.load({qmap_var(signed)} + {name}_code) * {name}_scale"]


def hoisted(lines: list[str]) -> tuple[list[str], list[str]]:
    """(the :func:`load_lines` of every 8-bit slot in ``lines``, loads of a full block,
    with the lines they read (a per-leaf flag of a masked stage: its value and test);
    the other lines): the loads and decodes a "split" kernel issues before its
    zero-gradient check. A slot whose loads read a name set only inside a block stays."""
    early, rest, i = [], [], 0
    while i < len(lines):
        line = lines[i]
        name = line.split(" = tl.load(", 1)[0] if "_old_code = tl.load(" in line else ""
        if name.endswith("_code") and not line.startswith(" "):
            old = name[: -len("_code")]
            end = next(j for j in range(i, len(lines))
                       if lines[j].startswith(f"{old} = tl.load("))
            needed = _read_before(rest, lines[i:end + 1])
            if needed is not None:
                early += [rest[k] for k in needed] + lines[i:end + 1]
                rest = [x for k, x in enumerate(rest) if k not in needed]
                i = end + 1
                continue
        rest.append(line)
        i += 1
    return early, rest


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# The lanes' skip masks: a "split" kernel's branches set them otherwise, after the check.
_BRANCH_NAMES = frozenset({"zero", "keep"})


def _read_before(rest: list[str], block: list[str]) -> list[int] | None:
    """The indices of the top-level assignments of ``rest`` that ``block`` reads, itself
    or through them, in order; ``None`` if it reads a name ``rest`` sets inside a block,
    or a skip mask."""
    wanted = {x for line in block for x in _NAME.findall(line.split(" = ", 1)[-1])}
    found = []
    for k in range(len(rest) - 1, -1, -1):
        target, _, expr = rest[k].partition(" = ")
        name = target.strip()
        if name not in wanted or not _NAME.fullmatch(name):
            continue
        if rest[k].startswith(" ") or name in _BRANCH_NAMES:
            return None
        found.append(k)
        wanted.discard(name)
        wanted |= set(_NAME.findall(expr))
    return sorted(found)


def store_lines(role: str, old: str, value: str, signed: bool, zero: str | None,
                tail: bool, encoder: str = "arithmetic", flag: str | None = None,
                skip_stores: bool = False) -> list[str]:
    """Quantize ``value`` (fp32, one per lane) into slot ``role``'s codes and absmax.
    ``flag``: a per-leaf flag; a leaf it leaves out has no state here (nothing is read
    or written). ``zero``: the lanes whose gradient is zero; a block of only those keeps
    its bytes: its old codes and absmax are selected, or with ``skip_stores`` (the
    caller writes nothing for a program whose gradients are all zero) only where a
    program holds several blocks."""
    q = f"q_{role}"
    qmap = qmap_var(signed)
    shape = "(BLOCK // QBLOCK, QBLOCK)"
    x = f"tl.where(in_range, {value}, 0.0)" if tail else value
    head = [
        f"{q}_x = tl.reshape({x} + tl.zeros([BLOCK], tl.float32), {shape})",
        # The largest finite magnitude; NaN codes as 0, +-Inf as +-1 (ftopt.quant).
        f"{q}_abs = tl.abs({q}_x)",
        f"{q}_amax = tl.max(tl.where({q}_abs <= 3.4028234663852886e38, {q}_abs, 0.0), axis=1)",
    ]
    rcp = encoder.endswith("-rcp")
    head += _rcp_lines(q) if rcp else [
        f"{q}_v = tl.div_rn({q}_x, tl.where({q}_amax > 0.0, {q}_amax, 1.0)[:, None])",
        f"{q}_v = tl.where({q}_v == {q}_v, {q}_v, 0.0)",
        f"{q}_v = tl.minimum(tl.maximum({q}_v, -1.0), 1.0)",
        f"{q}_v = tl.where({q}_amax[:, None] > 0.0, {q}_v, 0.0)",
    ]
    # A program of one block with an "-rcp" encoder: an all-finite block's absmax from the
    # bits, nothing to clamp (:func:`_finite_first`).
    single_head = _finite_first(q, x) + _rcp_lines(q, f"{q}_xf") if rcp else head
    lines: list[str] = []
    encoder = encoder.removesuffix("-rcp")
    if encoder == "search":
        lines += _search_lines(q, qmap, shape)
    elif encoder == "log2":
        lines += _log2_lines(q, qmap, signed)
    elif encoder == "poly":
        lines += _poly_lines(q, qmap, signed)
    elif encoder == "lg2":
        lines += _lg2_lines(q, qmap, signed)
    else:
        lines += _arithmetic_lines(q, qmap, signed, shape)
    lines.append(f"{q}_block = start // QBLOCK + tl.arange(0, BLOCK // QBLOCK)")
    block_mask = f", mask={q}_block * QBLOCK < n" if tail else ""
    if flag is not None:
        block_mask = f", mask={q}_block * QBLOCK < tl.where({flag}, n, 0)"
    if zero is not None:
        skipped = f"tl.where(in_range, {zero}, True)" if tail else zero
        keep = [
            f"{q}_all = tl.min(tl.reshape({skipped}.to(tl.int32), {shape}), axis=1) == 1",
            f"{q}_code = tl.where({q}_all[:, None], tl.reshape({old}_code, {shape}), "
            f"{q}_code)",
            f"{q}_amax = tl.where({q}_all, tl.load({role}_amax_in + {q}_block{block_mask}),"
            f" {q}_amax)",
        ]
        lines += (["if BLOCK != QBLOCK:"] + ["    " + x for x in keep]) if skip_stores \
            else keep
    store_mask = ", mask=in_range" if tail else ""
    if flag is not None:
        store_mask = f", mask=offs < tl.where({flag}, n, 0)"
    lines += [
        f"tl.store({role}_out + offs, tl.reshape({q}_code, (BLOCK,)).to(tl.uint8)"
        f"{store_mask})",
        f"tl.store({role}_amax_out + {q}_block, {q}_amax{block_mask})",
    ]
    # A program of one block (the GPU tile) needs no (blocks, block) view: its reshapes
    # to and from it put each thread's elements 32 apart, and the 8-bit kernel paid two
    # round trips through shared memory, with barriers, per slot (benchmarks/sass_count.py).
    return (["if BLOCK == QBLOCK:"] + ["    " + x for x in one_block(single_head + lines)]
            + ["else:"] + ["    " + x for x in head + lines])


def _finite_first(q: str, x: str) -> list[str]:
    """A one-block program's absmax and ``xf``, the values :func:`_rcp_lines` divides:
    where every value is finite (almost always), the largest magnitude is the largest of
    the magnitudes' bit patterns (one integer max an element) and nothing needs clamping
    or zeroing; otherwise clamped and zeroed as :func:`_rcp_lines` does."""
    return [
        f"{q}_x = tl.broadcast_to({x}, [BLOCK])",
        f"{q}_top = tl.max({q}_x.to(tl.int32, bitcast=True) & 2147483647)",
        f"if {q}_top < 2139095040:",
        f"    {q}_amax = {q}_top.to(tl.float32, bitcast=True)",
        f"    {q}_xf = {q}_x",
        "else:",
        f"    {q}_abs = tl.abs({q}_x)",
        f"    {q}_amax = tl.max(tl.where({q}_abs <= 3.4028234663852886e38, {q}_abs, 0.0))",
        f"    {q}_xf = tl.where({q}_x == {q}_x, tl.minimum(tl.maximum({q}_x, -{q}_amax), "
        f"{q}_amax), 0.0)",
    ]


def one_block(lines: list[str]) -> list[str]:
    """``lines`` for a program of exactly one block: every ``tl.reshape(x, ...)`` is ``x``,
    a reduction over ``axis=1`` is over the whole tile, ``[:, None]`` is dropped (the
    block's values are scalars) and a (blocks, block) shape is ``[BLOCK]``."""
    out = []
    for line in lines:
        while "tl.reshape(" in line:
            start = line.index("tl.reshape(")
            depth, i, comma = 0, start + len("tl.reshape("), None
            while True:
                c = line[i]
                if c in "([":
                    depth += 1
                elif c in ")]":
                    if depth == 0:
                        break
                    depth -= 1
                elif c == "," and depth == 0 and comma is None:
                    comma = i
                i += 1
            line = line[:start] + "(" + line[start + len("tl.reshape("):comma] + ")" \
                + line[i + 1:]
        out.append(line.replace(", axis=1)", ")").replace("[:, None]", "")
                   .replace("(BLOCK // QBLOCK, QBLOCK)", "[BLOCK]"))
    return out
