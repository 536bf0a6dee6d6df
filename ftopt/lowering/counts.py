"""The scalar bookkeeping of one fused step: step counts (incremented by the main kernel
where they live on its device) and rules' running scalars (:attr:`ftopt.rules.Rule.running`,
moved with torch ops on their device, no host read)."""

from __future__ import annotations

import torch

from ftopt._counts import device_decided, host_count
from ftopt.lowering.plan import ChainPlan, host_step, remember
from ftopt.rules import running_step

__all__ = ["advance_counts", "advance_running", "counts_on", "increment"]


def counts_on(counts, device) -> bool:
    """Whether every count tensor is on the kernels' ``device`` (the kernel increments
    them)."""
    return all(c is None or c.device == device for c in counts)


def advance_counts(plan: ChainPlan, counts, donate: bool, tensor_mode: bool, device,
                   in_kernel: bool | None = None):
    """Per stage: (count, t) for its scalars and its new count tensor; and the (old, new)
    count tensors the main kernel increments (empty when they were incremented here,
    because a count is not on the kernels' device). ``in_kernel``: :func:`counts_on`
    of ``counts``, where the caller knows it."""
    if in_kernel is None:
        in_kernel = counts_on(counts, device)
    steps, new_counts, pairs = [], [], []
    for count_tensor in counts:
        if count_tensor is None:
            steps.append((None, None))
            new_counts.append(None)
            continue
        count, t = host_step(count_tensor, tensor_mode)
        if not isinstance(t, int) and not device_decided(count_tensor):
            # Scalars on the device this step: the host mirror (a later step may use it,
            # and the kernel's write does not bump the tensor's version) moves on too.
            known = host_count(count_tensor)
            t_host = None if known is None else known + 1
        else:
            t_host = t
        if in_kernel:
            new = count_tensor if donate else torch.empty_like(count_tensor)
            pairs += [count_tensor, new]
        else:
            new = count_tensor.add_(1) if donate else count_tensor + 1
        if isinstance(t_host, int):
            remember(new, t_host)
        steps.append((count, t))
        new_counts.append(new)
    return steps, new_counts, pairs


def advance_running(plan: ChainPlan, stage_states, steps, donate: bool):
    """Per stage: the body's scalars from its running scalars (``None`` for a rule that
    keeps none) and their new values, with torch ops on their device (no host read). The
    new values of a donated step are written into the old tensors (after every check:
    nothing is written before), as the kernels write the counts."""
    if not plan.running:
        return None, None
    carried, new = [], []
    for stage, st, (count, t) in zip(plan.stages, stage_states, steps):
        rule = stage.rule
        if not rule.running:
            carried.append(None)
            new.append({})
            continue
        scalars, values = running_step(rule, count, t,
                                       {name: getattr(st, name) for name in rule.running})
        if donate:
            for name, value in values.items():
                getattr(st, name).copy_(value)
            values = {name: getattr(st, name) for name in values}
        carried.append(scalars)
        new.append(values)
    return carried, new


def increment(pairs) -> None:
    """The count increments of a step that launched no kernel."""
    for old, new in zip(pairs[::2], pairs[1::2]):
        if new is old:
            old.add_(1)
        else:
            torch.add(old, 1, out=new)
