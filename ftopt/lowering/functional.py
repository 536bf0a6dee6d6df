"""Non-donated steps and fused updates over trees shaped like the previous call's.

The first such call runs the full path (flatten with paths, every check, new tables) and
keeps its :class:`~ftopt.lowering.execute.PreparedStep`. A later call whose trees have
the same structure, shapes, dtypes, device and ``None`` gradients is checked role by role
in a few C-level passes (shapes, strides, dtypes, devices; then the data pointers, which
are the addresses uploaded), writes its outputs into one new buffer per (group, output
role) with a view per leaf, uploads one address table per group and launches. Anything
that does not match returns ``None``: the full path then runs, and names what is wrong.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from itertools import repeat

import optree
import torch

from ftopt import eager
from ftopt.lowering import checks, codegen, launch
from ftopt.lowering.counts import advance_counts, advance_running
from ftopt.lowering.execute import (
    PreparedStep,
    misaligned,
    running_targets,
    uses_tensors,
)
from ftopt.lowering.flat import flat_dict_getter, flat_dict_leaves
from ftopt.lowering.plan import planned_states
from ftopt.lowering.scalars import host_hparams, kernel_scalars
from ftopt.rules import QuantizedSlot
from ftopt.validate import check_running

_requires_grad = operator.attrgetter("requires_grad")


@dataclass
class OutputLayout:
    """Where a group's outputs of one role live in their shared buffer (each leaf starts
    16-byte aligned), and how to cut it into per-leaf views cheaply.

    Making a tensor costs about a microsecond of host time per torch call, and a
    functional step makes one per output leaf and role (444 for GPT-2 Adam). So leaves
    are placed in runs of the same trailing shape: one run is cut by ``view`` and
    ``split_with_sizes`` into pieces that already have the leaves' shapes (1-d leaves,
    with padding pieces between them; ``(k, 768)`` matrices; ...), one torch call per run
    plus the pieces. A leaf whose rows are not a multiple of 16 bytes, or that has no
    dimensions, gets its own ``as_strided`` view.
    """

    dtype: torch.dtype
    n: int  # leaves
    byte_offsets: list[int]  # per leaf, in the group's leaf order
    total: int  # elements of the buffer
    runs: list = field(default_factory=list)  # (start, stop, view shape, split sizes)
    singles: list = field(default_factory=list)  # (shape, strides, offset)
    empty: list = field(default_factory=list)  # shapes of leaves with no elements
    # The piece of each leaf (pieces: the runs' in order, then singles, then empty ones):
    # an itemgetter, or a one-item list for one leaf.
    order: object = None

    def views(self, buffer: torch.Tensor) -> list:
        pieces = []
        for start, stop, shape, sizes in self.runs:
            pieces += buffer[start:stop].view(shape).split_with_sizes(sizes)
        for shape, strides, offset in self.singles:
            pieces.append(buffer.as_strided(shape, strides, offset))
        for shape in self.empty:
            pieces.append(buffer.new_empty(shape))
        return list(self.order(pieces)) if self.n > 1 else [pieces[self.order[0]]]


def output_layout(shapes: list, dtype: torch.dtype) -> OutputLayout:
    """The layout of leaves of ``shapes`` (in leaf order) in one buffer of ``dtype``."""
    size = torch.empty((), dtype=dtype).element_size()
    per_16 = 16 // size
    layout = OutputLayout(dtype, len(shapes), [0] * len(shapes), 0)
    by_trailing: dict[tuple, list[int]] = {}
    odd, empty = [], []
    for position, shape in enumerate(shapes):
        if shape.numel() == 0:
            empty.append(position)
        elif len(shape) == 1:
            by_trailing.setdefault((), []).append(position)
        elif len(shape) > 1 and shape[1:].numel() % per_16 == 0:
            by_trailing.setdefault(tuple(shape[1:]), []).append(position)
        else:
            odd.append(position)
    total = 0
    piece_of = [0] * len(shapes)
    n_pieces = 0
    for trailing, positions in by_trailing.items():
        start, sizes = total, []
        row = max(1, torch.Size(trailing).numel())
        for position in positions:
            rows = shapes[position][0]
            layout.byte_offsets[position] = total * size
            piece_of[position] = n_pieces + len(sizes)
            sizes.append(rows)
            total += rows * row
            pad = -total % per_16  # (0 for rows of whole 16-byte units)
            if pad:
                sizes.append(pad)
                total += pad
        layout.runs.append((start, total, (-1, *trailing), sizes))
        n_pieces += len(sizes)
    for position in odd:
        shape = shapes[position]
        layout.byte_offsets[position] = total * size
        strides = torch.empty(shape, device="meta").stride()
        layout.singles.append((shape, strides, total))
        piece_of[position] = n_pieces
        n_pieces += 1
        total += shape.numel()
        total += -total % per_16
    for position in empty:
        layout.empty.append(shapes[position])
        piece_of[position] = n_pieces
        n_pieces += 1
    layout.order = operator.itemgetter(*piece_of) if len(shapes) > 1 else piece_of
    layout.total = total
    return layout


@dataclass
class FunctionalCache:
    prepared: PreparedStep
    spec: optree.PyTreeSpec
    n: int
    params_given: bool
    getter: object  # itemgetter of a flat {name: tensor} dict's keys, or None
    inactive: list[int]
    in_check: list[dict] = field(default_factory=list)  # per group: role -> TensorCheck
    out_layout: list[dict] = field(default_factory=list)  # per group: role -> OutputLayout
    # Per group: input role -> the addresses of the tensors the last call returned for
    # it (a functional loop passes them back: aligned, no alignment test).
    returned: list[dict] = field(default_factory=list)
    whole: bool = False  # one group of every leaf, in order: outputs are its views


def remember(plan, output: str, prepared: PreparedStep, spec, params, g_flat, slot_flat,
             p_flat) -> None:
    """Keep a full call's tables for the next call over trees shaped the same way."""
    if any(isinstance(leaf, QuantizedSlot) for slots in slot_flat for leaves in slots.values()
           for leaf in leaves):
        return  # 8-bit states take the full path
    n = len(g_flat)
    getter = flat_dict_getter(params) if params is not None and len(params) == n else None
    cache = FunctionalCache(prepared, spec, n, params is not None, getter,
                            [i for i in range(n) if g_flat[i] is None])
    traced = prepared.traced
    for group in prepared.groups:
        leaves = group.leaves
        roles = _input_tensors(traced, leaves, p_flat, g_flat, slot_flat)
        cache.in_check.append({r: checks.TensorCheck(ts, prepared.device)
                               for r, ts in roles.items()})
        shapes = [g_flat[i].shape for i in leaves]
        layouts = {}
        half = dict(group.slot_dtypes)
        for role in codegen.output_roles(group.traced):
            dtype = group.p_dtype if role == "p_out" else half.get(role[:-4], torch.float32)
            per_leaf = role[:-4] in group.traced.leaf_slots  # (a 0-d tensor per leaf)
            layouts[role] = output_layout([torch.Size()] * len(shapes) if per_leaf
                                          else shapes, dtype)
        cache.out_layout.append(layouts)
        cache.returned.append({})
    cache.whole = len(prepared.groups) == 1 and prepared.groups[0].leaves == list(range(n))
    plan.functional[output] = cache


