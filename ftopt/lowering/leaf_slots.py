"""Per-leaf slots in the generated kernels (:class:`ftopt.rules.Slot` with ``per_leaf``):
one 0-d fp32 tensor per leaf, reached through the leaf's address like any slot.

Every program of a leaf reads the old value; lane 0 of the leaf's first program stores
the new one. A donated step may therefore not store in place (a later program of the
leaf would read the new value): its kernels store to scratch, copied back after them.
"""

from __future__ import annotations

import torch

__all__ = ["load", "store", "scratch"]


def load(role: str, flag) -> str:
    """The load of the leaf's old value. A leaf a flag (``masked``) leaves out has no
    state here (address 0): no lane reads it; one lane reads it where the flag is on."""
    if flag is None:
        return f"tl.load({role}_in)"
    return (f"tl.sum(tl.load({role}_in + offs * 0, mask=offs == start + "
            f"tl.where({flag.name}, 0, BLOCK), other=0.0))")


def store(role: str, value: str, flag: str | None) -> str:
    """The store of the new value (``value``: a block of it): lane 0 of the leaf's first
    program (``offs == 0``), where the leaf's flag keeps the leaf."""
    mask = "offs == 0" if flag is None else f"offs == tl.where({flag}, 0, -1)"
    return f"tl.store({role} + offs * 0, ({value}).to(tl.float32), mask={mask})"


def scratch(traced, slot_out: list, active: list[int], device) -> tuple:
    """A donated step's per-leaf slots go to scratch, copied back into the caller's 0-d
    tensors after the kernels (one multi-tensor copy; see the module docstring).
    Returns ``slot_out`` with the scratch views in those slots (the other slots as they
    were) and ``(destinations, scratch views)``."""
    out = [dict(slots) for slots in slot_out]
    places, destinations = [], []
    for role in sorted(traced.leaf_slots):
        stage_i, name = role[2:].split("_", 1)
        leaves = out[int(stage_i)][name] = list(out[int(stage_i)][name])
        for i in active:
            if leaves[i] is not None:
                places.append((leaves, i))
                destinations.append(leaves[i])
    # (16 bytes apart: every address of the group stays aligned, see GroupLaunch.aligned)
    views = torch.empty((len(destinations), 4), dtype=torch.float32,
                        device=device)[:, 0].unbind(0)
    for (leaves, i), view in zip(places, views):
        leaves[i] = view
    return out, (destinations, list(views))
