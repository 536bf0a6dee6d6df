"""Runs one fused step of a planned chain: counts, scalars, tables, reductions, kernels.

The first step over a set of tensors builds a :class:`PreparedStep` (groups, work tables,
address tables). With ``donate=True`` the params and states are the same tensors from one
step to the next, so the next step checks that every tensor the tables point at still is
the caller's (data pointer, shape, strides, dtype, device: two C-level passes over all
of them, params, states and gradients), refreshes the gradient addresses and launches.
Anything else (a param whose ``.data`` was replaced, a state leaf swapped for another
tensor) sends the step to the full path, which plans it anew: the tables never act on
memory the caller no longer holds.
"""

from __future__ import annotations

import operator
from functools import reduce

import optree
import torch

from ftopt import tree as tree_lib
from ftopt.aliasing import check_disjoint
from ftopt.lowering import branches, checks, devices, launch, leaf_slots, reductions, streams
from ftopt.lowering.codegen import output_roles
from ftopt.lowering.counts import advance_counts, advance_running, counts_on, increment
from ftopt.lowering.flat import dict_list_getter, flat_dict_getter, flat_dict_leaves
from ftopt.lowering.groups import build_group, group_roles, running_groups, share_grads
from ftopt.lowering.plan import ChainPlan, planned_states
from ftopt.lowering.scalars import host_hparams, kernel_scalars
from ftopt.rules import QuantizedSlot

_data_ptr = torch.Tensor.data_ptr


def misaligned(addresses: list[int]) -> bool:
    """Whether any address is not a multiple of 16 (one C-level pass)."""
    return bool(reduce(operator.or_, addresses, 0) & 15)


def _as_tuple(picked) -> tuple:
    """``itemgetter`` of one index returns the item itself."""
    return picked if isinstance(picked, tuple) else (picked,)


def uses_tensors(plan: ChainPlan, hparams: list | None) -> bool:
    """Whether the scalars are computed on the device: a hyperparameter is a tensor with
    no host mirror (``hparams``: :func:`ftopt.lowering.scalars.host_hparams`)."""
    if plan.tensor_hparams is None:
        plan.tensor_hparams = any(isinstance(v, torch.Tensor) for s in plan.stages
                                  for v in s.rule.hparams.values())
    return plan.tensor_hparams and hparams is None




