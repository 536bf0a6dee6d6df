"""Which leaves each part of a segmented plan runs on (no kernels here: ``explain`` reads
it without importing Triton)."""

from __future__ import annotations

from ftopt import tree as tree_lib
from ftopt.lowering import branches
from ftopt.lowering.plan import ChainPlan

__all__ = ["leaves_of"]


def leaves_of(plan: ChainPlan, spec, params, p_flat, g_flat, paths) -> list:
    """Per part of ``plan.segments``, the leaves it runs on: for a matrix stage a list
    (per leaf: it has a gradient and the stage applies to it), for a segment
    ``(selection, runs on, seeded)`` (``seeded``: the leaf's input there is an earlier
    part's output).
    Sets each segment plan's ``seeded`` mode for this call."""
    n = len(p_flat)
    tree = params if params is not None else tree_lib.unflatten(spec, p_flat)
    parts = plan.segments
    produced = [False] * n
    out: list = []
    memo: dict = {}  # conditions -> leaves, judged once per call
    for k, part in enumerate(parts):
        if not isinstance(part, ChainPlan):
            on = branches.applying(part[3], tree, n, memo)
            on = [o and g is not None for o, g in zip(on, g_flat)]
            produced = [a or b for a, b in zip(produced, on)]
            out.append(on)
            continue
        selection = branches.select(part, spec, params, p_flat, paths, memo)
        last = k == len(parts) - 1
        on = [g is not None and (last or any(owners[i] is not None
                                             for owners in selection.stage_of))
              for i, g in enumerate(g_flat)]
        seeded = [a and b for a, b in zip(on, produced)]
        if not any(seeded):
            part.seeded = False
        elif seeded == on:
            part.seeded = True
        else:
            part.seeded = "mixed"
            selection.values[(None, "seeded")] = [float(x) for x in seeded]
        produced = [a or b for a, b in zip(produced, on)]
        out.append((selection, on, seeded))
    return out
