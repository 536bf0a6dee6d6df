"""skip_zeros' selects on the stored 16-bit words: where the raw gradient is zero, a
16-bit state or param stores the word it loaded, instead of the old value widened to
fp32, selected, and rounded back (the same bits: the widening is exact and rounding gives
them back, a NaN's through ``ftopt.numerics.keep_nan_bits``).

The select kernel then holds no widened old value to its store (in the register file
only the 16-bit words), and ``ptxas`` keeps its loads up front. H200, GPT-2 Adam over
bf16 params and states, skip_zeros against none at 512 elements in 2 warps capped at 56
registers with volatile loads (:mod:`ftopt.lowering.half_tiles`): dense +5.0% -> +2.0%,
90% of the embedding's rows zero 1.239x -> 1.253x (without volatile loads +10.7% /
1.164x; ``benchmarks/RESULTS.md``, 2026-12-04 18:46 UTC).

The skip semantics stay :func:`ftopt.program.trace_chain`'s: this moves a traced select
``where(zero, old, new)`` of a stored value from its fp32 value to the stored word.

Where: the select kernels over 16-bit params and gradients of the layouts in
``FTOPT_SELECT_WORDS`` (:data:`ftopt.lowering.half_tiles.WORDS`), those half_tiles'
settings apply to (:func:`takes`; with "indexed" in it, also those of a rule that reads
the element's index, stochastic rounding, whose tile stays
:data:`ftopt.lowering.tiles.BLOCK`'s).

Where the update of a 16-bit param keeps the param's word where ``zero`` holds, the other
skip selects its value passes through (a stage's ``where(zero, -0.0, u)``) are identities
elsewhere, so its store's value drops them (:func:`moved`): one select an element fewer.

Packed picks (``FTOPT_PACKED_WORDS``, layouts, "16-bit states" by default): the select
kernels of those layouts pick two stored words an instruction. A mask of the gradient's
words, 0xFFFF where a word is not +-0 (``ftopt_nonzero_words``: on NVIDIA GPUs three
instructions for two words, ``(w & 0x7FFF7FFF) + 0x7FFF7FFF`` sets each half's top bit
where its word is not +-0, and a byte permute copies that bit over the half), and a
bitwise select of each stored pair (``ftopt_pick_words``, one ``lop3``), in place of a
compare, predicates and a select an element per stored value (:data:`HELPERS`;
elsewhere, and under the interpreter, the same picks by Triton's integer operations).
Each store's pick keeps a NaN's bits as well (``ftopt_keep_*``): on NVIDIA GPUs from
NaN masks of the new and the old words, three instructions each for two words, then two
or three ``lop3``, in place of fp32 NaN compares and selects an element; the GPU's
conversions give every NaN a NaN word (bf16 states only with them,
:func:`ftopt.lowering.lanes.bf16_convert`).

Static sm_90 counts of the full blocks' path of that select kernel at 512x2/56: 565
instructions and 24 spilled bytes with a select an element; 533 and none with the picks
(499 without skip_zeros); 483 with the picks keeping the NaNs. H200, the
same step in a training loop's position (``benchmarks/skip_in_loop_gpu.py``), skip_zeros
against none, dense / 90% of the embedding's rows zero, the picks (NaNs kept apart) and
the selects in turn twice:
+4.9%, +3.9% / 1.213x, 1.209x against +6.2%, +6.1% / 1.179x, 1.190x; the kernel alone
(CUPTI) 457 us against 470, 445 without skip_zeros (2026-12-05 15:27 UTC). H100, the
picks keeping the NaNs against the selects, four calls: -0.8..-1.1% / 1.289-1.293x
against +1.5..+1.7% / 1.255-1.260x; the kernel 573-579 us against 579-588 without
skip_zeros (2026-12-05 16:22-18:29 UTC; not yet run on an H200).
"""

from __future__ import annotations

import re

import torch

from ftopt.lowering import half_tiles, knobs, tiles

__all__ = ["HELPERS", "PACKED", "applies", "helpers", "keep", "moved", "packed", "pick",
           "takes"]

PACKED = knobs.layout_set("FTOPT_PACKED_WORDS", "16-bit states", "layouts whose select "
                          "kernels pick two stored words an instruction", extra=("indexed",))
# Inline PTX on NVIDIA GPUs; Triton's integer operations elsewhere (the interpreter has no
# inline assembly).
_NVIDIA = not knobs.INTERPRETING and torch.version.cuda is not None and torch.version.hip is None


def _nan_mask(reg: str, src: str, add: str) -> str:
    """PTX: ``reg`` 0xFFFF where a half of ``src`` is a NaN: ``(w & 0x7FFF) + add`` sets
    the half's top bit exactly above the largest infinity's magnitude."""
    return (f'"and.b32 {reg}, {src}, 0x7FFF7FFF; add.u32 {reg}, {reg}, {add}; '
            f'prmt.b32 {reg}, {reg}, 0, 0xBB99; "')


