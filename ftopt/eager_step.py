"""``step`` on the eager path as one pass: a chain's rules and ``apply_updates`` together.

``step(tx, ...)`` is ``tx.update`` then ``apply_updates``. When ``tx`` is a chain of
elementwise rules (the chains the fused backend lowers, see SPEC §6) and the leaves are on
the CPU, the eager backend traces every rule body of the chain, the ``skip_zeros`` masks
and the final ``p + u`` into one :class:`ftopt.eager.Program` and runs it over cache-sized
chunks of all leaves (:func:`ftopt.eager.run_program`): each chunk of g, p and the states
is read once, and p and the states are written once, straight into new tensors or, with
``donate=True``, into the donated ones. The ops are those of ``update`` + ``apply_updates``
on the foreach path, so the results are the same bits.

Anything else (a transform without a rule, a norm, 8-bit states, autograd, ``torch.func``,
an accelerator, trees that do not match) returns ``None`` and ``step`` runs ``update`` +
``apply_updates``, which also raises the errors.
"""

from __future__ import annotations

import operator
import weakref
from collections import OrderedDict
from typing import Any

import optree
import torch

from ftopt import eager
from ftopt._counts import remember_count
from ftopt.combine import Chain, SkipZeros, owner
from ftopt.rules import QuantizedSlot, RuleTransform, _compute_dtype, _Env, step_scalars

__all__ = ["eager_step"]


class _Unsupported(Exception):
    """This call takes the generic path."""


_STAGES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _stages(tx) -> list[tuple[RuleTransform, bool]] | None:
    """The rules of ``tx`` in order, each with whether ``skip_zeros`` masks it (``None``
    when ``tx`` is not a chain of rules whose masks come from the raw gradient)."""
    obj = owner(tx)
    if obj is None:
        return None
    try:
        return _STAGES[obj]
    except (KeyError, TypeError):
        pass
    stages: list = []
    ok = _walk(obj, False, True, stages)
    result = stages if ok else None
    try:
        _STAGES[obj] = result
    except TypeError:
        pass
    return result


def _walk(obj, skip: bool, at_input: bool, stages: list) -> bool:
    if isinstance(obj, RuleTransform):
        stages.append((obj, skip))
        return True
    if isinstance(obj, SkipZeros):
        return True
    if type(obj) is not Chain:
        return False
    if obj.skip_zeros and not skip and not (at_input and not stages):
        return False  # its mask would come from updates, not from the gradient
    inner_skip = skip or obj.skip_zeros
    return all(_walk(owner(t), inner_skip, at_input and i == 0, stages)
               for i, t in enumerate(obj.transforms))


def _stage_states(obj, state, out: list) -> None:
    if isinstance(obj, RuleTransform):
        out.append(state)
    elif isinstance(obj, Chain):
        for t, s in zip(obj.transforms, obj._inner_states(state)):
            _stage_states(owner(t), s, out)


def _rebuild(obj, state, new_states) -> Any:
    """The state ``tx.update`` returns: ``new_states`` (an iterator, in stage order) in the
    chain's containers; a ``skip_zeros`` marker returns its state as it is."""
    if isinstance(obj, RuleTransform):
        return next(new_states)
    if isinstance(obj, SkipZeros):
        return state
    inner = [_rebuild(owner(t), s, new_states)
             for t, s in zip(obj.transforms, obj._inner_states(state))]
    return tuple(inner) if obj.names is None else OrderedDict(zip(obj.names, inner))


def eager_step(tx, params, grads, state, donate: bool):
    """``(new_params, new_state)`` of one step, or ``None`` where this path does not
    apply (then ``step`` runs ``update`` + ``apply_updates``)."""
    stages = _stages(tx)
    if not stages:
        return None
    try:
        prepared = _prepare(tx, stages, params, grads, state, donate)
    except (_Unsupported, eager.NotTraceable, ValueError, TypeError, KeyError, IndexError,
            AttributeError):
        return None
    return _execute(prepared, donate)


class _Prepared:
    pass


