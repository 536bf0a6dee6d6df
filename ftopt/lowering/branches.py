"""Which stage each leaf runs at each position of a plan (``masked`` and ``partition``).

A plan's position holds one stage, or one per branch of a partition whose branches are
the same chain of rules with other hyperparameters (see :class:`ftopt.stages.Stages`).
The kernel is the same for every leaf of a group: a leaf's ``branch`` value (a row of the
per-leaf table) picks its branch's per-step scalars, and its ``mask`` value says whether
the position applies to it at all (a ``masked`` or a rule's own mask). The states stay
where the eager path keeps them, one tree per branch with ``None`` where a leaf is not
the branch's; the kernel's address tables point each leaf at its branch's tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import optree

from ftopt import shards
from ftopt import tree as tree_lib
from ftopt.stages import leaf_selection

__all__ = ["Selection", "select", "applying", "merged_slots"]


@dataclass
class Selection:
    """Per position and leaf: the stage that runs (``None``: it passes the leaf through)
    and the kernel's per-leaf values."""

    stage_of: list  # [position][leaf] -> stage index or None
    values: dict  # (position, "branch" or "mask") -> [leaf] -> float

    def row(self, keys: list, leaf: int) -> list[float]:
        return [self.values[key][leaf] for key in keys]


def select(plan, spec, params, p_flat, paths, memo: dict | None = None) -> Selection:
    """The selection of ``plan`` over the leaves (``params`` may be ``None`` for an update
    without params: the conditions then see the updates, ``p_flat``, as eager does).
    ``memo``: conditions -> leaves, shared by the calls of one step (the segments of a
    plan with matrix stages judge the same conditions)."""
    n = len(p_flat)
    tree = params if params is not None else tree_lib.unflatten(spec, p_flat)
    applies = [applying(sel, tree, n, memo) for sel in plan.selects]
    stage_of, values = [], {}
    for k, pos in enumerate(plan.positions):
        owners = [next((s for s in pos if applies[s][i]), None) for i in range(n)]
        stage_of.append(owners)
        values[(k, "branch")] = [float(pos.index(s)) if s is not None else 0.0
                                 for s in owners]
        flags = [s is not None for s in owners]
        for s in pos:
            if plan.stages[s].rule.leaf_mask is None:
                continue
            own = _own_mask(plan.stages[s], spec, params, applies[s], n, paths)
            flags = [f and (o != s or own[i]) for i, (f, o) in enumerate(zip(flags, owners))]
        values[(k, "mask")] = [1.0 if f else 0.0 for f in flags]
    # Each leaf's position in the flattened tree (read by indexed rules: ``add_noise``),
    # a ``None`` counted as the eager rules count it (a frozen param; another branch's
    # leaf in a partition's update, which the whole step holds).
    values[(None, "leaf")] = ([float(i) for i in range(n)] if params is None else
                              [float(k) for k, h in enumerate(_held(params)) if h])
    indexed = [s.rule.name for s in plan.stages if s.rule.indexed]
    if indexed:
        # Where a shard's elements start in its full tensor, as two 16-bit halves
        # (float32 holds them exactly): the kernel adds it to each element's position.
        starts = [shards.element_offset(paths[i], indexed[0]) & 0xFFFFFFFF
                  for i in range(n)]
        values[(None, "start_lo")] = [float(s & 0xFFFF) for s in starts]
        values[(None, "start_hi")] = [float(s >> 16) for s in starts]
    return Selection(stage_of, values)


def applying(selects: tuple, tree, n: int, memo: dict | None = None) -> list[bool]:
    """Whether each leaf meets ``selects`` (:func:`ftopt.stages.leaf_selection`), looked
    up in ``memo`` first."""
    if not selects:
        return [True] * n
    if memo is not None and selects in memo:
        return memo[selects]
    found = leaf_selection(selects, tree, n)
    if memo is not None:
        memo[selects] = found
    return found


def _own_mask(stage, spec, params, applies, n, paths) -> list[bool]:
    """A rule's own leaf mask, judged on the params its eager update sees, one entry per
    leaf of ``spec`` (the params' tensors: the eager rule flattens with ``None`` as a
    leaf, so a mask over params that hold ``None``, a frozen param or a leaf another
    part of a partition owns, has an entry more per such ``None``, dropped here)."""
    if params is None:
        found = stage._leaf_mask(None, n, paths)
        return [True] * n if found is None else found
    held = _held(params)
    all_paths = [tree_lib.path_str(p) for p in optree.tree_paths(params, none_is_leaf=True,
                                                                  namespace="ftopt")]
    if not all(applies):
        params = tree_lib.unflatten(spec, [p if a else None for p, a in zip(
            spec.flatten_up_to(params), applies)])
    found = stage._leaf_mask(params, len(held), all_paths)
    return [True] * n if found is None else [m for m, h in zip(found, held) if h]


def _held(params) -> list[bool]:
    """Whether each leaf of ``params``, ``None`` counted as a leaf, holds a tensor."""
    return [x is not None for x in optree.tree_leaves(params, none_is_leaf=True,
                                                      namespace="ftopt")]


def merged_slots(plan, selection: Selection, slot_flat: list) -> list:
    """Per position, each slot's leaves taken from the stage that runs on each leaf
    (the same tensor objects: writes through them land in the branches' trees)."""
    out = []
    for k, pos in enumerate(plan.positions):
        if len(pos) == 1 and not plan.selects[pos[0]]:
            out.append(slot_flat[pos[0]])
            continue
        owners = selection.stage_of[k]
        names = slot_flat[pos[0]].keys()
        out.append({name: [slot_flat[s][name][i] if s is not None else None
                           for i, s in enumerate(owners)] for name in names})
    return out
