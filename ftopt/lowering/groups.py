"""The kernel groups of a prepared step: one per (param dtype, gradient dtype, 8-bit
block, 16-bit slots) of its leaves, each with its tables, addresses and skip_zeros mode.

A donated skip_zeros group of a "split" mode also gets a :class:`~ftopt.lowering.
skip_watch.SkipWatch` and an *alternate*: the same leaves in the mode that the watch
runs instead while the gradients have many blocks part zero ("split+defer": its
"split+select"; another "split" mode: "select"); and, for the layouts of
:data:`tiles.SPAN_ALTERNATES` whose programs hold one block, a *spanned* alternate: the
same mode with programs of several blocks, for gradients with many blocks all zero, and
its *carves* (:func:`carved`): its leaves in two groups, the mostly all-zero ones spanned.
"""

from __future__ import annotations

import torch

from ftopt.lowering import checks, half_tiles, launch, quant_tables, streams, tiles, work
from ftopt.lowering import split as split_kernels
from ftopt.lowering.skip_watch import SkipWatch
from ftopt.rules import QuantizedSlot

# (in place, skip tiles, skip stores, chunks, split, defer): tiles.skip_mode's order
_SELECT = (False, False, False, False, False, False)
_SPLIT_SELECT = (False, False, False, False, True, False)


