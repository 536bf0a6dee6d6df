"""Triton symbols for :func:`ftopt.program.trace_chain`: the algebra the fused kernel
generator traces a chain with (:func:`ftopt.lowering.codegen.trace_chain`)."""

from __future__ import annotations

from ftopt.lowering import leaf_slots
from ftopt.lowering.symbolic import Graph, SymOps
from ftopt.rules import step_scalars

__all__ = ["SymbolicAlgebra", "as_name"]


class SymbolicAlgebra:
    """Triton symbols for :func:`ftopt.program.trace_chain`: inputs are loads through the
    address tables, per-step scalars kernel arguments, leaf masks per-leaf values."""

    def __init__(self, traced, p, zero, neg_zero):
        """``traced``: the :class:`ftopt.lowering.codegen.TracedChain` being built."""
        self.traced, self.graph, self.p = traced, traced.graph, p
        self.zero, self.negative_zero = zero, neg_zero
        self._ops = SymOps(self.graph)
        self._flags: dict = {}

    def ops(self):
        return self._ops

    def zero_mask(self, g):
        return self.zero

    def neg_zero(self, g):
        return self.negative_zero

    def select(self, mask, a, b):
        if getattr(a, "name", None) is not None and a.name == getattr(b, "name", None):
            return a  # (a slot the body returns as it was: kept, and no store if donated)
        return self._ops.where(mask, a, b)

    def elem(self, value, like):
        return value  # symbols broadcast in the kernel; constants become nodes at stores

    def stage_inputs(self, index: int, rule, u) -> dict:
        inputs = {"p": self.p}
        if rule.indexed:  # (the leaf's position in the tree: a per-leaf value)
            o = self._ops
            # Where the leaf's elements start in its full tensor (a shard's offset).
            start = o.add32(o.u32(self.graph.leaf_value(None, "start_lo")),
                            o.mul32(o.u32(self.graph.leaf_value(None, "start_hi")), 1 << 16))
            offs = self.graph.add("offs.to(tl.uint32)", (), "elem", name="index")
            inputs["index"] = o.add32(offs, start)
            first = o.add32(self.graph.add("start.to(tl.uint32)", (), "leaf"), start)
            self.graph.firsts[inputs["index"].name] = first.name  # (for ``o.paired``)
            inputs["leaf"] = o.u32(self.graph.leaf_value(None, "leaf"))
        in_place = self.traced.in_place
        flag = self.leaf_flag(index) if rule.slots else None
        for slot in rule.slots:
            role = f"st{index}_{slot.name}"
            self.traced.slot_roles.append((index, slot.name))
            if slot.per_leaf:
                self.traced.leaf_slots.add(role)
                deps = () if flag is None else (flag.name,)
                if flag is not None:
                    self.traced.slot_flags[role] = flag.name
                inputs[slot.name] = self.graph.add(leaf_slots.load(role, flag), deps, "leaf",
                                                   name=f"{role}_old")
                continue
            deps, mask = ("keep",) if in_place else (), "{LMASK}"
            if flag is not None:
                self.traced.slot_flags[role] = flag.name
                deps, mask = (*deps, flag.name), f"{{LMASK@{flag.name}}}"
            inputs[slot.name] = self.graph.add(f"tl.load({role}_in + offs{mask})", deps,
                                               "elem", name=f"{role}_old")
        alternatives = self.traced.positions[index]
        branch = (self.graph.leaf_value(index, "branch") if len(alternatives) > 1
                  else None)
        for key in step_scalars(rule, 0, 1):
            # One kernel argument per alternative; a leaf reads its branch's.
            value = self.graph.scalar(alternatives[-1], key)
            for j in range(len(alternatives) - 2, -1, -1):
                value = self._ops.where(branch == float(j),
                                        self.graph.scalar(alternatives[j], key), value)
            inputs[key] = value
        return inputs

    def leaf_flag(self, index: int):
        if not self.traced.flagged[index]:
            return None
        if index not in self._flags:
            self._flags[index] = self.graph.leaf_value(index, "mask") != 0.0
        return self._flags[index]

    def slot_out(self, index: int, name: str, value) -> None:
        self.traced.stores.append((f"st{index}_{name}_out", as_name(value, self.graph)))

    def running_out(self, index: int, name: str, value) -> None:
        self.traced.running_stores.append((f"run{index}_{name}", as_name(value, self.graph)))


def as_name(value, g: Graph) -> str:
    """The node name of a body's value (a number becomes a constant node)."""
    if hasattr(value, "name"):
        return value.name
    return g.add(f"tl.full((), {float(value)!r}, tl.float32)", (), "scalar").name