class PreparedStep:
    """Groups and tables for one set of (params, grads, states) tensors."""

    def __init__(self, plan: ChainPlan, paths, p_flat, g_flat, slot_flat, p_out, slot_out,
                 active, selection: branches.Selection, donate: bool, output: str = "p",
                 x_flat=None):
        """``slot_flat``/``slot_out``: per position (:func:`branches.merged_slots`)."""
        traced = plan.traced(donate, output)
        self.traced = traced
        self.plan = plan
        self.donate = donate
        self.active = active
        self.device = p_flat[active[0]].device
        # (destinations, scratch) of donated per-leaf slots: see leaf_slots.scratch.
        self.copy_back: tuple | None = None
        if donate and traced.leaf_slots:
            slot_out, self.copy_back = leaf_slots.scratch(traced, slot_out, active,
                                                          self.device)
        self.groups: list[launch.GroupLaunch] = []
        by_key: dict[tuple, list[int]] = {}
        for i in active:
            key = (p_flat[i].dtype, g_flat[i].dtype, _quant_block(plan, slot_flat, i),
                   _slot_dtypes(traced, slot_flat, i))
            by_key.setdefault(key, []).append(i)
        for key, leaves in by_key.items():
            roles = group_roles(traced, leaves, p_flat, g_flat, slot_flat, p_out, slot_out,
                                x_flat)
            rows = [selection.row(traced.graph.leaf_values, leaf) for leaf in leaves
                    ] or [[0.0]]
            leaf_values = torch.tensor(rows, dtype=torch.float32).reshape(-1).to(self.device)
            self.groups.append(build_group(plan, traced, donate, output, key, leaves,
                                           [paths[i] for i in leaves], roles, leaf_values,
                                           self.device))
        self.n_leaves = len(g_flat)
        self.inactive = [i for i in range(len(g_flat)) if g_flat[i] is None]
        self.active_of = operator.itemgetter(*active) if self.inactive else None
        position = {leaf: j for j, leaf in enumerate(active)}
        for group in self.groups:
            group.pick = operator.itemgetter(*[position[i] for i in group.leaves])
            group.grad_addresses = list(map(_data_ptr, _as_tuple(group.pick(
                self._active(g_flat)))))
        self.check: checks.TensorCheck | None = None
        self.slot_readers: list | None = None  # see _branch_tensors
        self.list_getter = None  # the params' dict_list_getter (set for a donated step)
        # (scalars as floats?, count tensors, bound launches, launch.switches(), those
        # of a carve's spanned group, the others): see launch.bind_main and streams.
        self._bound: tuple | None = None
        # The bound launches of each mode of the groups with a SkipWatch (one a mode:
        # a group that switches to an alternate keeps each).
        self._bound_by: dict[tuple, tuple] = {}
        self.watched = [group for group in self.groups if group.watch is not None]

    def _active(self, g_flat) -> tuple:
        return tuple(g_flat) if self.active_of is None else _as_tuple(self.active_of(g_flat))

    def watch(self, p_flat, s_flat, g_flat) -> None:
        """Record what the tables point at: every param, state and gradient tensor."""
        tensors = [*p_flat, *s_flat, *self._active(g_flat)]
        self.check = checks.TensorCheck(tensors, n_fixed=len(p_flat) + len(s_flat))

    def state_tensors(self, state) -> list | None:
        """The tensors of ``state`` the kernels read and write (step counts, then each
        stage's slots; 8-bit slots as codes and absmax), in table order; ``None`` if the
        state is not shaped as planned."""
        states = planned_states(self.plan, state)
        if states is None:
            return None
        if self.plan.branched:
            return self._branch_tensors(states)
        out = []
        for stage, st in zip(self.plan.stages, states):
            if stage.rule.counted:
                out.append(st.count)
            for slot in stage.rule.slots:
                tree = getattr(st, slot.name)
                leaves = flat_dict_leaves(self.flat_getter, self.flat_len, tree)
                if leaves is None:
                    try:
                        leaves = self.spec.flatten_up_to(tree)
                    except (ValueError, TypeError):
                        return None
                if stage.quant is None:
                    out += leaves  # plain tensors, one per leaf (the common case)
                    continue
                for leaf in leaves:
                    if isinstance(leaf, QuantizedSlot):
                        out += leaf
                    elif leaf is not None:
                        out.append(leaf)
        return out

    def _branch_tensors(self, states) -> list:
        """A branched plan's state tensors: each slot's non-None leaves (8-bit: codes,
        absmax) in leaf order, the tensor check then proving each the one the tables
        hold. A slot is read through a getter of the joined groups' layout (a list of
        dicts, :func:`dict_list_getter`, made from the first state read) where it has
        it, else flattened."""
        readers = self.slot_readers
        if readers is None:  # (stages that keep a count or slots)
            readers = self.slot_readers = [
                (i, stage.rule.counted, [(slot.name, dict_list_getter(getattr(st, slot.name)))
                                         for slot in stage.rule.slots])
                for i, (stage, st) in enumerate(zip(self.plan.stages, states))
                if stage.rule.counted or stage.rule.slots]
        out = []
        proven: set = set()  # (the slots share another group's holes: proven once)
        for i, counted, slots in readers:
            st = states[i]
            if counted:
                out.append(st.count)
            for name, getter in slots:
                tree = getattr(st, name)
                found = None if getter is None else getter(tree, True, proven)
                if found is None:
                    found = optree.tree_leaves(tree, none_is_leaf=False, namespace="ftopt")
                out += found
        return out

    def still_valid(self, p_flat, s_flat, g_flat) -> bool:
        """Whether the tables point at exactly these tensors' memory (gradients may have
        moved: their addresses are refreshed). False sends the step to the full path."""
        if len(g_flat) != self.n_leaves:
            return False
        if self.inactive and any([g_flat[i] is not None for i in self.inactive]):
            return False
        grad_pointers = self.check.fit(p_flat, s_flat, self._active(g_flat))
        if grad_pointers is None:
            return False  # a tensor's layout differs, or a param or state moved
        if grad_pointers is True:
            return True
        uploads = []
        for group in self.groups:
            addresses = list(_as_tuple(group.pick(grad_pointers)))
            if addresses != group.grad_addresses:
                if 0 in addresses and checks.holds_dtensor(
                        _as_tuple(group.pick(self._active(g_flat)))):
                    return False  # (data_ptr() 0) the caller steps DTensors on shards
                if group.aligned and misaligned(addresses):
                    return False
                uploads.append((group, addresses))
        # The caching allocator often hands back the same blocks: upload only on change.
        for group, addresses in uploads:
            group.addresses["g"] = launch.to_device(addresses, self.device)
            group.grad_addresses = addresses
            share_grads(group)
        if uploads:
            for bound in self._bound_by.values():
                for b in bound[2]:
                    b.before[b.grad_at] = launch.bound_arg(b.group.addresses["g"])
                    b.tensors[b.grad_at] = b.group.addresses["g"]
        self.check.record(grad_pointers)
        return True

    def launch(self, scalars, count_pairs, running: list = ()) -> None:
        """``running``: where the kernels store the running scalars the bodies compute
        (:func:`running_targets`)."""
        traced = self.traced
        modes, groups = (), self.groups
        if self.watched:
            # (each watched group, or an alternate: ftopt.lowering.skip_watch)
            modes = []
            for group in self.watched:
                watch = group.watch
                watch.plan()
                flags = watch.defer_flags()
                counting = watch.sampling and not group.deferring
                modes.append((watch.now, counting, watch.carve_now, flags))
                for x in running_groups(group):
                    x.defer_flags = flags
                    # (a counting kernel's programs without zeros write no flag)
                    x.counting = counting
                    if counting:
                        x.flags.zero_()
            modes = tuple(modes)
            groups = [x for group in self.groups for x in running_groups(group)]
        bound = self._bound_by.get(modes)
        pairs = [*count_pairs, *running]
        if (bound is not None and bound[0] == isinstance(scalars, list)
                and bound[3] == launch.switches()
                and len(bound[1]) == len(pairs)
                and all([a is b for a, b in zip(bound[1], pairs)])):
            # The same tensors as the last launch (a donated step over checked memory):
            # the bound launches, with this step's scalars.
            args = scalars if bound[0] else (scalars,)
            with devices.device_guard(self.device):
                # (a carve's spanned group beside the others: see streams)
                streams.run_bound(self.device, *bound[4:], args)
                self._copy_back()
                for group in self.watched:
                    group.watch.after()
            return
        with devices.device_guard(self.device):
            leaf_bufs, global_buf = reductions.run_reductions(traced, groups, scalars,
                                                              self.device)
            if not launch.run_main(traced, groups, scalars, leaf_bufs, global_buf,
                                   count_pairs, self.device, running):
                increment(count_pairs)
            self._copy_back()
            for group in self.watched:
                group.watch.after()
        if self.donate:
            launches = launch.bind_main(traced, groups, scalars, count_pairs,
                                        self.device, running)
            self._bound = (None if not launches else
                           (isinstance(scalars, list), pairs, launches,
                            launch.switches(), [b for b in launches if b.group.beside],
                            [b for b in launches if not b.group.beside]))
            if self._bound is None:
                self._bound_by.pop(modes, None)
            else:
                self._bound_by[modes] = self._bound

    def _copy_back(self) -> None:
        if self.copy_back is not None:
            torch._foreach_copy_(*self.copy_back)