def _prepare(tx, stages, params, grads, state, donate: bool) -> _Prepared:
    if eager.functorch_active():
        raise _Unsupported
    spec = optree.tree_structure(grads, none_is_leaf=True, namespace="ftopt")
    g_flat = spec.flatten_up_to(grads)
    p_flat = spec.flatten_up_to(params)
    p_leaves, p_spec = optree.tree_flatten(params, none_is_leaf=False, namespace="ftopt")
    present = [p for p in p_flat if p is not None]
    if len(present) != len(p_leaves) or any(a is not b for a, b in zip(present, p_leaves)):
        raise _Unsupported  # new params are rebuilt in the params' own structure
    stage_states: list = []
    _stage_states(owner(tx), state, stage_states)
    if len(stage_states) != len(stages):
        raise _Unsupported
    active = [i for i, g in enumerate(g_flat) if g is not None]
    grad_mode = torch.is_grad_enabled()
    slots: list[dict[str, list]] = []
    for (stage, _), st in zip(stages, stage_states):
        rule = stage.rule
        if (rule.slots or rule.counted) and not isinstance(st, rule.state_class):
            raise _Unsupported
        slots.append({s.name: spec.flatten_up_to(getattr(st, s.name)) for s in rule.slots})
    for i in active:
        g, p = g_flat[i], p_flat[i]
        if not (isinstance(g, torch.Tensor) and isinstance(p, torch.Tensor)):
            raise _Unsupported
        if not (g.is_floating_point() and p.is_floating_point()) or g.shape != p.shape:
            raise _Unsupported
        if g.device.type != "cpu" or p.device.type != "cpu":
            raise _Unsupported
        tensors = [g, p]
        for by_name in slots:
            for leaves in by_name.values():
                s = leaves[i]
                if isinstance(s, QuantizedSlot) or not isinstance(s, torch.Tensor):
                    raise _Unsupported
                if s.shape != g.shape or s.device.type != "cpu":
                    raise _Unsupported
                tensors.append(s)
        if grad_mode and any(t.requires_grad for t in tensors):
            raise _Unsupported  # a differentiable step: autograd needs the loop mode
        if donate and not all(t.is_contiguous() for t in tensors[1:]):
            raise _Unsupported
    if donate and _overlapping([g_flat[i] for i in active],
                               [t for i in active for t in _targets(i, p_flat, slots)]):
        raise _Unsupported
    # Which leaves each rule updates, the step counts and the per-step scalars.
    flags = []
    counts = []
    scalars = []
    n = len(g_flat)
    for (stage, _), st in zip(stages, stage_states):
        mask = stage._leaf_mask(params, n, [""] * n)
        flags.append([mask is None or mask[i] for i in range(n)])
        count, new_count, t = stage._advance_count(st)
        counts.append((st, new_count, t if isinstance(t, int) else None))
        scalars.append(step_scalars(stage.rule, count, t))
    prep = _Prepared()
    prep.__dict__.update(
        tx=tx, stages=stages, spec=spec, p_spec=p_spec, params=params, state=state,
        g_flat=g_flat, p_flat=p_flat, slots=slots, stage_states=stage_states,
        active=active, flags=flags, counts=counts, scalars=scalars)
    # One program per group of leaves that run the same ops (tracing may raise
    # NotTraceable: nothing has been written yet).
    groups: dict[tuple, list[int]] = {}
    for i in active:
        groups.setdefault(_signature(prep, i), []).append(i)
    prep.programs = [(_build(prep, leaves[0], any(g_flat[i].ndim == 0 for i in leaves)),
                      leaves) for leaves in groups.values()]
    return prep


def _targets(i: int, p_flat, slots) -> list:
    return [p_flat[i]] + [leaves[i] for by_name in slots for leaves in by_name.values()]


def _overlapping(reads, targets) -> bool:
    """Whether a donated tensor shares memory with another donated tensor or a gradient
    (the chunked writes would then be seen by later reads)."""
    spans = []
    for is_target, tensors in ((False, reads), (True, targets)):
        for t in tensors:
            if t.numel():
                start = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
                # The extent of the memory a strided tensor may touch.
                extent = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) + 1
                spans.append((start, start + extent * t.element_size(), is_target))
    spans.sort()
    end_any = end_target = -1
    for start, end, is_target in spans:
        if start < end_target or (is_target and start < end_any):
            return True
        end_any = max(end_any, end)
        if is_target:
            end_target = max(end_target, end)
    return False


