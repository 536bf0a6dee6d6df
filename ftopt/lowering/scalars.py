"""The per-step scalars of a fused kernel: host floats (kernel arguments) where every
hyperparameter is a number, a schedule-free constant or a tensor with a host mirror,
and every count a host int; else a small device buffer computed with torch ops."""

from __future__ import annotations

import operator

import torch

from ftopt._counts import host_value, mirror_records
from ftopt.lowering.plan import ChainPlan
from ftopt.rules import step_scalars

__all__ = ["host_hparams", "kernel_scalars"]


def _constant_hparams(plan: ChainPlan) -> list | None:
    """Per stage, its hyperparameters when none is a schedule or a tensor (they are the
    same every step: computed once), else ``None``."""
    if plan.constant_hparams is None:
        out = []
        for stage in plan.stages:
            h = stage.rule.hparams
            out.append(None if any(callable(v) or isinstance(v, torch.Tensor)
                                   for v in h.values()) else dict(h))
        plan.constant_hparams = out
    return plan.constant_hparams


def _mirrored_hparams(plan: ChainPlan, constant: list, device) -> list | None:
    """Per stage, its hyperparameters with each tensor replaced by its host mirror
    (:func:`ftopt._counts.remember_value`: ``ftopt.Optimizer``'s live values), or ``None``
    where one has none or is a schedule (and while a CUDA graph is captured: a kernel
    argument would be frozen into it). The same list as the last step's while no value
    was recorded and no tensor written since (one pass over the mirrors' records), and
    where some were (a scheduler's new ``lr``), only those are read again and only their
    stages' dicts made anew."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if plan.mirrored is None:
        plan.mirrored = _mirror_layout(plan, constant)
    layout = plan.mirrored
    if not layout:
        return None  # a schedule
    tensors, ids, where, last = layout
    records, versions = mirror_records(ids), tuple(map(_version, tensors))
    if last is None:
        values = [host_value(t) for t in tensors]
        if None in values:  # (floats: ``None`` equals none of them)
            return None
        out = [h if h is not None else {} for h in constant]
        for i in {i for i, _ in where}:
            out[i] = dict(plan.stages[i].rule.hparams)
        for (i, key), value in zip(where, values):
            out[i][key] = value
        layout[3] = (records, versions, out, values)
        return out
    if versions == last[1] and all(map(_is, records, last[0])):
        return last[2]  # (no value recorded since, no tensor written)
    changed = [k for k, (r, v, r0, v0) in enumerate(zip(records, versions, *last[:2]))
               if r is not r0 or v != v0]
    # The stages whose values changed get new dicts (the last step's, with the changed
    # values); the others are the last step's.
    values, before, out = list(last[3]), last[2], list(last[2])
    for k in changed:
        value = values[k] = host_value(tensors[k])
        if value is None:
            layout[3] = None
            return None
        i, key = where[k]
        if out[i] is before[i]:
            out[i] = dict(before[i])
        out[i][key] = value
    layout[3] = (records, versions, out, values)
    return out


_version = operator.attrgetter("_version")
_is = operator.is_


def _mirror_layout(plan: ChainPlan, constant: list) -> list:
    """``[tensors, their ids, (stage, key) of each, None]``: the tensor hyperparameters
    of the stages that have some (the last step's records, versions, hparams and values
    go in the last place); ``[]`` where such a stage has a schedule (or a ``None``)."""
    tensors, where = [], []
    for i, (stage, h) in enumerate(zip(plan.stages, constant)):
        if h is not None:
            continue
        for key, value in stage.rule.hparams.items():
            if value is None or callable(value):
                return []
            if isinstance(value, torch.Tensor):
                tensors.append(value)
                where.append((i, key))
    return [tuple(tensors), tuple(map(id, tensors)), tuple(where), None]


def host_hparams(plan: ChainPlan, device) -> list | None:
    """Per stage, this step's hyperparameters as host numbers (constants, and tensors
    through their host mirrors), or ``None`` where the scalars need the device (a tensor
    with no mirror) or a schedule call (see :func:`kernel_scalars`)."""
    constant = _constant_hparams(plan)
    if all(h is not None for h in constant):
        return constant
    return _mirrored_hparams(plan, constant, device)


def _host_scalars(plan: ChainPlan, traced, steps, hparams: list | None) -> list | None:
    """The kernel's scalars as host floats where every hyperparameter is a host number
    (``hparams``, from :func:`host_hparams`) and every count a host int (the usual step:
    no dicts of schedules to evaluate), else ``None``."""
    if hparams is None:
        return None
    per_stage = []
    for stage, h, (_, t) in zip(plan.stages, hparams, steps):
        scalars = stage.rule.scalars
        if scalars is None:
            per_stage.append(h)
        elif t is None or isinstance(t, int):
            per_stage.append({**h, **scalars(t, h)})
        else:
            return None
    return [float(per_stage[i][name]) for i, name in traced.graph.scalars]


def kernel_scalars(plan: ChainPlan, traced, steps, device, hparams: list | None,
                   carried: list | None = None) -> list[float] | torch.Tensor:
    """Per-step scalars: kernel arguments when all are host numbers, else a device buffer
    computed with torch ops (no host synchronisation; capturable in a CUDA graph).
    ``hparams``: :func:`host_hparams` of this step; ``carried``: per stage, the scalars of
    its running scalars (:func:`ftopt.lowering.counts.advance_running`), device values."""
    floats = None if carried else _host_scalars(plan, traced, steps, hparams)
    if floats is None:
        carried = carried or [None] * len(plan.stages)
        per_stage = [step_scalars(stage.rule, *step, extra) for stage, step, extra in
                     zip(plan.stages, steps, carried)]
        values = [per_stage[i][name] for i, name in traced.graph.scalars]
        if any(isinstance(v, torch.Tensor) for v in values):
            return _device_buffer(plan, values, device)
        floats = [float(v) for v in values]
    if any([0.0 < abs(v) < _FP32_TINY for v in floats]):
        # Triton types a Python float below fp32's smallest normal as an fp64 argument (a
        # kernel of another signature, whose fp32 math then fails to compile): such
        # values go to the kernel as an fp32 buffer instead, rounded as the eager path
        # rounds them.
        return torch.tensor(floats, dtype=torch.float32).to(device)
    return floats


_FP32_TINY = torch.finfo(torch.float32).tiny


def _device_buffer(plan: ChainPlan, values: list, device) -> torch.Tensor:
    """The scalars as one fp32 device vector when some are device values (running
    scalars, tensor hyperparameters without a host mirror): one ``stack`` of those and of
    the host numbers, which are device values made once (one fill each) and kept on the
    plan while they stay the same (Schedule-Free's step: one kernel here, not one per
    number). No host-to-device copies (no stream synchronisation), and nothing kept while
    a CUDA graph is captured (its tensors live in the graph's pool)."""
    host = tuple(float(v) for v in values if not isinstance(v, torch.Tensor))
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    cached = plan.host_scalars
    if capturing or cached is None or cached[0] != (host, device):
        numbers = [torch.full((), v, dtype=torch.float32, device=device) for v in host]
        cached = ((host, device), numbers)
        if not capturing:
            plan.host_scalars = cached
    numbers = iter(cached[1])
    return torch.stack([v.to(device=device, dtype=torch.float32).reshape(())
                        if isinstance(v, torch.Tensor) else next(numbers) for v in values])
