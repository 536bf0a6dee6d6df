"""The planner: a chain becomes fused groups, or runs eagerly with a stated reason.

``plan_chain`` walks the transform objects once (cached per transform) and finds the
rule of every stage and where its state lives; ``call_reason`` and ``slot_reason`` check
the per-call conditions (device, dtypes, autograd, ``torch.func``, state layouts).
:mod:`ftopt.lowering.entry` runs the kernels.
"""

from __future__ import annotations

import contextvars
import os
import weakref
from dataclasses import dataclass, field

import torch

from ftopt import eager
from ftopt._counts import device_decided, host_count, remember_count
from ftopt.combine import owner
from ftopt.lowering import tiles
from ftopt.lowering.codegen import trace_chain
from ftopt.lowering.devices import unsupported as device_unsupported
from ftopt.rule_transform import RuleTransform
from ftopt.rules import QuantizedSlot, hparams_require_grad, step_scalars
from ftopt.stages import chain_stages, state_at

FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DTYPE_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


@dataclass
class ChainPlan:
    """The fusible structure of a transform, or why it has none."""

    stages: list[RuleTransform] = field(default_factory=list)
    state_paths: list[tuple] = field(default_factory=list)
    skips: list[bool] = field(default_factory=list)
    reason: str | None = None
    prepared: object = None  # the last donated step's tables (see execute.PreparedStep)
    tensor_hparams: bool | None = None  # a hyperparameter is a tensor (known once asked)
    running: bool = False  # a stage keeps running scalars (Rule.running)
    constant_hparams: list | None = None  # per stage: its hparams if constant (see execute)
    # Where the hyperparameters are tensors: what lowering.scalars reads through their host
    # mirrors, and the last step's values and hparams (see _mirrored_hparams there).
    mirrored: list | None = None
    # The host numbers among the scalars of a step that also has device scalars, as
    # device values kept while they stay the same: ((numbers, device), tensors).
    host_scalars: tuple | None = None
    functional: dict = field(default_factory=dict)  # see lowering.functional
    # A chain with matrix stages: its parts in order, each a ChainPlan of the rules
    # between two matrix stages or a (matrix stage, skip, state path, selects) tuple
    # (``selects``: the leaves it applies to, inside masked/partition; see
    # lowering.segments).
    segments: list | None = None
    # A segment after a matrix stage: its input is not the gradient (True), or not for
    # every leaf ("mixed": a per-leaf flag picks the input; set per call by
    # lowering.segments).
    seeded: bool | str = False
    # ``masked``/``partition`` (see :class:`ftopt.stages.Stages`): the stages that are
    # alternatives at each step of the program, each stage's leaf conditions, and the
    # positions some leaves pass through. ``None``: stage ``k`` is position ``k``.
    positions: list | None = None
    selects: list | None = None
    flagged: list | None = None
    owner_skips: list | None = None  # per position (see :class:`ftopt.stages.Stages`)
    # ``inject_hyperparams`` wrappers inside the chain: (wrapper, state path, inner), see
    # :attr:`ftopt.stages.Stages.injected` and ftopt.lowering.entry.
    injected: tuple = ()
    _traced: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.positions is None:
            self.positions = [(i,) for i in range(len(self.stages))]
            self.selects = [()] * len(self.stages)
            self.flagged = [s.rule.leaf_mask is not None for s in self.stages]
        if self.owner_skips is None:
            self.owner_skips = [False] * len(self.positions)

    @property
    def branched(self) -> bool:
        """Whether a ``masked`` or ``partition`` picks each leaf's stages."""
        return any(self.selects)

    def position_stages(self) -> list:
        """The stage that stands for each position (its first alternative)."""
        return [self.stages[pos[0]] for pos in self.positions]

    def traced(self, donate: bool = False, output: str = "p", skip_lanes: bool = True):
        """The chain's graph for a step (``output="p"``) or an update (``"u"``). Donated
        (the states written over their inputs), a slot the body returns unchanged is not
        stored, and with ``skip_lanes`` a skip_zeros step may leave zero-gradient lanes
        unloaded and unstored."""
        key = (donate, output, self.seeded, donate and skip_lanes)
        if key not in self._traced:
            self._traced[key] = trace_chain(self.stages, self.skips, donate, output,
                                            self.seeded, self.positions, self.flagged,
                                            self.owner_skips, skip_lanes=skip_lanes)
        return self._traced[key]


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# Set while the outputs must not share storage (a torch.library op's returns may not
# alias each other): the cached non-donated path then writes no views of one buffer.
SEPARATE_OUTPUTS = contextvars.ContextVar("ftopt_separate_outputs", default=False)


def plan_chain(tx) -> ChainPlan:
    """The plan of ``tx`` (cached per transform object)."""
    found = chain_stages(tx, branches=True, injected=True)
    obj = owner(tx)
    plan = _PLANS.get(obj) if obj is not None else None
    if plan is None:
        plan = ChainPlan(list(found.stages), list(found.state_paths), list(found.skips),
                         found.reason, injected=found.injected)
        if found.positions:
            plan.positions, plan.selects = list(found.positions), list(found.selects)
            plan.flagged = list(found.flagged)
            plan.owner_skips = list(found.owner_skips)
        plan.running = any(s.rule.running for s in plan.stages)
        if found.segmented:
            plan.segments = _segments(found)
            plan.reason = None
        if obj is not None:
            _PLANS[obj] = plan
    return plan