def _ptx_keep(name: str, add: str, canonical: str | None) -> str:
    """A PTX pick of two stored words with a NaN's bits kept: the new word where the
    gradient is not zero (``nz``), except that a NaN over a NaN keeps the old word, and
    (``canonical``, a bf16 state) a NaN over a number stores ``canonical``. Over words of
    the GPU's conversions, which give every NaN a NaN word."""
    if canonical:
        tail = (f'"lop3.b32 t, $1, a, b, 0x8F; lop3.b32 s, a, {canonical}, $2, 0xCA; '
                'lop3.b32 $0, t, $3, s, 0xCA; }"')
    else:
        tail = '"lop3.b32 t, $1, a, b, 0x70; lop3.b32 $0, t, $2, $3, 0xCA; }"'
    return f"""@triton.jit
def {name}(nz, new, old, x, x_old):
    return tl.inline_asm_elementwise(
        "{{ .reg .b32 a, b, t, s; "
        {_nan_mask("a", "$2", add)}
        {_nan_mask("b", "$3", add)}
        {tail},
        "=r,r,r,r", [nz, new.to(tl.uint16, bitcast=True), old.to(tl.uint16, bitcast=True)],
        dtype=tl.uint16, is_pure=True, pack=2)
"""


_PICKS = {
    "ptx": """@triton.jit
def ftopt_nonzero_words(w):
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; and.b32 t, $1, 0x7FFF7FFF; add.u32 t, t, 0x7FFF7FFF; "
        "prmt.b32 $0, t, 0, 0xBB99; }",
        "=r,r", [w.to(tl.uint16, bitcast=True)], dtype=tl.uint16, is_pure=True, pack=2)


@triton.jit
def ftopt_pick_words(nz, new, old):
    return tl.inline_asm_elementwise(
        "lop3.b32 $0, $1, $2, $3, 0xCA;", "=r,r,r,r",
        [nz, new.to(tl.uint16, bitcast=True), old.to(tl.uint16, bitcast=True)],
        dtype=tl.uint16, is_pure=True, pack=2)
""",
    "portable": """@triton.jit
def ftopt_nonzero_words(w):
    return tl.where((w.to(tl.uint16, bitcast=True) & 32767) != 0, 65535, 0).to(tl.uint16)


@triton.jit
def ftopt_pick_words(nz, new, old):
    return (new.to(tl.uint16, bitcast=True) & nz) | (old.to(tl.uint16, bitcast=True) & ~nz)
"""}
# The stores' picks with a NaN's bits kept (ftopt.numerics.keep_nan_bits), from the fp32
# values (``x`` the new, ``x_old`` the old): a bf16 state's (its NaN over a number 0x7FC0)
# and a param's or fp16 state's (its NaN over a number the conversion's own).
_KEEPS = {
    "portable": {
        "ftopt_keep_state_bf16": """@triton.jit
def ftopt_keep_state_bf16(nz, new, old, x, x_old):
    nan = tl.where((old & 32767) > 32640, old.to(tl.uint32), 32704).to(tl.uint16)
    return ftopt_pick_words(nz, tl.where(x == x, new, nan), old)
""",
        **{name: f"""@triton.jit
def {name}(nz, new, old, x, x_old):
    return ftopt_pick_words(nz, tl.where((x != x) & (x_old != x_old), old, new), old)
""" for name in ("ftopt_keep_bf16", "ftopt_keep_fp16")}},
    "ptx": {"ftopt_keep_state_bf16": _ptx_keep("ftopt_keep_state_bf16", "0x007F007F",
                                               "0x7FC07FC0"),
            "ftopt_keep_bf16": _ptx_keep("ftopt_keep_bf16", "0x007F007F", None),
            "ftopt_keep_fp16": _ptx_keep("ftopt_keep_fp16", "0x03FF03FF", None)}}
HELPERS = {kind: "\n\n".join([_PICKS[kind], *_KEEPS[kind].values()]) for kind in _PICKS}


_SELECT = re.compile(r"tl\.where\(zero, (\w+), (\w+)\)")


def takes(traced, variant, layouts: frozenset) -> bool:
    """Whether ``traced``'s main kernel of ``variant`` (16-bit params and gradients) is
    one of ``layouts``' that half_tiles' settings apply to
    (:func:`ftopt.lowering.tiles.half_kernel`), or, with "indexed" in ``layouts``, one of
    a rule that reads the element's index (stochastic rounding)."""
    kind = tiles.layout(variant.p_dtype, variant.quant_block, variant.slot_dtypes)
    wide = half_tiles.elem_bytes(variant.p_dtype, variant.g_dtype)
    return kind in layouts and tiles.half_kernel(traced, wide, "indexed" in layouts)


