"""The chunked CPU backend's entry points (installed in :mod:`ftopt.dispatch` as
``chunked``): a whole eager step of a chain as one program (:mod:`ftopt.chunked.step`),
and one rule's body over all leaves (:func:`evaluate`), both run over cache-sized chunks
of all leaves on the CPU. Each returns ``None`` where it does not apply; the caller then
runs the eager Vec path, which computes the same bits.
"""

from __future__ import annotations

import torch

from ftopt.chunked import run
from ftopt.chunked.program import NotTraceable, Program, TraceOps
from ftopt.chunked.run import chunkable
from ftopt.chunked.step import eager_step as step
from ftopt.rules import Env, Rule, compute_dtype

__all__ = ["evaluate", "step"]


def evaluate(rule: Rule, us, ps, old: dict, masks: list, scalars: dict):
    """One rule's body over all active leaves, as the eager Vec path computes it (the
    same torch ops, so the same bits: ``ftopt.rule_transform._run_vec``), traced into a
    program and run over cache-sized chunks of all leaves: ``(updates, new slots)`` in the
    compute dtype, zero-gradient elements masked; ``None`` where it cannot run (a norm in
    the body, a leaf off the CPU)."""
    masked = masks[0] is not None
    if any((m is not None) != masked for m in masks):
        return None
    if not chunkable(us + ps + [t for v in old.values() for t in v]):
        return None
    groups: dict[tuple, list[int]] = {}
    for j, u in enumerate(us):
        key = (u.dtype, ps[j].dtype if ps else None,
               tuple(v[j].dtype for v in old.values()), masks[j].dtype if masked else None)
        groups.setdefault(key, []).append(j)
    u_items: list = [None] * len(us)
    slot_items = {name: [None] * len(us) for name in old}
    for js in groups.values():
        prog = Program()
        prog.zero_dim_leaves = any(us[j].ndim == 0 for j in js)
        compute = compute_dtype(us[js[0]])
        env = {"u": prog.convert(prog.input("u", us[js[0]].dtype), compute)}
        inputs = {"u": [us[j] for j in js]}
        if rule.uses_params:
            p = prog.input("p", ps[js[0]].dtype)
            env["p"] = prog.convert(p, compute_dtype(ps[js[0]]))
            inputs["p"] = [ps[j] for j in js]
        for name, leaves in old.items():
            env[name] = prog.input("s:" + name, leaves[js[0]].dtype)
            inputs["s:" + name] = [leaves[j] for j in js]
        env.update(scalars)
        try:
            u_out, slots_out = rule.body(TraceOps(prog), Env(env))
            results = {"u": prog.as_elem(u_out, compute)}
            results.update({"s:" + name: prog.as_elem(slots_out[name], compute)
                            for name in old})
        except NotTraceable:
            return None
        if masked:
            m = prog.input("mask", masks[js[0]].dtype)
            inputs["mask"] = [masks[j] for j in js]
            neg_zero = torch.full((), -0.0, dtype=results["u"].dtype, device="cpu")
            results["u"] = prog.where(m, neg_zero, results["u"])
            for name in old:
                results["s:" + name] = prog.where(m, env[name], results["s:" + name])
        outputs = {}
        for name, value in results.items():
            prog.output(name, value)
            outputs[name] = [torch.empty(us[j].shape, dtype=value.dtype, device="cpu")
                             for j in js]
        run.run_program(prog, inputs, outputs)
        for j, t in zip(js, outputs.pop("u")):
            u_items[j] = t
        for name in old:
            for j, t in zip(js, outputs["s:" + name]):
                slot_items[name][j] = t
    return u_items, slot_items