def _input_tensors(traced, leaves, p_flat, g_flat, slot_flat) -> dict:
    roles = {"g": [g_flat[i] for i in leaves], "p": [p_flat[i] for i in leaves]}
    for stage_i, name in traced.slot_roles:
        roles[f"st{stage_i}_{name}_in"] = [slot_flat[stage_i][name][i] for i in leaves]
    return roles


def _leaves(cache: FunctionalCache, tree):
    if cache.getter is not None:
        leaves = flat_dict_leaves(cache.getter, cache.n, tree)
        if leaves is not None:
            return leaves
    try:
        return cache.spec.flatten_up_to(tree)
    except (ValueError, TypeError):
        return None


def fast_functional(plan, params, grads, state, output: str):
    """A non-donated step (``output="p"``) or an update (``"u"``) through the cached
    tables: ``(new params or updates, new stage states)``, or ``None``."""
    cache = plan.functional.get(output)
    if cache is None or (params is not None) != cache.params_given:
        return None
    prep = cache.prepared
    if eager.functorch_active():
        return None
    g_flat = _leaves(cache, grads)
    p_flat = _leaves(cache, params) if params is not None else g_flat
    stage_states = planned_states(plan, state)
    if g_flat is None or p_flat is None or stage_states is None:
        return None
    slot_flat = []
    for stage, st in zip(plan.stages, stage_states):
        slots = {}
        for slot in stage.rule.slots:
            leaves = _leaves(cache, getattr(st, slot.name))
            if leaves is None:
                return None
            slots[slot.name] = leaves
        slot_flat.append(slots)
    if any([g_flat[i] is not None for i in cache.inactive]):
        return None
    grad_mode = torch.is_grad_enabled()
    device = prep.device
    traced = prep.traced
    tables = []
    try:
        for group, in_check, returned in zip(prep.groups, cache.in_check, cache.returned):
            roles = _input_tensors(traced, group.leaves, p_flat, g_flat, slot_flat)
            addresses = {}
            for role, tensors in roles.items():
                check = in_check[role]
                found = check.pointers(tensors)
                if found is None:
                    return None
                if 0 in found:  # (a DTensor's data_ptr() is 0: never a kernel's input)
                    checks.refuse_dtensors(tensors)
                if (grad_mode and (role == "p" or (role == "g" and output == "u"))
                        and not check.grad_free and any(map(_requires_grad, tensors))):
                    return None
                if (group.aligned and found != returned.get(role)
                        and misaligned(found)):
                    return None
                addresses[role] = found
            tables.append(addresses)
    except (AttributeError, TypeError):  # a leaf that is not a tensor
        return None
    counts = [st.count if stage.rule.counted else None
              for stage, st in zip(plan.stages, stage_states)]
    if any(c is not None and not isinstance(c, torch.Tensor) for c in counts):
        return None
    if plan.running and not all(_running_ok(stage.rule, st, device)
                                for stage, st in zip(plan.stages, stage_states)):
        return None  # (the full path names what is wrong)
    hparams = host_hparams(plan, device)
    steps, new_counts, pairs = advance_counts(plan, counts, False,
                                              uses_tensors(plan, hparams), device)
    carried, running = advance_running(plan, stage_states, steps, False)
    if cache.whole:  # every output list is replaced by one group's views
        out, slot_out = None, [{name: None for name in slots} for slots in slot_flat]
    else:
        out = list(p_flat) if output == "p" else [None] * cache.n
        slot_out = [{name: list(leaves) for name, leaves in slots.items()}
                    for slots in slot_flat]
    for group, addresses, layouts, returned in zip(prep.groups, tables, cache.out_layout,
                                                   cache.returned):
        returned.clear()
        for role, layout in layouts.items():
            buffer = torch.empty(layout.total, dtype=layout.dtype, device=device)
            views = layout.views(buffer)
            addresses[role] = list(map(buffer.data_ptr().__add__, layout.byte_offsets))
            if role == f"{output}_out":
                if output == "p":
                    returned["p"] = addresses[role]
                if cache.whole:
                    out = views
                    continue
                target = out
            else:
                stage_i, name = role[2:-4].split("_", 1)
                returned[role[:-4] + "_in"] = addresses[role]
                if cache.whole:
                    slot_out[int(stage_i)][name] = views
                    continue
                target = slot_out[int(stage_i)][name]
            for i, view in zip(group.leaves, views):
                target[i] = view
        _upload(group, addresses, device)
    prep.launch(kernel_scalars(plan, traced, steps, device, hparams, carried), pairs,
                running_targets(plan, traced, stage_states, running, False))
    new_states = []
    for k, (stage, st, slots, count) in enumerate(zip(plan.stages, stage_states, slot_out,
                                                      new_counts)):
        values = {name: optree.tree_unflatten(cache.spec, leaves)
                  for name, leaves in slots.items()}
        if stage.rule.counted:
            values["count"] = count
        if running is not None:
            values.update(running[k])
        new_states.append(type(st)(**values))
    return optree.tree_unflatten(cache.spec, out), new_states


def _running_ok(rule, st, device) -> bool:
    try:
        check_running(rule, st)
    except ValueError:
        return False
    return all(getattr(st, name).device == device for name in rule.running)


def _upload(group, addresses: dict, device) -> None:
    """One host-to-device copy of every role's addresses; each role's table is a row
    (rows of an even length, so every row starts 16-byte aligned)."""
    roles = list(addresses)
    width = len(group.leaves) + len(group.leaves) % 2
    flat = []
    for role in roles:
        row = addresses[role]
        flat += row
        flat += repeat(0, width - len(row))
    rows = launch.to_device(flat, device).view(len(roles), width).unbind(0)
    group.addresses.update(zip(roles, rows))
