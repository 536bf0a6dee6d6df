"""Which lanes a generated kernel loads and stores: the masks of full and tail blocks,
of in-place steps (zero-gradient lanes untouched) and of slots a per-leaf flag turns
off; and the bf16 store that rounds as torch does."""

from __future__ import annotations

__all__ = ["masks", "flag_mask", "load_mask", "bf16_store_lines"]


def flag_mask(traced, flag: str, load: bool) -> str:
    """The load (or store) mask of a slot whose leaves a per-leaf ``flag`` may leave out:
    lanes below the leaf's size where the flag is on, below 0 where it is off (in full
    blocks too; the tail's ``in_range`` is implied)."""
    conds = [f"(offs < tl.where({flag}, n, 0))"] + (["keep"] if traced.in_place else [])
    return f", mask={' & '.join(conds)}" + (", other=0.0" if load else "")


def load_mask(traced, masks: dict, tail: bool, role: str) -> str:
    flag = traced.slot_flags.get(role)
    return masks["LMASK"] if flag is None else flag_mask(traced, flag, True)


def masks(traced, tail: bool) -> dict[str, str]:
    """Load and store masks of the full-block and the tail-block code."""
    keep = " & keep" if traced.in_place else ""
    if tail:
        return {"GMASK": ", mask=in_range, other=0.0",
                "LMASK": f", mask=in_range{keep}, other=0.0",
                "SMASK": f", mask=in_range{keep}"}
    if traced.in_place:
        return {"GMASK": "", "LMASK": ", mask=keep, other=0.0", "SMASK": ", mask=keep"}
    return {"GMASK": "", "LMASK": "", "SMASK": ""}


def bf16_store_lines(role: str, slot: str, value: str, mask: str) -> list[str]:
    """Stores fp32 ``value`` as bf16 bits, rounded to nearest even (NaN: 0x7FC0), as
    torch's ``.to(torch.bfloat16)`` rounds, with integer operations: exact on every
    backend (Triton's interpreter converts by truncation), and as fast as the conversion
    instruction on the H200 (bf16 params and states, GPT-2: 0.465 ms with these lines,
    0.469 with the instruction)."""
    b = f"b_{slot}"
    return [
        # (* 1.0: a broadcast that keeps every value, -0.0 included; a sum with a -0.0
        # literal becomes +0.0 in Triton 3.6 on an H200)
        f"{b}_x = {value} * tl.full([BLOCK], 1.0, tl.float32)",
        f"{b}_u = {b}_x.to(tl.uint32, bitcast=True)",
        f"{b}_u = ({b}_u + 32767 + (({b}_u >> 16) & 1)) >> 16",
        f"{b}_u = tl.where({b}_x == {b}_x, {b}_u, 32704)",
        f"tl.store({role} + offs, {b}_u.to(tl.uint16){mask})",
    ]