def _build(prep: _Prepared, leaf: int, zero_dim: bool) -> eager.Program:
    """The program of one group of leaves (those of ``leaf``'s signature)."""
    g, p = prep.g_flat[leaf], prep.p_flat[leaf]
    prog = eager.Program()
    prog.zero_dim_leaves = zero_dim
    gs = prog.input("g", g.dtype)
    ps = prog.input("p", p.dtype)
    mask = prog.binary(operator.eq, gs, 0) if any(
        skip for (_, skip), f in zip(prep.stages, prep.flags) if f[leaf]) else None
    u = gs
    for k, ((stage, skip), by_name) in enumerate(zip(prep.stages, prep.slots)):
        if not prep.flags[k][leaf]:
            continue
        rule = stage.rule
        compute = _compute_dtype_of(u.dtype)
        env: dict[str, Any] = {"u": prog.convert(u, compute)}
        if rule.uses_params:
            env["p"] = prog.convert(ps, _compute_dtype(p))
        for name, leaves in by_name.items():
            env[name] = prog.input(f"{k}:{name}", leaves[leaf].dtype)
        env.update(prep.scalars[k])
        u_out, slots_out = rule.body(eager.TraceOps(prog), _Env(env))
        u_new = prog.as_elem(u_out, compute)
        if skip:
            u_new = prog.where(mask, torch.full((), -0.0, dtype=u_new.dtype), u_new)
        for name, leaves in by_name.items():
            new = prog.as_elem(slots_out[name], compute)
            if skip:
                new = prog.where(mask, env[name], new)
            prog.output(f"{k}:{name}", prog.convert(new, leaves[leaf].dtype))
        u = u_new
    if not u.dtype.is_floating_point:
        raise _Unsupported  # apply_updates raises
    compute = torch.promote_types(torch.promote_types(p.dtype, u.dtype), torch.float32)
    new_p = prog.binary(operator.add, prog.convert(ps, compute), prog.convert(u, compute))
    prog.output("p", prog.convert(new_p, p.dtype))
    return prog


def _compute_dtype_of(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _signature(prep: _Prepared, i: int) -> tuple:
    return (prep.g_flat[i].dtype, prep.p_flat[i].dtype,
            tuple(f[i] for f in prep.flags),
            tuple(leaves[i].dtype for by_name in prep.slots for leaves in by_name.values()))


def _execute(prep: _Prepared, donate: bool):
    new_p = list(prep.p_flat)
    new_slots = [{name: list(leaves) for name, leaves in by_name.items()}
                 for by_name in prep.slots]
    for prog, leaves in prep.programs:
        inputs: dict[str, list] = {"g": [prep.g_flat[i] for i in leaves],
                                   "p": [prep.p_flat[i] for i in leaves]}
        for k, by_name in enumerate(prep.slots):
            for name, flat in by_name.items():
                inputs[f"{k}:{name}"] = [flat[i] for i in leaves]
        outputs = {}
        for name, _ in prog.outputs:
            if donate:
                outputs[name] = inputs[name]
            else:
                outputs[name] = [torch.empty_like(t, memory_format=torch.contiguous_format)
                                 for t in inputs[name]]
        eager.run_program(prog, inputs, outputs, aliases=list(outputs) if donate else ())
        for i, t in zip(leaves, outputs["p"]):
            new_p[i] = t
        for name, _ in prog.outputs:
            if name != "p":
                k, slot = name.split(":", 1)
                for i, t in zip(leaves, outputs[name]):
                    new_slots[int(k)][slot][i] = t
    new_states = []
    for (stage, _), (old, new_count, known), by_name in zip(
            prep.stages, prep.counts, new_slots):
        rule = stage.rule
        values = {name: optree.tree_unflatten(prep.spec, leaves)
                  for name, leaves in by_name.items()}
        if rule.counted:
            if donate:
                with torch.no_grad():
                    old.count.copy_(new_count)
                if known is not None:
                    remember_count(old.count, known)
                new_count = old.count
            values["count"] = new_count
        new_states.append(rule.state_class(**values))
    if donate:
        return prep.params, prep.state
    new_params = optree.tree_unflatten(prep.p_spec, [p for p in new_p if p is not None])
    new_state = _rebuild(owner(prep.tx), prep.state, iter(new_states))
    return new_params, new_state
