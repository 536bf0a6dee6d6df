"""``step`` on the eager path as one pass: a chain's rules and ``apply_updates`` together.

``step(tx, ...)`` is ``tx.update`` then ``apply_updates``. When ``tx`` is a chain of
elementwise rules (the chains the fused backend lowers, see SPEC §6) and the leaves are on
the CPU, the eager backend traces every rule body of the chain, the ``skip_zeros`` masks
and the final ``p + u`` into one :class:`~ftopt.chunked.program.Program` and runs it over
cache-sized chunks of all leaves (:func:`~ftopt.chunked.run.run_program`): each chunk of g,
p and the states is read once, and p and the states are written once, straight into new
tensors or, with ``donate=True``, into the donated ones. The ops are those of ``update`` +
``apply_updates`` on the foreach path, so the results are the same bits.

Anything else (a transform without a rule, a norm, 8-bit states, autograd, ``torch.func``,
an accelerator, trees that do not match) is a declared refusal (:class:`Unsupported`, or
:class:`~ftopt.chunked.program.NotTraceable` from the tracer): ``None``, and ``step`` runs
``update`` + ``apply_updates``, which also raises the errors of bad inputs. Any other
exception is a bug and propagates.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from typing import Any

import optree
import torch

from ftopt import eager, program
from ftopt._counts import remember_count
from ftopt.chunked import run
from ftopt.chunked.program import NotTraceable, Program, TraceOps
from ftopt.chunked.run import check_aliases
from ftopt.combine import Chain, SkipZeros, owner
from ftopt.rule_transform import RuleTransform
from ftopt.rules import compute_dtype, hparams_require_grad, running_step, step_scalars
from ftopt.stages import chain_stages
from ftopt.validate import check_running

__all__ = ["eager_step", "Unsupported"]


class Unsupported(Exception):
    """This call takes the generic path."""


def _stages(tx) -> list[tuple[RuleTransform, bool]] | None:
    """The rules of ``tx`` in order, each with whether ``skip_zeros`` masks it (``None``
    when ``tx`` is not a chain of rules whose masks come from the raw gradient)."""
    found = chain_stages(tx)
    if found.reason is not None:
        return None
    return list(zip(found.stages, found.skips))


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
    except (Unsupported, NotTraceable):
        return None
    return _execute(prepared, donate)


class _Prepared:
    pass


def _prepare(tx, stages, params, grads, state, donate: bool) -> _Prepared:
    if eager.functorch_active():
        raise Unsupported
    spec = optree.tree_structure(grads, none_is_leaf=True, namespace="ftopt")
    g_flat = spec.flatten_up_to(grads)
    p_flat = _matched(spec, params, "params")
    p_leaves, p_spec = optree.tree_flatten(params, none_is_leaf=False, namespace="ftopt")
    present = [p for p in p_flat if p is not None]
    if len(present) != len(p_leaves) or any(a is not b for a, b in zip(present, p_leaves)):
        raise Unsupported  # new params are rebuilt in the params' own structure
    stage_states: list = []
    try:
        _stage_states(owner(tx), state, stage_states)
    except ValueError:  # containers that do not match the chain: update names it
        raise Unsupported("the state does not match the chain") from None
    if len(stage_states) != len(stages):
        raise Unsupported
    slots: list[dict[str, list]] = []
    for (stage, _), st in zip(stages, stage_states):
        rule = stage.rule
        if rule.indexed:  # element and leaf positions, which chunks of leaves lose
            raise Unsupported(f"{rule.name} reads element positions")
        if (rule.slots or rule.counted) and not isinstance(st, rule.state_class):
            raise Unsupported
        slots.append({s.name: _matched(spec, getattr(st, s.name), f"state {s.name}")
                      for s in rule.slots})
    n = len(g_flat)
    try:
        masks = [stage._leaf_mask(params, n, [""] * n) for stage, _ in stages]
    except (ValueError, TypeError):  # a mask that does not fit: update names it
        raise Unsupported("a leaf mask does not fit the params") from None
    columns = [(f"{k}:{name}", leaves) for k, by_name in enumerate(slots)
               for name, leaves in by_name.items()]
    grad_mode = torch.is_grad_enabled()
    if grad_mode and any(hparams_require_grad(stage.rule) for stage, _ in stages):
        raise Unsupported  # a differentiable step: autograd needs the loop mode
    tensor = torch.Tensor
    strided = torch.strided
    quant_min = min((stage.quant.min_size for stage, _ in stages if stage.quant is not None
                     and stage.rule.slots), default=float("inf"))
    active = []
    groups: dict[tuple, list[int]] = {}
    for i, g in enumerate(g_flat):
        if g is None:
            continue
        active.append(i)
        p = p_flat[i]
        leaf_slots = [leaves[i] for _, leaves in columns]
        # What update checks (rules._check_leaf), plus what this path needs; anything
        # else takes the generic path, which raises the errors.
        if not (type(g) is tensor or isinstance(g, tensor)) or not (
                type(p) is tensor or isinstance(p, tensor)):
            raise Unsupported
        shape = g.shape
        if not (g.is_floating_point() and p.is_floating_point() and p.shape == shape
                and g.is_cpu and p.is_cpu and g.layout is strided and p.layout is strided):
            raise Unsupported
        if leaf_slots and g.numel() >= quant_min:
            raise Unsupported  # 8-bit states (or a 32-bit one where 8-bit is expected)
        for t in leaf_slots:  # (8-bit states are not tensors: the generic path)
            if not isinstance(t, tensor) or t.shape != shape or not t.is_floating_point() \
                    or not t.is_cpu or t.layout is not strided:
                raise Unsupported
        if grad_mode and (g.requires_grad or p.requires_grad or any(
                t.requires_grad for t in leaf_slots)):
            raise Unsupported  # a differentiable step: autograd needs the loop mode
        key = (g.dtype, p.dtype, tuple(m is None or bool(m[i]) for m in masks),
               tuple(t.dtype for t in leaf_slots))
        groups.setdefault(key, []).append(i)
    if donate:
        targets = [t for i in active for t in (p_flat[i], *(c[i] for _, c in columns))]
        if not all(t.is_contiguous() for t in targets):
            raise Unsupported
        spans = [(t.data_ptr(), t.data_ptr() + t.nbytes, True) for t in targets]
        spans += [_span(g_flat[i]) for i in active]
        if _overlapping(spans):
            raise Unsupported  # chunked in-place writes would be read back
    # The step counts and the per-step scalars.
    counts = []
    scalars = []
    running = []  # per stage, the new values of its running scalars
    for (stage, _), st in zip(stages, stage_states):
        count, new_count, t = stage._advance_count(st)
        counts.append((st, new_count, t if isinstance(t, int) else None))
        carried, new = None, {}
        if stage.rule.running:
            try:
                check_running(stage.rule, st)
            except ValueError:
                raise Unsupported("running scalars that update names") from None
            carried, new = running_step(stage.rule, count, t, {
                name: getattr(st, name) for name in stage.rule.running})
            if set(new) != set(stage.rule.running):
                raise Unsupported("running scalars the body computes")
        running.append(new)
        scalars.append(step_scalars(stage.rule, count, t, carried))
    flags = [[m is None or bool(m[i]) if g_flat[i] is not None else False for i in range(n)]
             for m in masks]
    prep = _Prepared()
    prep.__dict__.update(
        tx=tx, stages=stages, spec=spec, p_spec=p_spec, params=params, state=state,
        g_flat=g_flat, p_flat=p_flat, slots=slots, stage_states=stage_states,
        active=active, flags=flags, counts=counts, scalars=scalars, running=running)
    # One program per group of leaves that run the same ops (tracing may raise
    # NotTraceable: nothing has been written yet).
    prep.programs = [(_build(prep, leaves[0], any(g_flat[i].ndim == 0 for i in leaves)),
                      leaves) for leaves in groups.values()]
    for prog, _ in prep.programs:
        prog.drop_identities()  # (run_program would; done here so the check sees it)
        if donate:
            check_aliases(prog, [name for name, _ in prog.outputs])
    return prep


def _matched(spec, tree, what: str) -> list:
    """The leaves of ``tree`` at the gradients' leaves; a tree of another structure is a
    refusal (``update`` then raises the error that names the leaf)."""
    try:
        return spec.flatten_up_to(tree)
    except (ValueError, TypeError):
        raise Unsupported(f"the {what} do not match the gradients' tree") from None


def _span(t: torch.Tensor) -> tuple[int, int, bool]:
    """The bytes a (read-only) tensor may touch."""
    start, numel = t.data_ptr(), t.numel()
    if not t.is_contiguous():
        numel = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1 if numel else 0
    return start, start + numel * t.element_size(), False


def _overlapping(spans: list[tuple[int, int, bool]]) -> bool:
    """Whether a donated tensor's memory overlaps another donated tensor's or a grad's."""
    spans.sort()
    end_any = end_target = -1
    for start, end, is_target in spans:
        if start == end:
            continue
        if start < end_target or (is_target and start < end_any):
            return True
        end_any = max(end_any, end)
        if is_target:
            end_target = max(end_target, end)
    return False