def running_targets(plan: ChainPlan, traced, stage_states, running, donate: bool) -> list:
    """The 0-d tensors the main kernels store the running scalars a body computes in
    (``traced.running_stores``, in order): a donated step's own state tensors (the kernels
    read the old values from the scalars, copied before), else new ones, put in
    ``running`` (per stage, the new running values) too."""
    out = []
    for role, _ in traced.running_stores:
        position, name = role[3:].split("_", 1)
        stage = plan.positions[int(position)][0]
        old = getattr(stage_states[stage], name)
        target = old if donate else torch.empty((), dtype=old.dtype, device=old.device)
        if running is not None:
            running[stage][name] = target
        out.append(target)
    return out


def _quant_block(plan: ChainPlan, slot_flat, i: int) -> int:
    for stage, slots in zip(plan.position_stages(), slot_flat):
        for leaves in slots.values():
            if isinstance(leaves[i], QuantizedSlot):
                return stage.quant.block_size
    return 0


def _slot_dtypes(traced, slot_flat, i: int) -> tuple:
    """``(slot, dtype)`` of leaf ``i``'s 16-bit slots, in the traced order."""
    out = []
    for stage_i, name in traced.slot_roles:
        dtype = getattr(slot_flat[stage_i][name][i], "dtype", None)
        if dtype in (torch.bfloat16, torch.float16):
            out.append((f"st{stage_i}_{name}", dtype))
    return tuple(out)


