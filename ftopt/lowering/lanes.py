"""Which lanes a generated kernel loads and stores: the masks of full and tail blocks,
of in-place steps (zero-gradient lanes untouched) and of slots a per-leaf flag turns
off; and the bf16 store that rounds as torch does."""

from __future__ import annotations

__all__ = ["masks", "flag_mask", "load_mask", "bf16_store_lines", "rows", "with_live_rows"]


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