def _build(prep: _Prepared, leaf: int, zero_dim: bool) -> Program:
    """The program of one group of leaves (those of ``leaf``'s signature): the chain
    (:func:`ftopt.program.trace_chain`) and ``p + u``."""
    g, p = prep.g_flat[leaf], prep.p_flat[leaf]
    prog = Program()
    prog.zero_dim_leaves = zero_dim
    gs = prog.input("g", g.dtype)
    ps = prog.input("p", p.dtype)
    algebra = _StepAlgebra(prep, prog, leaf, ps)
    u = program.trace_chain([stage for stage, _ in prep.stages], [skip for _, skip in prep.stages],
                    algebra, gs)
    if not u.dtype.is_floating_point:
        raise Unsupported("the update is not floating-point")  # apply_updates raises
    compute = torch.promote_types(torch.promote_types(p.dtype, u.dtype), torch.float32)
    new_p = prog.convert(prog.binary(operator.add, prog.convert(ps, compute),
                                     prog.convert(u, compute)), p.dtype)
    if p.dtype in (torch.float16, torch.bfloat16):
        new_p = _keep_nan_bits(prog, ps, new_p)
    prog.output("p", new_p)
    return prog


def _keep_nan_bits(prog: Program, old, new):
    """``new`` with the bits of ``old`` where both are NaN (16-bit params and states:
    ``ftopt.numerics.keep_nan_bits``)."""
    nan = prog.binary(operator.and_, prog.binary(operator.ne, old, old),
                      prog.binary(operator.ne, new, new))
    return prog.where(nan, old, new)


