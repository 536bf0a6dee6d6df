"""``explain``: what a step of a chain will do, per (device, dtype) group, and why."""

from __future__ import annotations

import math
from typing import Any

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ftopt import tree as tree_lib
from ftopt.base import GradientTransformation, check_transform
from ftopt.combine import Masked, Partition, owner
from ftopt.lowering import branches, knobs, runs, tiles
from ftopt.lowering.codegen import level_reductions, main_nodes
from ftopt.lowering.explain_skip import skip_line, skip_used
from ftopt.lowering.plan import (
    _DTYPE_BYTES,
    ChainPlan,
    call_reason,
    describe_segments,
    plan_chain,
)
from ftopt.lowering.roles import elided_slots
from ftopt.rules import QuantizedSlot, initial_running, running_step
from ftopt.validate import check_leaf

_BACKENDS = ("auto", "fused", "eager")

__all__ = ["explain"]


def _reduction_reads(traced, level: int, sizes: tuple) -> float:
    """Bytes per element the norm pass of ``level`` reads: what its sums need, each slot
    at its stored size (8-bit: a code and its share of the block's absmax)."""
    p_bytes, g_bytes, slot_bytes = sizes
    roots = [r.source for r in level_reductions(traced, level)]
    names = {n.name for n in traced.graph.closure(roots)}
    total = (g_bytes if "g" in names else 0) + (p_bytes if "p" in names else 0)
    total += sum(_slot_bytes(slot, slot_bytes) for k, slot in _traced_slots(traced)
                 if f"st{k}_{slot.name}_old" in names)
    return total


def _traced_slots(traced) -> list:
    """``(position, slot)`` of every slot the kernels of ``traced`` reach."""
    return [(k, slot) for k, pos in enumerate(traced.positions)
            for slot in traced.stages[pos[0]].rule.slots]