def _segments(found) -> list:
    """The positions between matrix stages as sub-plans, with the matrix stages between
    (as ``(stage, skip, state path, selects)``)."""
    out: list = []
    start = 0
    selects = found.matrix_selects or ((),) * len(found.matrix)
    bounds = [(position, (stage, skip, path, sel)) for (position, stage, skip, path), sel
              in zip(found.matrix, selects)]
    for end, matrix in [*bounds, (len(found.positions), None)]:
        if end > start or matrix is None:
            part = _sub_plan(found, start, end)
            part.seeded = bool(out)
            out.append(part)
        if matrix is not None:
            out.append(matrix)
        start = end
    return out


def _sub_plan(found, start: int, end: int) -> ChainPlan:
    """The plan of positions ``start`` to ``end`` of ``found`` (stages renumbered)."""
    positions = found.positions[start:end]
    used = sorted({i for pos in positions for i in pos})
    index = {old: new for new, old in enumerate(used)}
    part = ChainPlan([found.stages[i] for i in used], [found.state_paths[i] for i in used],
                     [found.skips[i] for i in used],
                     positions=[tuple(index[i] for i in pos) for pos in positions],
                     selects=[found.selects[i] for i in used],
                     flagged=list(found.flagged[start:end]),
                     owner_skips=list(found.owner_skips[start:end]))
    part.running = any(s.rule.running for s in part.stages)
    return part


def describe_segments(plan: ChainPlan) -> str:
    """The segments in order, e.g. ``[trace] fused -> scale_by_row_norm (matrix) -> ...``."""
    items = []
    for part in plan.segments:
        if isinstance(part, ChainPlan):
            names = ", ".join(s.rule.name for s in part.stages)
            items.append(f"[{names}] fused" if names else "[p + u] fused")
        else:
            labels = [c.label for c in part[3] if c.label is not None]
            where = f" on {labels[-1]!r} leaves" if labels else (
                " on masked leaves" if part[3] else "")
            how = getattr(part[0], "how", "torch, leaves batched by shape")
            items.append(f"{part[0].name} (matrix stage{where}: {how})")
    return " -> ".join(items)


def triton_missing() -> str | None:
    """Why Triton cannot be used here (``None`` if it can)."""
    try:
        import triton  # noqa: F401
    except ImportError as err:
        return (f"Triton cannot be imported ({err}); for fused steps on a GPU: pip install "
                "'ftopt[gpu]' (CUDA, ROCm and XPU builds of torch ship it)")
    if _interpreting():
        try:
            import numpy  # noqa: F401
        except ImportError:
            return "the Triton interpreter (TRITON_INTERPRET=1) needs numpy"
    return None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def call_reason(plan: ChainPlan, p_flat, g_flat, active, backend: str,
                grads_too: bool = False, donate: bool = False,
                paths: list[str] | None = None) -> str | None:
    """Why this call cannot fuse (``None`` if it can), naming the first offending leaf by
    its path (``paths``, in leaf order). ``grads_too``: gradients that require grad also
    need the differentiable (eager) path. A donated step is never differentiable (it
    writes the given tensors in place on every path), so params that require grad
    (``nn.Parameter``) do not keep it from fusing."""
    if plan.reason:
        return plan.reason
    missing = triton_missing()
    if missing:
        return missing
    if eager.functorch_active():
        return "a torch.func transform (grad, vmap, ...) is active"
    where = paths if paths is not None else [f"leaf {i}" for i in range(len(p_flat))]
    tensors = [p_flat[i] for i in active]
    if not donate and torch.is_grad_enabled():
        for i in active:
            if p_flat[i].requires_grad:
                return (f"param requires grad at {where[i]} and grad mode is on "
                        "(differentiable step)")
    if not donate and torch.is_grad_enabled():
        for stage in plan.stages:
            if hparams_require_grad(stage.rule):
                return (f"a hyperparameter of {stage.rule.name} requires grad and grad "
                        "mode is on (differentiable step)")
    if grads_too and torch.is_grad_enabled():
        for i in active:
            if g_flat[i].requires_grad:
                return (f"gradient requires grad at {where[i]} and grad mode is on "
                        "(differentiable update)")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        return f"params on several devices {sorted(map(str, devices))}"
    for device in devices:
        if device.type == "cpu" and not (backend == "fused" and _interpreting()):
            return "tensors are on the CPU (set TRITON_INTERPRET=1 and backend='fused' to " \
                   "run the kernels in the Triton interpreter)"
        if device.type not in ("cpu", "cuda", "xpu"):
            return f"Triton does not target device {device.type!r}"
    for i in active:
        for name, t in (("param", p_flat[i]), ("grad", g_flat[i])):
            if t.layout != torch.strided:
                return f"{name} at {where[i]} is a sparse tensor ({t.layout})"
            if t.dtype not in FUSED_DTYPES:
                return f"{name} at {where[i]}: dtype {t.dtype} is not fp32/fp16/bf16"
            if not t.is_contiguous():
                return f"{name} at {where[i]} is not contiguous"
    for device in devices:  # last: its first call compiles a probe kernel
        reason = device_unsupported(device)
        if reason is not None:
            return reason
    return None


