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

from ftopt import tree as tree_lib
from ftopt.lowering.calls import checked_call, launch_call
from ftopt.lowering.plan import ChainPlan

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
            stage, skip = part
            if skip and zero_flat is None:
                zero_flat = [None if g is None else g == 0 for g in g_flat]
            u_flat = [None if u is None else u.contiguous() for u in stage.apply_flat(
                g_flat if u_flat is None else u_flat, zero_flat if skip else None)]
            continue
        last = k == len(parts) - 1
        new, state = launch_call(part, checked[k], params, state, spec, paths, p_flat,
                                 g_flat, donate, output if last else "u", x_flat=u_flat,
                                 remember=False)
        if not last:
            u_flat = tree_lib.flatten_like(spec, new, "updates", paths)
    return (new, state), None