def explain(tx: GradientTransformation, params: Any, grads: Any = None, *,
            donate: bool = False, backend: str = "auto", bandwidth: float | None = None,
            file: Any = None) -> str:
    """Prints (and returns) the plan of ``ftopt.step(tx, params, grads, state,
    donate=donate, backend=backend)``.

    Per group of leaves sharing (device, param dtype, grad dtype): the path (fused or
    eager) and the reason, kernel launches per step, bytes read and written per element,
    and the torch ops on 0-d tensors of running scalars (Schedule-Free's). ``grads``
    defaults to gradients shaped and typed like the params. Pass the ``donate`` of the
    step you mean: a donated step writes in place and is never differentiable, so params
    that require grad (``dict(model.named_parameters())``) fuse with ``donate=True`` (as
    :class:`ftopt.Optimizer` steps) but not without.

    Every group also reports its state bytes per parameter (from ``tx.init`` on meta
    tensors: nothing is allocated) and the bytes a step moves: the fused kernels' reads
    and writes, or for an eager group the least any implementation must move (params and
    states read and written once, gradients read once). ``bandwidth``: the device's
    measured copy bandwidth in GB/s (1e9 bytes per second, e.g. from a timed
    ``torch.Tensor.copy_``); given, each group also shows the floor time of its step at
    that bandwidth.
    """
    check_transform(tx, "explain: argument tx")
    if bandwidth is not None and not (isinstance(bandwidth, (int, float))
                                      and math.isfinite(bandwidth) and bandwidth > 0):
        raise ValueError(f"explain: bandwidth must be a positive number of GB/s, got "
                         f"{bandwidth!r}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    wrapper = owner(tx)
    if hasattr(wrapper, "stepped_inner"):
        # A wrapper whose step is its inner transform's (inject_hyperparams): that plan.
        first = next(iter(tree_lib.leaves(params)), None)
        inner = wrapper.stepped_inner(first.device if isinstance(first, torch.Tensor)
                                      else torch.device("cpu"))
        text = explain(inner, params, grads, donate=donate, backend=backend,
                       bandwidth=bandwidth, file=_Discard())
        text = f"{wrapper.step_note}\n{text}"
        print(text, file=file)
        return text
    paths, p_flat, spec = tree_lib.flatten_with_paths(params)
    g_flat = (tree_lib.flatten_like(spec, grads, "grads", paths) if grads is not None
              else list(p_flat))
    active = [i for i, g in enumerate(g_flat) if g is not None]
    for i in active:  # what step would raise, named the same way
        check_leaf(paths[i], g_flat[i], p_flat[i])
    plan = plan_chain(tx)
    held, shared = state_bytes(tx, params, spec, p_flat)
    reason = call_reason(plan, p_flat, g_flat, active, backend, donate=bool(donate),
                         paths=paths) if backend != "eager" \
        else "backend='eager' was asked for"
    shown = plan.position_stages()
    lines = [("ftopt plan (donated step)" if donate else "ftopt plan")
             + f": {len(shown)} elementwise stages"
             + (f" ({', '.join(s.rule.name for s in shown)})" if shown else "")
             + (", skip_zeros" if any(plan.skips) else "")
             + (f"; {shared} bytes of state shared by all leaves (counts, scalars)"
                if shared else "")]
    if plan.branched and plan.reason is None:
        lines.append(_describe_branches(plan))
    if plan.segments is not None:
        lines.append(f"segments: {describe_segments(plan)}")
    quant = next((s.quant for s in plan.stages if s.quant is not None and s.rule.slots), None)
    parts = plan.segments if plan.segments is not None else [plan]
    runs = _runs(plan, spec, params, p_flat, g_flat, paths) if (
        reason is None and active) else None
    groups: dict[tuple, list[int]] = {}
    for i in active:
        eight_bit = quant is not None and p_flat[i].numel() >= quant.min_size
        key = (p_flat[i].device, p_flat[i].dtype, g_flat[i].dtype, eight_bit)
        groups.setdefault(key, []).append(i)
    for (device, p_dtype, g_dtype, eight_bit), leaves in groups.items():
        numel = sum(p_flat[i].numel() for i in leaves)
        store = next((s.store for s in plan.stages if s.store is not None and s.rule.slots),
                     None)
        slot_size = 2 if store in (torch.bfloat16, torch.float16) else 4
        layout = (f"8-bit states (block {quant.block_size})" if eight_bit else
                  f"{_name(store)} states" if slot_size == 2 else "32-bit states")
        head = (f"group device={device} param={_name(p_dtype)} grad={_name(g_dtype)} "
                f"{layout}: {len(leaves)} leaves, {numel} elements")
        lines.append(head)
        per_param = sum(held[i] for i in leaves) / max(numel, 1)
        lines.append(f"  state bytes per parameter: {_num(per_param)}")
        if reason is not None:
            lines.append(f"  path: eager ({reason})")
            least = (2 * p_dtype.itemsize + g_dtype.itemsize + 2 * per_param) * numel
            lines.append(_moved("  bytes moved per step: at least", least, bandwidth))
            continue
        sizes = (_DTYPE_BYTES[p_dtype], _DTYPE_BYTES[g_dtype],
                 1 + 4 / quant.block_size if eight_bit else slot_size)
        kernels = [k for k, part in enumerate(parts) if isinstance(part, ChainPlan)]
        read = written = extra = levels = 0.0
        # (As the step traces the group: donated, a slot returned unchanged is not stored.)
        skip_lanes = tiles.skip_mode(p_dtype, quant.block_size if eight_bit else 0,
                                     ((None, store),) if slot_size == 2 else ())[0]
        for k in kernels:
            traced = parts[k].traced(donate=bool(donate), skip_lanes=skip_lanes,
                                     output="p" if k == kernels[-1] else "u")
            r, w, x = _kernel_bytes(parts[k], traced, runs[k], leaves, p_flat, sizes,
                                    eight_bit)
            read, written, extra = read + r, written + w, extra + x
            levels += traced.levels
        quant_block = quant.block_size if eight_bit else 0
        slot_dtypes = ((None, store),) if slot_size == 2 else ()
        skip = (skip_used(traced, p_dtype, quant_block, slot_dtypes)
                if donate and any(plan.skips) else None)
        deferred = int(skip is not None and "defer" in skip[1])
        launches = len(kernels) + 2 * int(levels) + deferred
        lines.append("  path: fused (one Triton kernel over all leaves of the group"
                     + (" per segment)" if plan.segments is not None else ")"))
        if plan.segments is not None:
            lines += _where(parts, runs, leaves, p_flat)
        lines.append(f"  kernel launches per step: {launches} "
                     f"({int(levels)} norm pass(es) + {len(kernels)} main"
                     + (" + 1 for skipped blocks, donated)" if deferred else ")"))
        if skip is not None:
            lines.append(skip_line(*skip))
        if tiles.fast_math(p_dtype, quant_block, slot_dtypes):
            lines.append("  square root and division: the GPU's approximate ones "
                         + ("in the update, the 8-bit encoder's exact " if quant_block
                            else "") + "(FTOPT_FAST_MATH)")
        main = ("main kernel reads {}, writes {}" if len(kernels) == 1 else
                "main kernels read {}, write {}").format(_num(read), _num(written))
        lines.append(f"  bytes per element: {main}"
                     + (f"; norm passes read {_num(extra)} more" if extra else ""))
        lines.append(_moved("  bytes moved per step:", (read + written + extra) * numel,
                            bandwidth))
        if plan.running:
            lines.append(f"  running scalars: {_running_ops(plan)} torch ops a step on 0-d "
                         "tensors and a stack of the kernel's scalars (no host read)")
    if not groups:
        lines.append("no leaf has a gradient: nothing to do")
    if settings := knobs.set_here():
        lines.append("fused backend settings from the environment (python -m ftopt.lowering): "
                     + ", ".join(f"{k}={v!r}" for k, v in settings.items()))
    text = "\n".join(lines)
    print(text, file=file)
    return text


_HOST_OPS = ("lift_fresh", "scalar_tensor")


def _running_ops(plan) -> int:
    """The torch ops (device kernels on a GPU) one step of the plan's running scalars
    runs, counted on CPU values of a new state (views and the donated write-back of a
    value onto itself excluded)."""
    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # (A Python number in an op becomes a host 0-d tensor: no device kernel.)
            Count.ops += not (func.is_view or func.overloadpacket.__name__ in _HOST_OPS)
            return func(*args, **(kwargs or {}))

    for stage in plan.stages:
        if stage.rule.running:
            old = initial_running(stage.rule)
            with Count():
                _, new = running_step(stage.rule, 0, 1, old)
            Count.ops += sum(new[k] is not old[k] for k in new)  # (written back when donated)
    return Count.ops


class _Discard:
    """A file that drops what is written to it."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def _runs(plan: ChainPlan, spec, params, p_flat, g_flat, paths) -> list:
    """Per part of the plan (the plan itself if it has no segments), the leaves it runs
    on, as :func:`ftopt.lowering.runs.leaves_of` gives them."""
    if plan.segments is not None:
        return runs.leaves_of(plan, spec, params, p_flat, g_flat, paths)
    selection = (branches.select(plan, spec, params, p_flat, paths) if plan.branched
                 else None)
    on = [g is not None for g in g_flat]
    return [(selection, on, [False] * len(g_flat))]


def _kernel_bytes(part: ChainPlan, traced, run, leaves, p_flat, sizes,
                  quantized: bool) -> tuple:
    """(read, written, read by norm passes) bytes of a main kernel per element of the
    group: what the kernel loads and stores, each leaf counted with the slots of the
    stages it runs (a flag turns the others off) and its ``x`` read where it is seeded.
    A slot the kernel does not load (nor its stores need) or does not store (a donated
    step's slot the body returns unchanged) is not counted."""
    selection, on, seeded = run
    p_bytes, g_bytes, slot_bytes = sizes
    names = {n.name for n in main_nodes(traced, quantized)}
    elided = elided_slots(traced, quantized)
    numel = sum(p_flat[i].numel() for i in leaves)
    read = written = 0.0
    for i in leaves:
        if not on[i]:
            continue
        slots = (_traced_slots(traced) if selection is None or not part.branched else
                 [(k, slot) for k, owners in enumerate(selection.stage_of)
                  if owners[i] is not None for slot in part.stages[owners[i]].rule.slots])
        share = p_flat[i].numel() / numel
        loaded = sum(_slot_bytes(slot, slot_bytes) for k, slot in slots
                     if f"st{k}_{slot.name}_old" in names)
        stored = sum(_slot_bytes(slot, slot_bytes) for k, slot in slots
                     if f"st{k}_{slot.name}" not in elided)
        read += share * (g_bytes + (p_bytes if "p" in names else 0) + loaded
                         + (4 if seeded[i] else 0))
        written += share * ((p_bytes if traced.output == "p" else 4) + stored)
    extra = sum(_reduction_reads(traced, lv, sizes) for lv in range(1, traced.levels + 1))
    return read, written, extra


def _slot_bytes(slot, stored: float) -> float:
    """Bytes per element of a slot the kernel reads (or writes): ``stored`` (the group's
    8-bit or 16-bit layout) but for a copy of the params (``Slot.from_params``), which
    keeps fp32 or the dtype it was given, and a per-leaf slot (one fp32 per leaf, not per
    element: 0 here)."""
    if slot.per_leaf:
        return 0
    if slot.from_params:
        return 4 if slot.dtype is None else slot.dtype.itemsize
    return stored


def _where(parts: list, runs: list, leaves: list, p_flat) -> list[str]:
    """What each part of a segmented plan runs on, in the group's leaves."""
    out = []
    number = 0
    for part, run in zip(parts, runs):
        if isinstance(part, ChainPlan):
            number += 1
            _, on, seeded = run
            mine = [i for i in leaves if on[i]]
            names = ", ".join(s.rule.name for s in part.position_stages()) or "p + u"
            fed = sum(1 for i in mine if seeded[i])
            source = ("" if not mine else f"; input: the previous part's output "
                      f"({fed} leaves), the raw gradient ({len(mine) - fed})")
            out.append(f"  segment {number} [{names}]: {_count(mine, p_flat)}{source}")
            continue
        mine = [i for i in leaves if run[i]]
        applies = getattr(part[0], "applies", None)
        shapes = {tuple(p_flat[i].shape) for i in mine if applies is None or applies(
            p_flat[i])}
        out.append(f"  {part[0].name} (torch): {_count(mine, p_flat)}, {len(shapes)} "
                   f"shape(s), one batched call per shape")
    return out


def _count(mine: list, p_flat) -> str:
    return f"{len(mine)} leaves, {sum(p_flat[i].numel() for i in mine)} elements"


def _describe_branches(plan) -> str:
    """How ``masked``/``partition`` run in the one kernel: per-leaf branch and flags."""
    parts = []
    widest = max(pos for pos in plan.positions if len(pos) > 1) if any(
        len(pos) > 1 for pos in plan.positions) else None
    if widest is not None:
        labels = [plan.selects[s][-1].label for s in widest]
        parts.append(f"partition branches {labels} are the same chain of rules: one "
                     "program, each leaf reads its branch's hyperparameters (a per-leaf "
                     "row), no launch per branch")
    classes = _rule_classes(plan)
    if len(classes) > 1:
        parts.append(f"partition branches {classes} differ in their rules: their stages "
                     "follow one another in the one kernel, each leaf runs its own "
                     "branch's (a per-leaf flag passes it through the others and turns "
                     "their state loads and stores off), no launch per branch")
    masked = [plan.stages[pos[0]].rule.name for k, pos in enumerate(plan.positions)
              if plan.flagged[k] and any(plan.stages[s].rule.leaf_mask is not None or any(
                  isinstance(c.owner, Masked) for c in plan.selects[s]) for s in pos)]
    if masked:
        parts.append(f"flagged stages {masked}: a per-leaf flag passes the leaves they "
                     "leave out through, with no state read or written for them")
    return "branches: " + "; ".join(parts)


def _rule_classes(plan) -> list:
    """The label sets of the partition branch classes (the same chain of rules), in
    program order."""
    classes: list = []
    for pos in plan.positions:
        labels = [c.label for s in pos for c in plan.selects[s]
                  if isinstance(c.owner, Partition)]
        if labels and labels not in classes:
            classes.append(labels)
    return classes


def _moved(head: str, total: float, bandwidth: float | None) -> str:
    line = f"{head} {int(round(total))} ({total / 1e6:.3f} MB)"
    if bandwidth is not None:
        line += f"; floor time at {_num(bandwidth)} GB/s: {total / bandwidth / 1e6:.4g} ms"
    return line


def state_bytes(tx: GradientTransformation, params: Any, spec, p_flat: list
                ) -> tuple[list[int], int]:
    """(bytes of state each param leaf holds, bytes held by no leaf), from ``tx.init`` on
    meta tensors. A state node whose structure is the params' with a tensor (or an 8-bit
    slot) or ``None`` at each leaf belongs leaf by leaf to the params; the rest (step
    counts, running scalars) is shared."""
    meta = tree_lib.unflatten(spec, [torch.empty(p.shape, dtype=p.dtype, device="meta")
                                     for p in p_flat])
    state = tx.init(meta)
    held = [0] * len(p_flat)
    shared = 0

    def size(x: Any) -> int:
        return sum(t.numel() * t.element_size() for t in tree_lib.leaves(x)
                   if isinstance(t, torch.Tensor))

    def walk(node: Any) -> None:
        nonlocal shared
        if node is None:
            return
        if spec.num_nodes == 1 or type(node) is spec.type:
            flat = _aligned(spec, node)
            if flat is not None:
                for i, x in enumerate(flat):
                    held[i] += size(x)
                return
        if isinstance(node, (torch.Tensor, QuantizedSlot)):
            shared += size(node)
            return
        children = optree.tree_flatten(node, is_leaf=lambda x: x is not node,
                                       none_is_leaf=False, namespace="ftopt")[0]
        for child in children:
            walk(child)

    walk(state)
    return held, shared


def _aligned(spec, node: Any) -> list | None:
    """``node`` flattened up to the params' structure, when each entry is a per-leaf
    state (a tensor, an 8-bit slot or ``None``); else ``None``."""
    if spec.num_nodes == 1:  # params that are one tensor: its own states are tensors
        is_own = isinstance(node, QuantizedSlot) or (
            isinstance(node, torch.Tensor) and node.dim() > 0)
        return [node] if is_own else None
    try:
        flat = spec.flatten_up_to(node)
    except (ValueError, TypeError):
        return None
    ok = all(x is None or isinstance(x, (torch.Tensor, QuantizedSlot)) for x in flat)
    return flat if ok else None


def _num(x: float) -> float | int:
    x = round(x, 3)
    return int(x) if x == int(x) else x


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
