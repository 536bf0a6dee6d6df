"""The chunked CPU backend's entry points (installed in :mod:`ftopt.dispatch` as
``chunked``): a whole eager step of a chain as one program (:mod:`ftopt.chunked.step`),
and one rule's body over all leaves (:func:`evaluate`), both run over cache-sized chunks
of all leaves on the CPU. Each returns ``None`` where it does not apply; the caller then
runs the eager Vec path, which computes the same bits.
"""

from __future__ import annotations

import torch

from ftopt import program
from ftopt.chunked import run
from ftopt.chunked.program import NotTraceable, Program, TraceOps
from ftopt.chunked.run import chunkable
from ftopt.chunked.step import eager_step as step
from ftopt.rules import Rule, compute_dtype

__all__ = ["evaluate", "step"]


def evaluate(rule: Rule, us, ps, old: dict, masks: list, scalars: dict):
    """One rule's body over all active leaves, as the eager Vec path computes it (the
    same torch ops, so the same bits: ``ftopt.rule_transform._run_vec``), traced into a
    program and run over cache-sized chunks of all leaves: ``(updates, new slots)`` in the
    compute dtype, zero-gradient elements masked; ``None`` where it cannot run (a norm in
    the body, a leaf off the CPU)."""
    if rule.indexed:
        return None  # it reads element and leaf positions, which chunks of leaves lose
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
        inputs = {"u": [us[j] for j in js]}
        algebra = ChunkAlgebra(prog, compute, inputs, js, ps, old, masks, scalars)
        g = prog.convert(prog.input("u", us[js[0]].dtype), compute)
        try:
            u = program.trace_chain([rule], [masked], algebra, g)
            results = {"u": prog.as_elem(u, compute), **algebra.results}
        except NotTraceable:
            return None
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


class ChunkAlgebra:
    """Traced chunk programs for :func:`ftopt.program.trace_chain`, one group of leaves
    (one dtype signature) at a time: every value is a :class:`Program` symbol; inputs
    are collected in ``inputs`` (name -> the group's tensors), slots in ``results``."""

    def __init__(self, prog: Program, compute, inputs: dict, js, ps, old: dict, masks,
                 scalars: dict):
        self.prog, self.compute, self.inputs, self.js = prog, compute, inputs, js
        self.ps, self.old, self.masks, self.scalars = ps, old, masks, scalars
        self._ops = TraceOps(prog)
        self.results: dict = {}

    def ops(self):
        return self._ops

    def zero_mask(self, g):
        self.inputs["mask"] = [self.masks[j] for j in self.js]
        return self.prog.input("mask", self.masks[self.js[0]].dtype)

    def neg_zero(self, g):
        return torch.full((), -0.0, dtype=self.compute, device="cpu")

    def select(self, mask, a, b):
        return self.prog.where(mask, a, b)

    def elem(self, value, like):
        return self.prog.as_elem(value, self.compute)

    def stage_inputs(self, index: int, rule: Rule, u) -> dict:
        prog, js, inputs = self.prog, self.js, {}
        if rule.uses_params:
            p = prog.input("p", self.ps[js[0]].dtype)
            inputs["p"] = prog.convert(p, compute_dtype(self.ps[js[0]]))
            self.inputs["p"] = [self.ps[j] for j in js]
        for name, leaves in self.old.items():
            dtype = leaves[js[0]].dtype
            inputs[name] = prog.input("s:" + name, dtype)
            if dtype in (torch.float16, torch.bfloat16):  # 16-bit storage: fp32 math
                inputs[name] = prog.convert(inputs[name], self.compute)
            self.inputs["s:" + name] = [leaves[j] for j in js]
        return {**inputs, **self.scalars}

    def leaf_flag(self, index: int):
        return None

    def running_out(self, index: int, name: str, value) -> None:
        raise NotTraceable("a running scalar computed by the body")

    def slot_out(self, index: int, name: str, value) -> None:
        self.results["s:" + name] = value
