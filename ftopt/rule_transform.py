"""``RuleTransform``: a :class:`~ftopt.rules.Rule` as a ``GradientTransformation``.

It owns the state layout (32-bit or 8-bit blockwise slots, the step count) and the checks
of every leaf before anything is written (:mod:`ftopt.validate`); its body runs through
:func:`ftopt.program.trace_chain` (which applies ``skip_zeros``). Its eager update
evaluates the body on :class:`ftopt.eager.Vec` values (``torch`` ops, foreach over the
leaves or a loop under autograd and ``torch.func``), or through the chunked CPU evaluator
where one is installed (:mod:`ftopt.dispatch`); a user's call of ``update`` may run fused
(the dispatch's fused backend).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import optree
import torch

from ftopt import dispatch, eager, program, shards
from ftopt import tree as tree_lib
from ftopt._counts import new_count, remember_count
from ftopt.base import GradientTransformation, register_owner
from ftopt.domains import check_hparam as _check_hparam
from ftopt.numerics import keep_nan_bits
from ftopt.quant import dequantize_blockwise, dynamic_map, quantize_blockwise
from ftopt.rules import (
    QuantConfig,
    QuantizedSlot,
    Rule,
    Slot,
    as_host_numbers,
    check_param,
    compute_dtype,
    initial_running,
    running_dtype,
    running_step,
    state_dtype,
    step_scalars,
)
from ftopt.shards import is_dtensor
from ftopt.validate import (
    check_count,
    check_leaf,
    check_running,
    check_slots,
    check_state_class,
)

__all__ = ["RuleTransform", "rule_transform"]


class RuleTransform:
    """A ``GradientTransformation`` made from a :class:`Rule`."""

    def __init__(self, rule: Rule, quant: QuantConfig | None = None,
                 store: torch.dtype | None = None):
        # Every hyperparameter is checked here, once, against ``rule.domains``: a bad value
        # fails at construction, not as NaN params later (see :mod:`ftopt.domains`).
        for k, v in rule.hparams.items():
            _check_hparam(rule.name, k, v, rule.domains.get(k))
        self.rule = rule
        self.quant = quant
        # The dtype of per-element float states that are not 8-bit (``None``: the
        # params' compute dtype, fp32 for 16-bit params).
        self.store = store
        register_owner(self)

    def with_quant(self, quant: QuantConfig | None,
                   store: torch.dtype | None = None) -> RuleTransform:
        slots = bool(self.rule.slots)
        return RuleTransform(self.rule, quant if slots else None, store if slots else None)

    def with_rule(self, **changes) -> RuleTransform:
        return RuleTransform(replace(self.rule, **changes), self.quant, self.store)

    def as_transform(self) -> GradientTransformation:
        return GradientTransformation(self.init, self.update)

    # -- state layout --------------------------------------------------------------------
    def quantized(self, p: torch.Tensor) -> bool:
        return self.quant is not None and p.numel() >= self.quant.min_size

    def _init_slot(self, slot: Slot, p: torch.Tensor):
        if slot.per_leaf:  # one value per leaf, in the compute dtype (never 8 or 16 bits)
            value = 0.0 if slot.init is None else self.rule.hparams[slot.init]
            return torch.full((), float(value), dtype=state_dtype(p), device=p.device)
        if slot.from_params:  # (never stored in 8 or 16 bits unless asked: see Slot)
            return p.detach().to(slot.dtype or state_dtype(p), copy=True)
        value = 0.0 if slot.init is None else self.rule.hparams[slot.init]
        x = torch.full_like(p, float(value), dtype=state_dtype(p))
        return stored_slot(x, slot.signed, self.quant if self.quantized(p) else None,
                           self.store)

    def init(self, params):
        paths, flat, spec = tree_lib.flatten_with_paths(params)
        if self.rule.slots or self.rule.counted or self.rule.running:
            for path, p in zip(paths, flat):
                check_param(path, p)
        values = {}
        device = tree_lib.state_device(flat)
        if self.rule.counted:
            values["count"] = new_count(0, device)  # (the first step reads no device)
        wide = bool(flat) and all(p.dtype == torch.float64 for p in flat)
        values.update(initial_running(self.rule, device,
                                      torch.float64 if wide else torch.float32))
        for slot in self.rule.slots:
            leaves = [self._init_slot(slot, p) for p in flat]
            values[slot.name] = tree_lib.unflatten(spec, leaves)
        return self.rule.state_class(**values)

    def _read_slot(self, slot: Slot, leaf, p_like: torch.Tensor) -> torch.Tensor:
        return read_slot(leaf, slot.signed, self.quant, p_like)

    def _write_slot(self, slot: Slot, old_leaf, new: torch.Tensor, mask):
        return write_slot(old_leaf, new, slot.signed, self.quant, mask)

    # -- update --------------------------------------------------------------------------
    def update(self, updates, state, params=None, *, zero_mask=None, **extra):
        if zero_mask is not None:  # inside a skip_zeros chain
            return self._update(updates, state, params, zero_mask)
        return dispatch.update_entry(self, updates, state, params, extra,
                                     lambda: self._update(updates, state, params, None))

    def _update(self, updates, state, params, zero_mask):
        rule = self.rule
        check_state_class(rule, state)
        spec = optree.tree_structure(updates, none_is_leaf=True, namespace="ftopt")
        paths = [tree_lib.path_str(p) for p in optree.tree_paths(
            updates, none_is_leaf=True, namespace="ftopt")]
        u_flat = spec.flatten_up_to(updates)
        p_flat = self._flatten_params(spec, params, paths, updates)
        slots_flat = {
            s.name: tree_lib.flatten_like(spec, getattr(state, s.name), f"state {s.name}", paths)
            for s in rule.slots
        }
        mask_flat = (
            tree_lib.flatten_like(spec, zero_mask, "zero_mask", paths)
            if zero_mask is not None else [None] * len(u_flat)
        )
        active = self._active_leaves(u_flat, p_flat, slots_flat, paths, params)
        count, new_count, t = self._advance_count(state)
        carried, running = None, {}
        if rule.running:
            check_running(rule, state)
            carried, running = running_step(
                rule, count, t, {name: getattr(state, name) for name in rule.running})
        new_u = _passed_through(u_flat, mask_flat, active)
        new_slots = {name: list(leaves) for name, leaves in slots_flat.items()}
        if active:
            # On shards, a norm's all-reduce is told whose squares it sums.
            with (shards.norm_leaves([paths[i] for i in active])
                  if shards.in_local_shards() else contextlib.nullcontext()):
                self._run(active, u_flat, p_flat, slots_flat, mask_flat, count, t, new_u,
                          new_slots, carried, paths, running)
        values = {name: tree_lib.unflatten(spec, leaves) for name, leaves in new_slots.items()}
        for name in rule.running:  # (written by the body: kept where no leaf ran)
            if name not in running:
                running[name] = getattr(state, name).clone()
        values.update(running)
        if rule.counted:
            values["count"] = new_count
        return tree_lib.unflatten(spec, new_u), rule.state_class(**values)

    def _flatten_params(self, spec, params, paths, updates):
        if params is None:
            if self.rule.uses_params:
                raise ValueError(f"{self.rule.name} needs params: call update(updates, "
                                 "state, params)")
            return [None] * spec.num_leaves
        return flatten_params_like(spec, params, paths, updates)

    def _active_leaves(self, u_flat, p_flat, slots_flat, paths, params) -> list[int]:
        leaf_mask = self._leaf_mask(params, len(u_flat), paths)
        active = []
        for i, u in enumerate(u_flat):
            if u is None:
                continue
            check_leaf(paths[i], u, p_flat[i], params is not None)
            check_slots(self, paths[i], u, p_flat[i], {n: v[i] for n, v in slots_flat.items()})
            if leaf_mask is None or leaf_mask[i]:
                active.append(i)
        return active

    def _leaf_mask(self, params, n: int, paths) -> list[bool] | None:
        mask = self.rule.leaf_mask
        if mask is None:
            return None
        if callable(mask):
            if params is None:
                raise ValueError(f"{self.rule.name}: a callable mask needs params")
            mask = mask(params)
        spec = optree.tree_structure(
            optree.tree_map(lambda _: 0, params, none_is_leaf=True, namespace="ftopt")
            if params is not None else [0] * n, none_is_leaf=True, namespace="ftopt")
        flat = tree_lib.flatten_like(spec, mask, "mask", paths)
        return [bool(m) for m in flat]

    def _advance_count(self, state):
        if not self.rule.counted:
            return None, None, None
        count = state.count
        check_count(self.rule.name, count)
        new_count = count + 1
        known = eager.known_count(count)
        if known is None:
            return count, new_count, new_count
        remember_count(new_count, known + 1)
        return known, new_count, known + 1

    def _run(self, active, u_flat, p_flat, slots_flat, mask_flat, count, t, new_u, new_slots,
             carried=None, paths=None, running=None):
        rule = self.rule
        us = [u_flat[i] for i in active]
        ps = [p_flat[i] for i in active] if rule.uses_params else []
        scalars = step_scalars(rule, count, t, carried)
        if rule.running and us:
            scalars = as_host_numbers(scalars, compute_dtype(us[0]))
        # A tensor hyperparameter that requires grad (a meta-gradient) makes it autograd's.
        mode = eager.choose_mode(us + ps + [v for v in scalars.values()
                                            if isinstance(v, torch.Tensor)])
        old = {}
        for slot in rule.slots:
            old[slot.name] = [
                self._read_slot(slot, slots_flat[slot.name][i], u_flat[i]) for i in active
            ]
        masks = [mask_flat[i] for i in active]
        result = None
        if mode == "foreach":
            chunked = dispatch.backend("chunked")
            if chunked is not None:
                result = chunked.evaluate(rule, us, ps, old, masks, scalars)
        if result is None:
            starts = ([shards.element_offset(paths[i], rule.name) for i in active]
                      if rule.indexed and paths is not None else None)
            result = _run_vec(rule, mode, us, ps, old, masks, scalars, active, starts)
        u_items, slot_items = result[:2]
        if running is not None and len(result) > 2:  # (running scalars the body wrote)
            for name, value in result[2].items():
                old_value = getattr_running(carried, name)
                running[name] = value.to(running_dtype(old_value))
        for j, i in enumerate(active):
            # A value the body made from float64 per-step scalars alone (a device count's),
            # broadcast to the leaf, is float64: updates are in the leaf's compute dtype.
            want = compute_dtype(us[j])
            new_u[i] = u_items[j] if u_items[j].dtype == want else u_items[j].to(want)
        for slot in rule.slots:
            for j, i in enumerate(active):
                new_slots[slot.name][i] = self._write_slot(
                    slot, slots_flat[slot.name][i], slot_items[slot.name][j], masks[j])


def flatten_params_like(spec, params, paths, updates) -> list:
    """The leaves of ``params`` at the leaves of the updates' ``spec`` (``None`` leaves
    included). Where the trees differ, the params are the reference: the error names what
    is wrong with the updates (gradients) first, then what is wrong with the params."""
    try:
        return spec.flatten_up_to(params)
    except (ValueError, TypeError):
        pass
    p_paths, _, p_spec = tree_lib.flatten_with_paths(params)
    for path, u in zip(p_paths, tree_lib.flatten_like(p_spec, updates, "updates", p_paths)):
        if u is not None and not isinstance(u, torch.Tensor):
            raise TypeError(f"update at {path}: expected a tensor or None, got "
                            f"{type(u).__name__}")
    return tree_lib.flatten_like(spec, params, "params", paths, against="updates")


def _passed_through(u_flat: list, mask_flat: list, active: list[int]) -> list:
    """The updates of leaves a leaf mask leaves out: unchanged, in their own dtype (as
    ``masked``'s others, and as the fused path returns a leaf no position applies to),
    ``-0.0`` where a ``skip_zeros`` mask says the gradient is zero (so ``p + u`` keeps
    ``p``, ``-0.0`` too)."""
    out = list(u_flat)
    kept = set(active)
    for i, u in enumerate(u_flat):
        if u is None or i in kept:
            continue
        if mask_flat[i] is not None:
            u = program.skip_update(u, mask_flat[i])
        out[i] = u
    return out


def _run_vec(rule: Rule, mode: str, us, ps, old: dict, masks: list, scalars: dict,
             leaves: list[int], starts: list[int] | None = None):
    """The body on :class:`eager.Vec` values over whole leaves: the updates and the new
    slots (in the compute dtype), zero-gradient elements masked (the one-stage case of
    :func:`ftopt.program.trace_chain`). ``leaves``: each one's position in the tree;
    ``starts``: where each one's elements start in its full tensor (a shard's offset, read
    by indexed rules; ``None``: 0)."""
    algebra = _VecAlgebra(rule, mode, us, ps, old, masks, scalars, leaves, starts)
    g = eager.elem([u.to(compute_dtype(u)) for u in us], mode)
    u = program.trace_chain([rule], [masks[0] is not None], algebra, g)
    return _as_elem_items(u, us), algebra.slots, algebra.running


class _VecAlgebra:
    """Tensors per leaf (:class:`eager.Vec`) for :func:`ftopt.program.trace_chain`."""

    def __init__(self, rule: Rule, mode: str, us, ps, old: dict, masks: list, scalars: dict,
                 leaves: list[int], starts: list[int] | None = None):
        self.rule, self.mode, self.us, self.ps, self.old = rule, mode, us, ps, old
        self.masks, self.scalars, self.leaves = masks, scalars, leaves
        self.starts = starts or [0] * len(us)
        self._ops = eager.EagerOps(mode)
        self.slots: dict[str, list] = {}
        self.running: dict[str, torch.Tensor] = {}

    def ops(self):
        return self._ops

    def zero_mask(self, g):
        return eager.elem(self.masks, self.mode)

    def neg_zero(self, g):
        return -0.0

    def select(self, mask, a, b):
        return self._ops.where(mask, a, b)

    def elem(self, value, like):
        return eager.elem(_as_elem_items(value, self.us), self.mode)

    def stage_inputs(self, index: int, rule: Rule, u) -> dict:
        per_leaf = {s.name for s in rule.slots if s.per_leaf}
        inputs = {name: (eager.leafwise if name in per_leaf else eager.elem)(leaves, self.mode)
                  for name, leaves in self.old.items()}
        if rule.uses_params:
            inputs["p"] = eager.elem([p.to(compute_dtype(p)) for p in self.ps], self.mode)
        if rule.indexed:
            inputs["index"] = eager.elem([element_index(u, start) for u, start in
                                          zip(self.us, self.starts)], self.mode)
            inputs["leaf"] = eager.leafwise(self.leaves, self.mode)
        inputs.update({k: eager.scalar(v, self.mode) for k, v in self.scalars.items()})
        return inputs

    def leaf_flag(self, index: int):
        return None  # (leaves a mask leaves out are not among the active ones)

    def running_out(self, index: int, name: str, value) -> None:
        item = value.items[0] if isinstance(value, eager.Vec) else value
        # (In its own dtype, at least fp32: the caller stores it in the old value's.)
        item = torch.as_tensor(item, device=self.us[0].device)
        self.running[name] = item.to(torch.promote_types(item.dtype, torch.float32))

    def slot_out(self, index: int, name: str, value) -> None:
        if any(s.per_leaf and s.name == name for s in self.rule.slots):
            self.slots[name] = _as_leaf_items(value, self.us)
            return
        self.slots[name] = _as_elem_items(value, self.us)


def getattr_running(carried: dict | None, name: str):
    """The old value of running scalar ``name`` as the body read it (``carried``)."""
    return None if carried is None else carried.get(name)


def element_index(u: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Each element's row-major position in its leaf, plus ``start`` (where a shard's
    elements start in the full tensor), modulo 2**32 as the kernels' uint32 (int64,
    shaped like ``u``)."""
    index = torch.arange(start, start + u.numel(), dtype=torch.int64, device=u.device)
    return (index & 0xFFFFFFFF).view(u.shape)


