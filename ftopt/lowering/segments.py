"""Chains with matrix stages: elementwise segments fused, matrix stages in torch between.

A chain ``[rules A] -> matrix stage M -> [rules B]`` (:mod:`ftopt.matrix`) runs as: the
segment A as a fused update kernel (its states written as a step writes them, its update
to an fp32 buffer), M on that buffer with batched torch ops, then the segment B as a
fused step (or update) kernel that reads M's output as its input (the ``x`` role) and
the raw gradient for ``skip_zeros`` (SPEC §3: the mask is always the raw gradient's). A
chain that ends in a matrix stage has an empty last segment: ``p + u`` in one kernel.

Inside ``masked``/``partition`` (``ftopt.muon``: a Muon branch for matrices, an Adam
branch for the rest) a segment holds the branches' pieces between their matrix stages
(:func:`ftopt.stages.chain_stages` aligns the branches on their last matrix stage) and
runs on the leaves some piece of it applies to (the last segment on every leaf: it
writes the params); a matrix stage runs on its branch's leaves only. A leaf whose
branch starts in a later segment reads its raw gradient there, the others their
previous part's output: a per-leaf flag (``seeded="mixed"``) picks, so each segment
stays one launch per group.

Every segment's checks run before the first kernel, so a call that cannot fuse falls
back to the eager path with nothing written.
"""

from __future__ import annotations

import torch

from ftopt import tree as tree_lib
from ftopt._counts import host_count, remember_count
from ftopt.lowering.calls import checked_call, launch_call, passed_through
from ftopt.lowering.plan import ChainPlan
from ftopt.lowering.runs import leaves_of
from ftopt.stages import state_at, with_state_at

__all__ = ["run", "leaves_of"]

_FP32 = [torch.float32]


def run(plan: ChainPlan, params, state, spec, paths, p_flat, g_flat, backend: str,
        donate: bool, output: str):
    """A step (``output="p"``) or an update (``"u"``) of a segmented plan:
    ``((new params or updates, new state), None)``, or ``(None, reason)``."""
    parts = plan.segments
    found = leaves_of(plan, spec, params, p_flat, g_flat, paths)
    checked = {}
    for k, (part, mine) in enumerate(zip(parts, found)):
        if not isinstance(part, ChainPlan):
            own = _only(g_flat, mine)
            part[0].check_shards(paths, own)  # before any kernel writes a state
            if hasattr(part[0], "check_state"):
                part[0].check_state(state_at(state, part[2]), own, p_flat, spec, paths)
            continue
        out = output if k == len(parts) - 1 else "u"
        got, reason = checked_call(part, params, state, paths, p_flat,
                                   _only(g_flat, mine[1]), backend, donate, out, spec,
                                   selection=mine[0])
        if reason is not None:
            return None, reason
        checked[k] = got
    u_flat = list(g_flat)  # each leaf's input to the next part (first: the raw gradient)
    # ... and its dtype on the eager path, where a leaf a segment passes through keeps
    # its input's (u_flat holds the kernel's fp32 update: a seeded segment reads fp32)
    dtypes = [None if g is None else g.dtype for g in g_flat]
    zero_flat = None
    new = None
    for k, (part, mine) in enumerate(zip(parts, found)):
        if not isinstance(part, ChainPlan):
            stage, skip, path, _ = part
            if skip and zero_flat is None:
                zero_flat = [None if g is None else g == 0 for g in g_flat]
            out_flat, stage_state = stage.run_flat(
                _only(u_flat, mine), _only(zero_flat, mine) if skip else None,
                state_at(state, path), p_flat, spec, paths)
            u_flat = [_aligned(u) if on else old
                      for u, old, on in zip(out_flat, u_flat, mine)]
            dtypes = [u.dtype if on else d for u, d, on in zip(out_flat, dtypes, mine)]
            if donate:
                stage_state = _write_back(state_at(state, path), stage_state)
            state = with_state_at(state, path, stage_state)
            continue
        _, on, seeded = mine
        last = k == len(parts) - 1
        new, state = launch_call(part, checked[k], params, state, spec, paths, p_flat,
                                 _only(g_flat, on), donate, output if last else "u",
                                 x_flat=_only(u_flat, seeded), remember=False,
                                 through_dtypes=dtypes if last else _FP32 * len(dtypes))
        if not last:
            got = tree_lib.flatten_like(spec, new, "updates", paths)
            u_flat = [u if o else old for u, old, o in zip(got, u_flat, on)]
            through = set(passed_through(part, checked[k][3], checked[k][2]))
            dtypes = [torch.float32 if o and i not in through else d
                      for i, (d, o) in enumerate(zip(dtypes, on))]
    return (new, state), None


def _aligned(u):
    """``u`` contiguous at a 16-byte aligned address: a matrix stage's leaves are views of
    its batch (the second of two 15-element leaves starts 60 bytes in), and an unaligned
    address picks the kernel variant without vectorized loads, whose reductions add in
    another order on a GPU: the skip_zeros step (whose masked leaves are new tensors)
    would then part from the plain one in the last bit (H200 fuzz, seed 20 example
    1804)."""
    if u is None:
        return u
    u = u.contiguous()
    return u if u.data_ptr() % 16 == 0 else u.clone()


def _only(flat, keep):
    """``flat`` with ``None`` where ``keep`` is false."""
    if flat is None:
        return None
    return [x if k else None for x, k in zip(flat, keep)]


def _write_back(old, new):
    """A donated stage state: ``new`` copied into ``old``'s tensors (counts keep their
    host mirror, so the next step reads no device value)."""
    old_flat = tree_lib.leaves(old)
    new_flat = tree_lib.structure(old).flatten_up_to(new)
    olds, news, counts = [], [], []
    for o, n in zip(old_flat, new_flat):
        if isinstance(o, torch.Tensor) and o is not n:
            olds.append(o)
            news.append(n)
            if n.ndim == 0 and not n.is_floating_point():
                counts.append((o, host_count(n)))
    with torch.no_grad():
        if all(type(t) is torch.Tensor for t in olds + news):
            # One multi-tensor copy per dtype (NovoGrad's 0-d nu leaves: not a launch per
            # leaf; torch's fast route takes lists of one dtype only).
            kinds: dict = {}
            for o, n in zip(olds, news):
                kinds.setdefault((o.dtype, n.dtype, o.device), []).append((o, n))
            for pairs in kinds.values():
                torch._foreach_copy_([o for o, _ in pairs], [n for _, n in pairs])
        else:
            for o, n in zip(olds, news):
                o.copy_(n)
    for o, known in counts:
        if known is not None:
            remember_count(o, known)
    return old
