"""``explain``'s line on how a donated skip_zeros step runs a group: the layout's mode
(:data:`ftopt.lowering.tiles.SKIP_MODES`), the one the chain's kernels take, and what
:mod:`ftopt.lowering.skip_watch` may run instead."""

from __future__ import annotations

from ftopt.lowering import streams, tiles


def skip_used(traced, p_dtype, quant_block: int, slot_dtypes: tuple) -> tuple:
    """(layout's mode, the mode this chain's kernels take, layout) of a donated step's
    skip_zeros in this group (:data:`ftopt.lowering.tiles.SKIP_MODES`): the fallback of a
    chain that needs every lane (norms, per-leaf values), or of "chunks" without plain code."""
    layout = tiles.layout(p_dtype, quant_block, slot_dtypes)
    mode = used = tiles.SKIP_MODES[layout]
    if "in_place" in mode and not traced.in_place:
        used = mode.replace("in_place+", "").replace("in_place", "select")
    if mode == "chunks" and not (quant_block == 0 and tiles.chunk_lanes(traced)):
        used = "select"
    if "split" in used and not tiles.may_return_early(traced):
        used = used.replace("split+", "")
    if used == "defer":
        used = "select"
    return mode, used, layout


def skip_line(mode: str, used: str, layout: str) -> str:
    """How the donated step skips zero gradients in this group (:func:`skip_used`)."""
    text = f"  skip_zeros (donated): mode {mode!r} of the {layout!r} layout"
    if used != mode:
        text += f", here {used!r} (what this chain's kernels can take)"
    text += " (ftopt.lowering.tiles.SKIP_MODES; FTOPT_SKIP_MODES overrides)"
    if "split" in used and tiles.SPANS.get(layout, 1) > 1:
        text += (f"; a program checks {tiles.SPANS[layout]} blocks' gradients at once "
                 "(tiles.SPANS)")
    if "defer" in used:
        text += ("; one more launch runs the programs with some zero gradients and the "
                 "leaves' last blocks, or 'split+select' while more than "
                 f"{tiles.DEFER_SELECT_ABOVE:g} of the blocks have some (counted every "
                 f"{tiles.WATCH_PERIOD} steps: ftopt.lowering.skip_watch)")
    elif "split" in used and tiles.WATCH:
        text += ("; 'select' while the blocks with some and with only zero gradients, "
                 f"counted every {tiles.WATCH_PERIOD} steps, say it is the cheaper "
                 "(ftopt.lowering.skip_watch)")
    if "split" in used and tiles.WATCH and tiles.SPANS.get(layout, 1) == 1 < (
            span := tiles.SPAN_ALTERNATES.get(layout, 1)):
        text += (f"; programs of {span} blocks while over {tiles.SPAN_ABOVE:g} are all zero"
                 f", or of {tiles.CARVE_SPANS.get(layout, span)} for the leaves that each"
                 " are, in a group of their own" + (
                     " (launched on a second stream beside the others' kernels on a GPU: "
                     "ftopt.lowering.streams)" if streams.ON else ""))
    return text