def _as_elem_items(value, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """The per-leaf tensors of a body result, broadcast to each leaf's shape."""
    if not isinstance(value, eager.Vec):
        value = eager.Vec("scalar", [value], "loop")
    items = value.items * len(like) if value.kind == "scalar" else value.items
    out = []
    for x, ref in zip(items, like):
        if not isinstance(x, torch.Tensor) or x.shape != ref.shape:
            x = torch.as_tensor(x, dtype=compute_dtype(ref), device=ref.device)
            x = x.expand(ref.shape).clone()
        out.append(x)
    return out


def _as_leaf_items(value, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """The per-leaf values of a body result (a per-leaf slot), as 0-d tensors."""
    if not isinstance(value, eager.Vec):
        value = eager.Vec("scalar", [value], "loop")
    items = value.items * len(like) if value.kind == "scalar" else value.items
    return [torch.as_tensor(x, dtype=compute_dtype(ref), device=ref.device)
            for x, ref in zip(items, like)]


def stored_slot(x: torch.Tensor, signed: bool, quant: QuantConfig | None,
                store: torch.dtype | None):
    """The first stored value of a per-element state ``x`` (in the compute dtype): 8-bit
    blockwise codes where ``quant`` is given (the leaf is at least ``min_size``; the
    signed or unsigned map), else ``x`` in ``store`` (``None``: as it is)."""
    if quant is not None:
        qmap = dynamic_map(signed, x.device)
        if is_dtensor(x):  # blocks of the full tensor's flat layout, on each shard
            return dispatch.backend("distributed").quantize_shards(x, qmap, quant.block_size)
        return QuantizedSlot(*quantize_blockwise(x.float(), qmap, quant.block_size))
    return x if store is None else x.to(store)


def read_slot(leaf, signed: bool, quant: QuantConfig | None,
              p_like: torch.Tensor) -> torch.Tensor:
    """A stored per-element state as a tensor for the math: 8-bit codes dequantized (fp32),
    16-bit storage read in the compute dtype of ``p_like``, anything else as it is."""
    if isinstance(leaf, QuantizedSlot):
        qmap = dynamic_map(signed, leaf.codes.device)
        return dequantize_blockwise(leaf.codes, leaf.absmax, qmap, quant.block_size)
    if leaf.dtype in (torch.float16, torch.bfloat16):  # read in the compute dtype
        return leaf.to(compute_dtype(p_like))
    return leaf


def write_slot(old_leaf, new: torch.Tensor, signed: bool, quant: QuantConfig | None, mask):
    """``new`` stored as ``old_leaf`` is: re-encoded per block (SPEC §5) if it is 8-bit,
    where a block whose gradients are all zero (``mask``, skip_zeros) keeps its bytes;
    else rounded once to the old leaf's dtype."""
    if not isinstance(old_leaf, QuantizedSlot):
        out = new.to(old_leaf.dtype)  # one rounding (to nearest) per store
        return keep_nan_bits(old_leaf, out) if out.element_size() == 2 else out
    qmap = dynamic_map(signed, new.device)
    codes, absmax = quantize_blockwise(new.float(), qmap, quant.block_size)
    if mask is not None:
        # A block whose gradients are all zero keeps its bytes.
        codes, absmax = _keep_skipped_blocks(old_leaf, codes, absmax, mask, quant)
    return QuantizedSlot(codes, absmax)


def _keep_skipped_blocks(old: QuantizedSlot, codes, absmax, mask, quant: QuantConfig):
    n = mask.numel()
    nblocks = absmax.numel()
    pad = nblocks * quant.block_size - n
    flat_mask = mask.reshape(-1)
    if pad:
        flat_mask = torch.cat([flat_mask, flat_mask.new_ones(pad)])
    block_skipped = flat_mask.view(nblocks, quant.block_size).all(dim=1)
    absmax = torch.where(block_skipped, old.absmax, absmax)
    elem_skipped = block_skipped.repeat_interleave(quant.block_size)[:n].view(codes.shape)
    codes = torch.where(elem_skipped, old.codes, codes)
    return codes, absmax


def rule_transform(rule: Rule) -> GradientTransformation:
    """The ``GradientTransformation`` of ``rule`` with 32-bit state."""
    return RuleTransform(rule).as_transform()