def fast_path_allowed(prepared, backend: str) -> bool:
    """The cached path skips the checks that cannot change between donated steps over
    the same tensors; those that can (backend, torch.func) are checked here."""
    if backend == "auto" and prepared.device.type == "cpu":
        return False
    return not eager.functorch_active()


def get_checked(state, path, stage):
    try:
        st = state_at(state, path)
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"state does not match the transform: no state at {path} for "
                         f"{stage.rule.name}") from None
    if not isinstance(st, stage.rule.state_class):
        raise ValueError(f"state at {path}: expected {stage.rule.state_class.__name__} for "
                         f"{stage.rule.name}, got {type(st).__name__}")
    return st


def slot_reason(plan: ChainPlan, slot_flat, active, paths: list[str]) -> str | None:
    """Why these states cannot be read by the kernels (``None`` if they can), naming the
    first offending leaf. Errors (a wrong kind of state) were raised before."""
    blocks = {s.quant.block_size for s in plan.stages if s.quant is not None and s.rule.slots}
    if len(blocks) > 1 or any(tiles.quant_tile(b)[0] % b for b in blocks):
        return (f"8-bit block sizes {sorted(blocks)} do not divide the kernel block "
                f"{tiles.QUANT_TILE[0]}")
    per_leaf = [{s.name for s in stage.rule.slots if s.per_leaf} for stage in plan.stages]
    # Copies of the params (Slot.from_params) are never 8-bit: an 8-bit kernel loads and
    # stores them as floats (roles.wide_slots), so they take no part in the layout.
    copies = [{s.name for s in stage.rule.slots if s.from_params} for stage in plan.stages]
    for i in active:
        layouts = set()
        for slots, own, wide in zip(slot_flat, per_leaf, copies):
            for name, leaves in slots.items():
                leaf = leaves[i]
                if leaf is None:  # (a stage of a partition branch the leaf is not in)
                    continue
                if name in own:  # (one fp32 value per leaf, whatever the layout)
                    if leaf.dtype != torch.float32:
                        return f"state {name} at {paths[i]}: dtype {leaf.dtype} is not fp32"
                    continue
                if name in wide and not isinstance(leaf, QuantizedSlot):
                    if leaf.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                        return (f"state {name} at {paths[i]}: dtype {leaf.dtype} is not "
                                "fp32, bf16 or fp16")
                    if not leaf.is_contiguous():
                        return f"state {name} at {paths[i]} is not contiguous"
                    continue
                if isinstance(leaf, QuantizedSlot):
                    layouts.add("8-bit")
                    tensors = (leaf.codes, leaf.absmax)
                    if leaf.codes.dtype != torch.uint8 or leaf.absmax.dtype != torch.float32:
                        return (f"8-bit state {name} at {paths[i]} is not uint8 codes with "
                                "fp32 absmax")
                else:
                    layouts.add("32-bit")
                    tensors = (leaf,)
                    if leaf.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                        return (f"state {name} at {paths[i]}: dtype {leaf.dtype} is not "
                                "fp32, bf16 or fp16")
                if not all(t.is_contiguous() for t in tensors):
                    return f"state {name} at {paths[i]} is not contiguous"
        if len(layouts) > 1:
            return f"the leaf at {paths[i]} mixes 8-bit and 32-bit states"
    return None


def host_step(count: torch.Tensor, tensor_mode: bool):
    """(count, t) for scalars: host ints when known or cheap to learn, else tensors (also
    for a count decided on the device, which is never read)."""
    if tensor_mode or device_decided(count):
        return count, count + 1
    known = host_count(count)
    if known is None:
        known = int(count)  # one read; the mirror keeps it from then on
    return known, known + 1


def stage_scalars(stage: RuleTransform, count, t) -> dict:
    return step_scalars(stage.rule, count, t)


def bytes_per_element(plan: ChainPlan, p_dtype: torch.dtype, g_dtype: torch.dtype) -> tuple:
    """(read, written) bytes per element of the main kernel."""
    slots = sum(len(s.rule.slots) for s in plan.position_stages())
    read = _DTYPE_BYTES[g_dtype] + _DTYPE_BYTES[p_dtype] + 4 * slots
    written = _DTYPE_BYTES[p_dtype] + 4 * slots
    return read, written


def remember(count_tensor: torch.Tensor, value: int) -> None:
    remember_count(count_tensor, value)


def planned_states(plan: ChainPlan, state) -> list | None:
    """Each stage's state in ``state`` (its own state class at its path), or ``None``
    where ``state`` is not shaped as planned (the full path then names what is wrong)."""
    out = []
    for path, stage in zip(plan.state_paths, plan.stages):
        try:
            st = state_at(state, path)
        except (KeyError, IndexError, TypeError):
            return None
        if not isinstance(st, stage.rule.state_class):
            return None
        out.append(st)
    return out
