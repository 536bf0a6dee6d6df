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
"""

from __future__ import annotations

import re

from ftopt.lowering import half_tiles, tiles

__all__ = ["applies", "moved", "takes"]

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
        # The param: p + where(zero, -0.0, u) -> p + u, p's word where zero.
        update = expr[len("p + "):] if expr.startswith("p + ") else ""
        m = _SELECT.fullmatch(graph.nodes[update].expr) if update in graph.nodes else None
        if role == "p_out" and p_half and m and m.group(1) == "neg_zero":
            out.append((role, (graph.sym("p") + graph.sym(m.group(2))).name))
            words[role] = "p"
            continue
        out.append((role, node))
    return out, words