class _StepAlgebra:
    """A chunk program of one group of leaves, for :func:`ftopt.program.trace_chain`:
    stage ``k``'s slots are inputs and outputs ``"k:name"``; a stage whose leaf mask
    leaves this group out does not run."""

    def __init__(self, prep: _Prepared, prog: Program, leaf: int, ps):
        self.prep, self.prog, self.leaf, self.ps = prep, prog, leaf, ps
        self._ops = TraceOps(prog)
        self.compute = None
        self._stored: dict[str, Any] = {}  # "k:name" -> its 16-bit input

    def ops(self):
        return self._ops

    def zero_mask(self, g):
        return self.prog.binary(operator.eq, g, 0)

    def neg_zero(self, g):
        return torch.full((), -0.0, dtype=compute_dtype(self.prep.g_flat[self.leaf]),
                          device="cpu")

    def select(self, mask, a, b):
        return self.prog.where(mask, a, b)

    def elem(self, value, like):
        return self.prog.as_elem(value, self.compute)

    def stage_inputs(self, index: int, rule, u) -> dict | None:
        if not self.prep.flags[index][self.leaf]:
            return None
        prog, leaf = self.prog, self.leaf
        self.compute = compute_dtype(u)
        inputs: dict[str, Any] = {"u": prog.convert(u, self.compute)}
        if rule.uses_params:
            inputs["p"] = prog.convert(self.ps, compute_dtype(self.prep.p_flat[leaf]))
        for name, leaves in self.prep.slots[index].items():
            dtype = leaves[leaf].dtype
            inputs[name] = prog.input(f"{index}:{name}", dtype)
            if dtype in (torch.float16, torch.bfloat16):  # 16-bit storage: fp32 math
                self._stored[f"{index}:{name}"] = inputs[name]
                inputs[name] = prog.convert(inputs[name], self.compute)
        return {**inputs, **self.prep.scalars[index]}

    def leaf_flag(self, index: int):
        return None

    def running_out(self, index: int, name: str, value) -> None:
        raise NotTraceable("a running scalar computed by the body")

    def slot_out(self, index: int, name: str, value) -> None:
        dtype = self.prep.slots[index][name][self.leaf].dtype
        new = self.prog.convert(value, dtype)
        old = self._stored.get(f"{index}:{name}")
        if old is not None:
            new = _keep_nan_bits(self.prog, old, new)
        self.prog.output(f"{index}:{name}", new)


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
                outputs[name] = [torch.empty_like(t) if t.is_contiguous() else
                                 torch.empty_like(t, memory_format=torch.contiguous_format)
                                 for t in inputs[name]]
        run.run_program(prog, inputs, outputs, aliases=list(outputs) if donate else ())
        for i, t in zip(leaves, outputs["p"]):
            new_p[i] = t
        for name, _ in prog.outputs:
            if name != "p":
                k, slot = name.split(":", 1)
                for i, t in zip(leaves, outputs[name]):
                    new_slots[int(k)][slot][i] = t
    new_states = []
    for (stage, _), (old, new_count, known), by_name, running in zip(
            prep.stages, prep.counts, new_slots, prep.running):
        rule = stage.rule
        values = {name: optree.tree_unflatten(prep.spec, leaves)
                  for name, leaves in by_name.items()}
        for name, value in running.items():
            if donate:
                with torch.no_grad():
                    getattr(old, name).copy_(value)
                value = getattr(old, name)
            values[name] = value
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
