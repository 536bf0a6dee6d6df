"""The planner: a chain becomes fused groups, or runs eagerly with a stated reason.

``plan_chain`` walks the transform objects once (cached per transform) and finds the
rule of every stage and where its state lives. ``fused_step_or_reason`` checks the
per-call conditions (device, dtypes, autograd, ``torch.func``) and runs the kernels.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import optree
import torch

from ftopt import eager
from ftopt import tree as tree_lib
from ftopt._counts import host_count, remember_count
from ftopt.base import GradientTransformation
from ftopt.combine import owner
from ftopt.rules import QuantizedSlot, RuleTransform, step_scalars
from ftopt.stages import chain_stages
from ftopt.validate import check_count, check_leaf, check_slots, check_state_tree

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
    functional: dict = field(default_factory=dict)  # see lowering.functional
    _traced: dict = field(default_factory=dict)

    def traced(self, donate: bool = False, output: str = "p"):
        """The chain's graph (donated steps may skip loads of zero-gradient lanes) for a
        step (``output="p"``) or an update (``"u"``)."""
        key = (donate, output)
        if key not in self._traced:
            from ftopt.lowering.codegen import trace_chain

            self._traced[key] = trace_chain(self.stages, self.skips, donate, output)
        return self._traced[key]


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def plan_chain(tx) -> ChainPlan:
    """The plan of ``tx`` (cached per transform object)."""
    found = chain_stages(tx)
    obj = owner(tx)
    plan = _PLANS.get(obj) if obj is not None else None
    if plan is None:
        plan = ChainPlan(list(found.stages), list(found.state_paths), list(found.skips),
                         found.reason)
        if obj is not None:
            _PLANS[obj] = plan
    return plan


def triton_missing() -> str | None:
    """Why Triton cannot be used here (``None`` if it can)."""
    try:
        import triton  # noqa: F401
    except ImportError as err:
        return f"Triton cannot be imported ({err})"
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
    return None


def _get(state, path: tuple):
    for key in path:
        state = state[key]
    return state


def _replace(state, path: tuple, value):
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(state, OrderedDict):
        new = OrderedDict(state)
        new[key] = _replace(state[key], rest, value)
        return new
    items = list(state)
    items[key] = _replace(state[key], rest, value)
    return type(state)(*items) if hasattr(state, "_fields") else type(state)(items)


def fused_step_or_reason(tx, params, grads, state, donate: bool, backend: str):
    """Run the step fused and return ``(result, None)``, or ``(None, reason)``."""
    plan = plan_chain(tx)
    if plan.reason:
        return None, plan.reason
    if donate and plan.prepared is not None and _fast_path_allowed(plan.prepared, backend):
        from ftopt.lowering.execute import fast_step

        result = fast_step(plan, params, grads, state)
        if result is not None:
            return result, None
    if not donate:
        result = _functional(plan, params, grads, state, "p", backend)
        if result is not None:
            return result, None
    paths, p_flat, spec = tree_lib.flatten_with_paths(params)
    g_flat = tree_lib.flatten_like(spec, grads, "grads", paths)
    return _full_call(plan, params, state, spec, paths, p_flat, g_flat, backend, donate,
                      "p", tx)


def _full_call(plan: ChainPlan, params, state, spec, paths, p_flat, g_flat, backend: str,
               donate: bool, output: str, tx=None):
    """Every check, new tables, the kernels: a step (``output="p"``) or an update
    (``"u"``; ``params`` may be ``None``, ``p_flat`` then holds stand-ins).
    ``((new params or updates, new state), None)``, or ``(None, reason)``. ``tx``: the
    transform, whose state containers are checked as its eager update checks them."""
    if tx is not None:
        check_state_tree(owner(tx), state)
    stage_states = [_get_checked(state, path, stage) for path, stage in
                    zip(plan.state_paths, plan.stages)]
    slot_flat = [
        {s.name: tree_lib.flatten_like(spec, getattr(st, s.name), f"state {s.name}", paths)
         for s in stage.rule.slots}
        for stage, st in zip(plan.stages, stage_states)
    ]
    active = [i for i, g in enumerate(g_flat) if g is not None]
    # The checks of the eager path (the same functions), before anything is written.
    for i in active:
        p = p_flat[i] if params is not None else None
        check_leaf(paths[i], g_flat[i], p, params is not None)
        for stage, slots in zip(plan.stages, slot_flat):
            check_slots(stage, paths[i], g_flat[i], p, {k: v[i] for k, v in slots.items()})
    for stage, st in zip(plan.stages, stage_states):
        if stage.rule.counted:
            check_count(stage.rule.name, st.count)
    reason = call_reason(plan, p_flat, g_flat, active, backend, grads_too=output == "u",
                         donate=donate, paths=paths)
    if reason is None:
        reason = _slot_reason(plan, slot_flat, active, paths)
    if reason is not None:
        return None, reason
    from ftopt.lowering.execute import execute

    new, new_stage_states, prepared = execute(
        plan, spec, paths, p_flat, g_flat, stage_states, slot_flat, active, params, state,
        donate, output)
    if not donate and prepared is not None:
        from ftopt.lowering.functional import remember

        remember(plan, output, prepared, spec, params, g_flat, slot_flat, p_flat)
    new_state = _with_stage_states(plan, state, new_stage_states)
    return (new, new_state), None


def _with_stage_states(plan: ChainPlan, state, stage_states):
    for path, st in zip(plan.state_paths, stage_states):
        state = _replace(state, path, st)
    return state


# Set while the outputs must not share storage (a torch.library op's returns may not
# alias each other): the cached non-donated path writes views of one buffer per role.
SEPARATE_OUTPUTS = contextvars.ContextVar("ftopt_separate_outputs", default=False)


def _functional(plan: ChainPlan, params, grads, state, output: str, backend: str):
    """The cached non-donated path (see :mod:`ftopt.lowering.functional`), or ``None``."""
    cache = plan.functional.get(output)
    if (cache is None or SEPARATE_OUTPUTS.get()
            or not _fast_path_allowed(cache.prepared, backend)):
        return None
    from ftopt.lowering.functional import fast_functional

    got = fast_functional(plan, params, grads, state, output)
    if got is None:
        return None
    new, stage_states = got
    return new, _with_stage_states(plan, state, stage_states)


_IN_UPDATE = contextvars.ContextVar("ftopt_in_update", default=False)
_UPDATE_BACKENDS = ("auto", "fused", "eager")


@contextlib.contextmanager
def eager_updates():
    """Within it, ``update`` calls run eagerly (as updates nested in an eager one do)."""
    token = _IN_UPDATE.set(True)
    try:
        yield
    finally:
        _IN_UPDATE.reset(token)


def update_entry(obj, updates, state, params, extra: dict, run_eager):
    """``update`` of a chain or rule transform called by the user: fused where it can be
    (a ``backend`` keyword, as for :func:`ftopt.step`, forces a path), else
    ``run_eager()``. Updates nested in an eager one run eagerly."""
    if _IN_UPDATE.get():
        return run_eager()
    backend = extra.get("backend", "auto")
    if backend not in _UPDATE_BACKENDS:
        raise ValueError(f"backend must be one of {_UPDATE_BACKENDS}, got {backend!r}")
    if (backend != "eager" and set(extra) <= {"backend"}
            and not torch.compiler.is_compiling()):
        tx = GradientTransformation(obj.init, obj.update)
        result, reason = fused_update_or_reason(tx, updates, state, params, backend)
        if result is not None:
            return result
        if backend == "fused":
            raise RuntimeError(f"update(backend='fused') cannot fuse: {reason}")
    with eager_updates():
        return run_eager()


def fused_update_or_reason(tx, updates, state, params, backend: str):
    """``tx.update`` as one fused kernel per group: ``((updates, new_state), None)``, or
    ``(None, reason)``. Pure: new update and state tensors (updates in fp32)."""
    plan = plan_chain(tx)
    if plan.reason:
        return None, plan.reason
    result = _functional(plan, params, updates, state, "u", backend)
    if result is not None:
        return result, None
    first = next(iter(optree.tree_leaves(updates, none_is_leaf=False, namespace="ftopt")),
                 None)
    if (backend == "auto" and isinstance(first, torch.Tensor) and first.device.type == "cpu"):
        return None, "tensors are on the CPU"
    for stage in plan.stages if params is None else ():
        # The eager path's errors, before anything runs.
        if stage.rule.uses_params:
            raise ValueError(f"{stage.rule.name} needs params: call update(updates, state, "
                             "params)")
        if callable(stage.rule.leaf_mask):
            raise ValueError(f"{stage.rule.name}: a callable mask needs params")
    if params is not None:
        paths, p_flat, spec = tree_lib.flatten_with_paths(params)
        g_flat = tree_lib.flatten_like(spec, updates, "updates", paths)
    else:
        spec = optree.tree_structure(updates, none_is_leaf=True, namespace="ftopt")
        paths = [tree_lib.path_str(p) for p in optree.tree_paths(
            updates, none_is_leaf=True, namespace="ftopt")]
        g_flat = spec.flatten_up_to(updates)
        p_flat = list(g_flat)  # stand-ins: no rule reads them
    return _full_call(plan, params, state, spec, paths, p_flat, g_flat, backend, False, "u",
                      tx)


def _fast_path_allowed(prepared, backend: str) -> bool:
    """The cached path skips the checks that cannot change between donated steps over
    the same tensors; those that can (backend, torch.func) are checked here."""
    if backend == "auto" and prepared.device.type == "cpu":
        return False
    return not eager.functorch_active()


def _get_checked(state, path, stage):
    try:
        st = _get(state, path)
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"state does not match the transform: no state at {path} for "
                         f"{stage.rule.name}") from None
    if not isinstance(st, stage.rule.state_class):
        raise ValueError(f"state at {path}: expected {stage.rule.state_class.__name__} for "
                         f"{stage.rule.name}, got {type(st).__name__}")
    return st


def _slot_reason(plan: ChainPlan, slot_flat, active, paths: list[str]) -> str | None:
    """Why these states cannot be read by the kernels (``None`` if they can), naming the
    first offending leaf. Errors (a wrong kind of state) were raised before."""
    from ftopt.lowering.launch import QUANT_TILE

    blocks = {s.quant.block_size for s in plan.stages if s.quant is not None and s.rule.slots}
    if len(blocks) > 1 or any(QUANT_TILE[0] % b for b in blocks):
        return (f"8-bit block sizes {sorted(blocks)} do not divide the kernel block "
                f"{QUANT_TILE[0]}")
    for i in active:
        layouts = set()
        for slots in slot_flat:
            for name, leaves in slots.items():
                leaf = leaves[i]
                if isinstance(leaf, QuantizedSlot):
                    layouts.add("8-bit")
                    tensors = (leaf.codes, leaf.absmax)
                    if leaf.codes.dtype != torch.uint8 or leaf.absmax.dtype != torch.float32:
                        return (f"8-bit state {name} at {paths[i]} is not uint8 codes with "
                                "fp32 absmax")
                else:
                    layouts.add("32-bit")
                    tensors = (leaf,)
                    if leaf.dtype != torch.float32:
                        return f"state {name} at {paths[i]}: dtype {leaf.dtype} is not fp32"
                if not all(t.is_contiguous() for t in tensors):
                    return f"state {name} at {paths[i]} is not contiguous"
        if len(layouts) > 1:
            return f"the leaf at {paths[i]} mixes 8-bit and 32-bit states"
    return None


def host_step(count: torch.Tensor, tensor_mode: bool):
    """(count, t) for scalars: host ints when known or cheap to learn, else tensors."""
    if tensor_mode:
        return count, count + 1
    known = host_count(count)
    if known is None:
        known = int(count)  # one read; the mirror keeps it from then on
    return known, known + 1


def stage_scalars(stage: RuleTransform, count, t) -> dict:
    return step_scalars(stage.rule, count, t)


def bytes_per_element(plan: ChainPlan, p_dtype: torch.dtype, g_dtype: torch.dtype) -> tuple:
    """(read, written) bytes per element of the main kernel."""
    slots = sum(len(s.rule.slots) for s in plan.stages)
    read = _DTYPE_BYTES[g_dtype] + _DTYPE_BYTES[p_dtype] + 4 * slots
    written = _DTYPE_BYTES[p_dtype] + 4 * slots
    return read, written


def remember(count_tensor: torch.Tensor, value: int) -> None:
    remember_count(count_tensor, value)
