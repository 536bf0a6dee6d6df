"""Chains with matrix stages: elementwise segments fused, matrix stages in torch between.

A chain ``[rules A] -> matrix stage M -> [rules B]`` (:mod:`ftopt.matrix`) runs as: the
segment A as a fused update kernel (its states written as a step writes them, its update
to an fp32 buffer), M on that buffer with batched torch ops, then the segment B as a
fused step (or update) kernel that reads M's output as its input (the ``x`` role) and
the raw gradient for ``skip_zeros`` (SPEC §3: the mask is always the raw gradient's). A
chain that ends in a matrix stage has an empty last segment: ``p + u`` in one kernel.

Every segment's checks run before the first kernel, so a call that cannot fuse falls
back to the eager path with nothing written.
"""

from __future__ import annotations

import torch

from ftopt import tree as tree_lib
from ftopt._counts import host_count, remember_count
from ftopt.lowering.calls import checked_call, launch_call
from ftopt.lowering.plan import ChainPlan
from ftopt.stages import state_at, with_state_at

__all__ = ["run"]


def run(plan: ChainPlan, params, state, spec, paths, p_flat, g_flat, backend: str,
        donate: bool, output: str):
    """A step (``output="p"``) or an update (``"u"``) of a segmented plan:
    ``((new params or updates, new state), None)``, or ``(None, reason)``."""
    parts = plan.segments
    checked = {}
    for k, part in enumerate(parts):
        if not isinstance(part, ChainPlan):
            part[0].check_shards(paths, g_flat)  # before any kernel writes a state
            if hasattr(part[0], "check_state"):
                part[0].check_state(state_at(state, part[2]), g_flat, p_flat, spec, paths)
        else:
            out = output if k == len(parts) - 1 else "u"
            found, reason = checked_call(part, params, state, paths, p_flat, g_flat,
                                         backend, donate, out, spec)
            if reason is not None:
                return None, reason
            checked[k] = found
    u_flat = None  # the input of the next segment (None: the raw gradient)
    zero_flat = None
    new = None
    for k, part in enumerate(parts):
        if not isinstance(part, ChainPlan):
            stage, skip, path = part
            if skip and zero_flat is None:
                zero_flat = [None if g is None else g == 0 for g in g_flat]
            out_flat, stage_state = stage.run_flat(
                g_flat if u_flat is None else u_flat, zero_flat if skip else None,
                state_at(state, path), p_flat, spec, paths)
            if donate:
                stage_state = _write_back(state_at(state, path), stage_state)
            state = with_state_at(state, path, stage_state)
            u_flat = [None if u is None else u.contiguous() for u in out_flat]
            continue
        last = k == len(parts) - 1
        new, state = launch_call(part, checked[k], params, state, spec, paths, p_flat,
                                 g_flat, donate, output if last else "u", x_flat=u_flat,
                                 remember=False)
        if not last:
            u_flat = tree_lib.flatten_like(spec, new, "updates", paths)
    return (new, state), None


def _write_back(old, new):
    """A donated stage state: ``new`` copied into ``old``'s tensors (counts keep their
    host mirror, so the next step reads no device value)."""
    old_flat = tree_lib.leaves(old)
    new_flat = tree_lib.structure(old).flatten_up_to(new)
    with torch.no_grad():
        for o, n in zip(old_flat, new_flat):
            if isinstance(o, torch.Tensor) and o is not n:
                known = host_count(n) if n.ndim == 0 and not n.is_floating_point() else None
                o.copy_(n)
                if known is not None:
                    remember_count(o, known)
    return old