def _empty_like(leaf):
    if isinstance(leaf, QuantizedSlot):
        return QuantizedSlot(torch.empty_like(leaf.codes), torch.empty_like(leaf.absmax))
    return torch.empty_like(leaf)


def execute(plan: ChainPlan, spec, paths, p_flat, g_flat, stage_states, slot_flat, active,
            params, state, donate: bool, output: str = "p", x_flat=None,
            selection: branches.Selection | None = None):
    """The full step: builds (and, donated, caches) the prepared tables, then launches.

    ``output="u"``: an update: returns the updates (fp32; ``None`` where the gradient is
    ``None``) in place of the new params (donated: the states are written in place, as a
    segment before a matrix stage does). ``p_flat`` then holds the params, or the
    gradients as stand-ins when the chain reads no params. ``x_flat``: a seeded segment's
    input (see :mod:`ftopt.lowering.segments`).
    """
    if donate:
        check_disjoint(paths, p_flat)
    counts = [st.count if stage.rule.counted else None
              for stage, st in zip(plan.stages, stage_states)]
    device = p_flat[active[0]].device if active else torch.device("cpu")
    hparams = host_hparams(plan, device)
    steps, new_counts, pairs = advance_counts(plan, counts, donate,
                                              uses_tensors(plan, hparams), device)
    carried, running = advance_running(plan, stage_states, steps, donate)
    p_out = list(p_flat) if output == "p" else [None] * len(p_flat)
    slot_out = [{name: list(leaves) for name, leaves in slots.items()} for slots in slot_flat]
    for i in active if output == "u" or not donate else ():
        p_out[i] = (torch.empty_like(p_flat[i]) if output == "p" else
                    torch.empty(g_flat[i].shape, dtype=torch.float32, device=device))
    if not donate:
        for i in active:
            for slots in slot_out:
                for leaves in slots.values():
                    if leaves[i] is not None:
                        leaves[i] = _empty_like(leaves[i])
    prepared = None
    if active:
        if selection is None:
            selection = branches.select(plan, spec, params, p_flat, paths)
        prepared = PreparedStep(plan, paths, p_flat, g_flat,
                                branches.merged_slots(plan, selection, slot_flat), p_out,
                                branches.merged_slots(plan, selection, slot_out), active,
                                selection, donate, output, x_flat)
        prepared.launch(kernel_scalars(plan, prepared.traced, steps, device, hparams,
                                       carried), pairs,
                        running_targets(plan, prepared.traced, stage_states, running, donate))
        # (Not a segment after a stage: its per-leaf values and inputs change with each step.)
        if donate and output == "p" and not plan.seeded:
            prepared.spec = spec
            prepared.flat_getter = flat_dict_getter(params)
            prepared.flat_len = len(params) if prepared.flat_getter else 0
            if prepared.flat_getter is None:
                prepared.list_getter = dict_list_getter(params)
            prepared.counts = counts  # (the tensor check holds them to these tensors)
            prepared.counts_in_kernel = counts_on(counts, device)
            prepared.watch(p_flat, prepared.state_tensors(state), g_flat)
            plan.prepared = prepared
    else:
        increment(pairs)
    if running is not None:  # (running scalars a body writes and no kernel ran: kept)
        for stage, st, values in zip(plan.stages, stage_states, running):
            for name in stage.rule.running:
                if name not in values:
                    values[name] = getattr(st, name) if donate else getattr(st, name).clone()
    new_params = tree_lib.unflatten(spec, p_out)
    new_states = []
    for k, (stage, st, slots, count) in enumerate(zip(plan.stages, stage_states, slot_out,
                                                      new_counts)):
        values = {name: tree_lib.unflatten(spec, leaves) for name, leaves in slots.items()}
        if stage.rule.counted:
            values["count"] = count
        if running is not None:
            values.update(running[k])
        new_states.append(type(st)(**values))
    return new_params, new_states, prepared


__all__ = ["execute", "output_roles"]
