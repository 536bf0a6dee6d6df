"""Tiles and register caps of the main kernels over 16-bit params and gradients, per
layout (:func:`ftopt.lowering.tiles.layout`) and per kind of kernel: without skip_zeros
("plain") and skip_zeros' select kernels (not in place). Where a layout has none here
its kernels take :data:`ftopt.lowering.tiles.BLOCK` and ``NUM_WARPS``.

Eight 16-bit elements a thread fill a 128-bit load; four (512 elements, 4 warps) half
fill it. H200, GPT-2 tree, bf16 params with bf16 / fp16 states, without skip_zeros, 512x4
/ 512x2 (ms, ``benchmarks/tile16_gpu.py``, 2026-12-04): Adam 0.461 / 0.438, 0.460 /
0.433; AdEMAMix 0.591 / 0.572, 0.601 / 0.592; SGD with momentum 0.316 / 0.302, 0.320 /
0.312; Lion 0.348 / 0.348, 0.321 / 0.327. Not with fp32 params (Adam 0.604 / 0.714), so
these apply where params and gradients are both 16-bit. skip_zeros' select kernel of
"16-bit states" takes 512x2 capped at 56 registers with volatile loads and its selects
on the stored words (:mod:`ftopt.lowering.word_selects`), which keep its four loads up
front; skip_zeros against none, bf16 params and states, dense / 90% of the embedding's
rows zero: +10.5% / 1.172x at 512x4 (before); at 512x2/56 +8.9% / 1.190x, with volatile
loads +5.0% / 1.239x, and with the word selects too +2.0% / 1.253x (2026-12-04 18:46 UTC;
each alone gained at most 1.5%).

``FTOPT_PLAIN_TILE`` and ``FTOPT_SELECT_TILE`` override them: ``LAYOUT=BLOCKxWARPS`` or
``LAYOUT=BLOCKxWARPS/MAXNREG``, comma-separated; "" for none.

``FTOPT_PLAIN_VOLATILE`` and ``FTOPT_SELECT_VOLATILE`` (comma-separated layouts; by
default none and "16-bit states") make the loads of params, gradients and states
volatile in those layouts' plain and select kernels (those these tiles apply to, whether
or not one is set). At 8 elements a thread ``ptxas`` issues some of a kernel's four
128-bit loads only after computing with the others, presumably to hold fewer registers
(static SASS, sm_90, Triton 3.6, Adam over bf16 params and states: the plain kernel
three loads up front and the fourth 55 instructions later, the select kernel two, then
the others 110 and 300 later; at 4 elements a thread, 64-bit loads, all four up front),
whatever the cap. Volatile loads keep their order in the program: the plain kernel then
issues all four up front, the select kernel three. The same values, one request each,
but system-scope strong loads (``LDG.E.128.STRONG.SYS``), whose speed against the others
is what these settings are for measuring: the plain kernels with them, bf16 / fp16
states (ms at 512x2, without / with): Adam 0.439 / 0.434, 0.432 / 0.437; Lion 0.348 /
0.327, 0.327 / 0.327; AdEMAMix 0.575 / 0.604, 0.596 / 0.569; SGD 0.302 / 0.301, 0.309 /
0.304 (as much lost as won).
``FTOPT_SELECT_WORDS`` (layouts, "16-bit states" by default, under the interpreter too)
takes the select kernels' word selects (:mod:`ftopt.lowering.word_selects`). "indexed"
in any of these three lists adds stochastic rounding's kernels of its layouts
(:func:`ftopt.lowering.word_selects.takes`), whose tile these tables leave alone.
"""

from __future__ import annotations

import os

from ftopt.lowering import knobs


def _tiles(variable: str, default: str, help: str) -> dict[str, tuple[int, int, int]]:
    """``layout -> (block, warps, maxnreg)`` (0: no cap) from ``variable``; none under
    the interpreter or with ``FTOPT_BLOCK`` set, unless ``variable`` is set."""
    return knobs.unless_set(variable, knobs.layout_tiles(variable, default, help),
                            knobs.INTERPRETING or "FTOPT_BLOCK" in os.environ)


PLAIN = _tiles("FTOPT_PLAIN_TILE", "16-bit states=512x2", "16-bit main kernels' tiles "
               "without skip_zeros (none under the interpreter)")
SELECT = _tiles("FTOPT_SELECT_TILE", "16-bit states=512x2/56", "16-bit main kernels' "
                "tiles with skip_zeros, select mode")
VOLATILE = {"plain": knobs.layout_set("FTOPT_PLAIN_VOLATILE", "", "layouts whose plain "
                                      "16-bit kernels load volatile", extra=("indexed",)),
            "select": knobs.layout_set("FTOPT_SELECT_VOLATILE", "16-bit states", "layouts whose "
                                       "select 16-bit kernels load volatile", extra=("indexed",))}
WORDS = knobs.layout_set("FTOPT_SELECT_WORDS", "16-bit states", "layouts whose select "
                         "kernels select stored words", extra=("indexed",))


def elem_bytes(p_dtype, g_dtype) -> int:
    """The larger element size of a group's params and gradients: 2 where these tiles
    apply."""
    return max(p_dtype.itemsize, g_dtype.itemsize)


def tile(traced, kind: str) -> tuple[int, int, int] | None:
    """(block, warps, maxnreg) of ``traced``'s main kernel over 16-bit params and
    gradients of layout ``kind`` where this module sets one (the caller leaves out
    in-place kernels and those with a heavy tile)."""
    return (SELECT if any(traced.skips) else PLAIN).get(kind)