def applies(traced, variant) -> bool:
    """Whether ``traced``'s main kernel of ``variant`` selects on the stored words
    (:data:`ftopt.lowering.half_tiles.WORDS`)."""
    return any(traced.skips) and takes(traced, variant, half_tiles.WORDS)


def packed(traced, variant) -> bool:
    """Whether ``traced``'s main kernel of ``variant`` picks its stored words in pairs
    (:data:`PACKED`): ``nz`` the gradient's mask, ``ftopt_pick_words`` the picks."""
    return applies(traced, variant) and takes(traced, variant, PACKED)


def helpers(traced, variant, convert: bool) -> dict[str, str]:
    """The ``@triton.jit`` helpers of :func:`packed` picks, by name (none without):
    NVIDIA's PTX, the bf16 states' NaN tests on the words only where ``convert``
    (:func:`ftopt.lowering.lanes.bf16_convert`: every NaN converts to a NaN word)."""
    if not packed(traced, variant):
        return {}
    kind = "ptx" if _NVIDIA else "portable"
    keeps = dict(_KEEPS[kind])
    if not convert:
        keeps["ftopt_keep_state_bf16"] = _KEEPS["portable"]["ftopt_keep_state_bf16"]
    return {"ftopt_pick_words": _PICKS[kind], **keeps}


def pick(keep: str, word: str) -> str:
    """The word a store writes: ``keep`` where ``zero`` holds, ``word`` elsewhere (not
    :func:`packed`; packed, :func:`keep`)."""
    return f"tl.where(zero, {keep}, {word})"


def keep(kind: str, word: str, old_word: str, value: str, old: str) -> str:
    """The word a packed pick stores (:func:`packed`), a NaN's bits kept: ``kind``
    "state_bf16" (a bf16 state), "bf16" or "fp16" (a param's or fp16 state's word);
    ``word`` and ``old_word`` the new and loaded words, ``value`` and ``old`` their fp32
    values."""
    return f"ftopt_keep_{kind}(nz, {word}, {old_word}, {value}, {old})"


def moved(traced, kept: list[tuple[str, str]],
          variant) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """``kept`` stores (role, node) of ``traced``'s main kernel of ``variant``
    (:class:`ftopt.lowering.codegen.Variant`) with each skip select of a 16-bit stored
    value moved onto its word where it :func:`applies`: the store takes the select's new
    value, and the returned map gives the role's loaded value (``{name}_raw`` its word)
    the store keeps where ``zero`` holds."""
    if not applies(traced, variant):
        return kept, {}
    graph, half, p_half = traced.graph, dict(variant.slot_dtypes), variant.p_dtype.itemsize == 2
    out, words = [], {}
    for role, node in kept:
        slot = role[: -len("_out")]
        expr = graph.nodes[node].expr
        if slot in half and (m := _SELECT.fullmatch(expr)) and m.group(1) == f"{slot}_old":
            out.append((role, m.group(2)))
            words[role] = m.group(1)
            continue
        # The param: p + where(zero, -0.0, u) -> p + u, p's word where zero, and u
        # without the skip selects it passes through.
        update = expr[len("p + "):] if expr.startswith("p + ") else ""
        m = _SELECT.fullmatch(graph.nodes[update].expr) if update in graph.nodes else None
        if role == "p_out" and p_half and m and m.group(1) == "neg_zero":
            out.append((role, (graph.sym("p") + graph.sym(_unselected(graph, m.group(2)))).name))
            words[role] = "p"
            continue
        out.append((role, node))
    return out, words


def _unselected(graph, name: str) -> str:
    """A node with ``name``'s value where ``zero`` does not hold: every select on
    ``zero`` it depends on, ``where(zero, a, b)``, replaced by ``b`` (new nodes where
    something changes)."""
    done: dict[str, str] = {}

    def visit(name: str) -> str:
        if name not in done:
            node = graph.nodes[name]
            m = _SELECT.fullmatch(node.expr)
            if m:
                done[name] = visit(m.group(2))
            else:
                deps = {d: visit(d) for d in node.deps if d in graph.nodes}
                changed = {d: new for d, new in deps.items() if new != d}
                if not changed:
                    done[name] = name
                else:
                    expr = re.sub(r"\b(" + "|".join(map(re.escape, changed)) + r")\b",
                                  lambda x: changed[x.group(1)], node.expr)
                    new_deps = tuple(changed.get(d, d) for d in node.deps)
                    done[name] = graph.add(expr, new_deps, node.kind).name
        return done[name]

    return visit(name)