def build_group(plan, traced, donate: bool, output: str, key: tuple, leaves: list,
                paths: list, roles: dict, leaf_values: torch.Tensor, device,
                mode: tuple | None = None, watched: bool = True,
                span: int = 0, flagged: bool = False) -> launch.GroupLaunch:
    """The group of ``leaves`` (``key``: p dtype, g dtype, 8-bit block, 16-bit slots;
    ``roles``: role -> the leaves' tensors) in ``mode`` (:func:`tiles.skip_mode`'s tuple;
    ``None``: the layout's) with ``span`` blocks a "split" program (0: the layout's,
    :data:`tiles.SPANS`), with its alternates where ``watched``; ``flagged``: flags
    for a watch's count where it is "split" (a carve's groups), as where ``watched``."""
    p_dtype, g_dtype, quant_block, slot_dtypes = key
    watched = watched and tiles.WATCH
    in_place, skip_tiles, skip_stores, chunks, split, defer = (
        mode or tiles.skip_mode(p_dtype, quant_block, slot_dtypes))
    group_traced = plan.traced(donate, output, skip_lanes=in_place)
    kind = tiles.layout(p_dtype, quant_block, slot_dtypes)
    table_args = (tuple(roles["p"][j].numel() for j in range(len(leaves))),
                  tiles.tile(group_traced, quant_block, kind,
                             half_tiles.elem_bytes(p_dtype, g_dtype))[0],
                  bool(group_traced.leaf_slots or group_traced.running_stores),
                  tiles.INTERLEAVE)
    group = launch.GroupLaunch(p_dtype, g_dtype, leaves,
                               work.work_table(table_args[0], device, *table_args[1:]),
                               paths=paths)
    group.traced = group_traced
    group.quant_block = quant_block
    group.slot_dtypes = slot_dtypes
    group.fast_math = tiles.fast_math(p_dtype, quant_block, slot_dtypes)
    # Donated, every stage skip-aware: an all-zero tile changes nothing (8-bit: its blocks
    # keep their bytes), so its program may return at once. (skip_stores not with per-leaf
    # slots: the leaf's first program stores its value; tiles and split not with running
    # scalars either: tiles.may_return_early.)
    skipping = donate and output == "p" and traced.skips and all(traced.skips)
    group.skip_tiles = bool(skip_tiles and skipping and tiles.may_return_early(traced))
    group.skip_stores = bool(skip_stores and skipping and not traced.leaf_slots)
    if chunks and skipping:
        group.chunk_lanes = tiles.chunk_lanes(group_traced)
    group.split = bool(split and skipping and tiles.may_return_early(traced)
                       and not (group.chunk_lanes or group.skip_tiles))
    span = span or tiles.SPANS.get(group.kind, 1)
    if group.split and span > 1:
        group.span = span
        group.work = work.work_table(table_args[0], device, *table_args[1:], group.span)
        # (one leaf's blocks in order: an embedding carved out, say)
        group.one_leaf = len(leaves) == 1 and not work.is_interleaved(
            group.work.num_blocks, tiles.INTERLEAVE)
    if group.split and (watched or flagged or (defer and not group_traced.in_place)):
        # (one a block of the main kernel's table, its padding to whole spans too)
        group.flags = torch.zeros(split_kernels.flag_count(len(group.work.main_leaf)),
                                  dtype=torch.uint8, device=device)
        group.deferring = bool(defer and not group_traced.in_place)
    if quant_block:
        group.qmaps = (quant_tables.table(True, device), quant_tables.table(False, device))
        # The reduction pass at the heavy tile: at one 8-bit block a program (256x1 on a
        # GPU) it ran 4x the programs, each mostly its fixed cost, and summed 4x the
        # partials (H100, GPT-2 NovoGrad, 8-bit states: 297 us where reading g takes 166).
        r_block, r_warps = tiles.HEAVY_TILE
        if group_traced.levels and r_block > table_args[1] and r_block % quant_block == 0:
            group.reduce_tile = (r_block, r_warps)
            group.reduce_work = work.work_table(table_args[0], device, r_block,
                                                table_args[2])
    group.addresses = {r: addresses(ts, device) for r, ts in roles.items()}
    group.aligned = all(t.data_ptr() % 16 == 0 for ts in roles.values() for t in ts
                        if t is not None)
    group.leaf_values = leaf_values
    if group.split and watched:
        spans = tiles.SPAN_ALTERNATES.get(kind, 1) if group.span == 1 else 1
        # (carves from leaves' blocks in leaf order: not in an interleaved table)
        carving = (spans > 1 and len(leaves) > 1
                   and not work.is_interleaved(group.work.num_blocks, tiles.INTERLEAVE))
        group.watch = SkipWatch(group.flags, len(group.work.main_leaf), group.deferring,
                                tiles.DEFER_SELECT_ABOVE if group.deferring
                                else tiles.split_select_above(group_traced, kind),
                                tiles.SPAN_ABOVE if spans > 1 else None,
                                tuple(max(-(-n // table_args[1]), int(table_args[2]))
                                      for n in table_args[0]) if carving else ())
        if carving:  # (not the gradients: carved takes their addresses from the group)
            group.watch.rebuild = (plan, traced, donate, output, key, leaves, paths,
                                   {**roles, "g": [None] * len(leaves)}, leaf_values,
                                   device, mode, tiles.CARVE_SPANS.get(kind, spans))
        rest = (plan, traced, donate, output, key, leaves, paths, roles, leaf_values, device)
        group.alternate = build_group(*rest, _SPLIT_SELECT if group.deferring else _SELECT,
                                      watched=False)
        if spans > 1:
            group.spanned = build_group(*rest, mode, watched=False, span=spans)
    return group


def carved(group: launch.GroupLaunch, carve: tuple) -> list:
    """The groups of ``group``'s ``carve`` (:class:`SkipWatch`: the positions of its
    leaves that run spanned, and whether the others run the alternate's mode): the other
    leaves in the group's mode or the alternate's, those spanned (launched beside the
    others, on a second stream: :mod:`ftopt.lowering.streams`); built once, their
    gradient tables taken from the group's (and again with it:
    :meth:`ftopt.lowering.execute.PreparedStep.still_valid`)."""
    watch = group.watch
    if carve not in watch.carves:
        plan, traced, donate, output, key, leaves, paths, roles, values, device, mode, spans = (
            watch.rebuild)
        sparse, alternate = carve
        width = values.numel() // len(leaves)
        parts = []
        for at, span, its_mode, beside in (
                ([j for j in range(len(leaves)) if j not in sparse], 0,
                 (_SPLIT_SELECT if group.deferring else _SELECT) if alternate else mode,
                 False),
                (list(sparse), spans, mode, True)):
            sub = build_group(plan, traced, donate, output, key, [leaves[j] for j in at],
                              [paths[j] for j in at],
                              {r: [ts[j] for j in at] for r, ts in roles.items()},
                              values.view(len(leaves), width)[at].reshape(-1) if width
                              else values, device, its_mode, watched=False, span=span,
                              flagged=True)
            sub.beside = beside  # (launched beside the other: ftopt.lowering.streams)
            sub.warps = tiles.CARVE_WARPS.get(sub.kind, 0) if beside else 0
            sub.programs = (tiles.CARVE_PROGRAMS.get(sub.kind, 0)
                            * streams.multiprocessors(device) if beside else 0)
            at = launch.to_device(at, device)
            sub.addresses["g"] = group.addresses["g"][at]
            parts.append((sub, at))
        watch.carves[carve] = parts
    return [sub for sub, _ in watch.carves[carve]]


def running_groups(group: launch.GroupLaunch) -> list:
    """The groups that run ``group``'s leaves this step, by its watch's mode: itself, its
    alternate, its spanned alternate, or its carve's two groups."""
    watch = group.watch
    if watch is None:
        return [group]
    if watch.now == 3:
        return carved(group, watch.carve_now)
    return [(group, group.alternate, group.spanned)[watch.now]]


def share_grads(group: launch.GroupLaunch) -> None:
    """After ``group``'s gradient table changed: its alternates' (the same table) and
    its carves' (their leaves' rows of it)."""
    for other in (group.alternate, group.spanned):
        if other is not None:
            other.addresses["g"] = group.addresses["g"]
    for parts in (group.watch.carves.values() if group.watch else ()):
        for sub, at in parts:
            sub.addresses["g"] = group.addresses["g"][at]


def group_roles(traced, leaves, p_flat, g_flat, slot_flat, p_out, slot_out,
                x_flat=None) -> dict:
    """Role -> the tensors of the group's leaves (8-bit slots: codes and absmax)."""
    roles = {"g": [g_flat[i] for i in leaves], "p": [p_flat[i] for i in leaves],
             f"{traced.output}_out": [p_out[i] for i in leaves]}
    if traced.seeded:
        roles["x"] = [x_flat[i] for i in leaves]
    for stage_i, name in traced.slot_roles:
        for io, source in (("in", slot_flat), ("out", slot_out)):
            # (None: the leaf has no state at this position, which its flag leaves out.)
            items = [source[stage_i][name][i] for i in leaves]
            if any(isinstance(q, QuantizedSlot) for q in items):
                roles[f"st{stage_i}_{name}_amax_{io}"] = [
                    None if q is None else q.absmax for q in items]
                items = [None if q is None else q.codes for q in items]
            roles[f"st{stage_i}_{name}_{io}"] = items
    return roles


def addresses(tensors, device) -> torch.Tensor:
    """The tensors' addresses; 0 for ``None`` (a slot the leaf's flag keeps the kernel
    from reading or writing)."""
    checks.refuse_dtensors([t for t in tensors if t is not None])
    return launch.to_device([0 if t is None else t.data_ptr() for t in tensors], device)
