"""The one trace of a chain (ftopt.program.trace_chain), on a recording algebra.

Every backend (eager Vec, chunked CPU programs, Triton symbols) evaluates this same
program; here its values are strings, so the test reads what the chain computes.
"""

from __future__ import annotations

import ftopt
from ftopt import program
from ftopt.rules import Rule, Slot


class Text:
    """Expressions as strings; the body's arithmetic builds them."""

    def __init__(self, s: str):
        self.s = s

    def _bin(self, o, op):
        other = o.s if isinstance(o, Text) else repr(o)
        return Text(f"({self.s} {op} {other})")

    def __add__(self, o):
        return self._bin(o, "+")

    def __mul__(self, o):
        return self._bin(o, "*")

    def __rmul__(self, o):
        return Text(f"({o!r} * {self.s})")


class Ops:
    def sign(self, x):
        return Text(f"sign({x.s})")


class Recorder:
    def __init__(self, active=None, flags=False):
        self.active, self.flags, self.slots = active, flags, {}

    def ops(self):
        return Ops()

    def zero_mask(self, g):
        return Text(f"zero({g.s})")

    def neg_zero(self, g):
        return Text("-0.0")

    def select(self, mask, a, b):
        return Text(f"where({mask.s}, {a.s}, {b.s})")

    def elem(self, value, like):
        return value

    def stage_inputs(self, index, rule, u):
        if self.active is not None and index not in self.active:
            return None
        inputs = {s.name: Text(f"{s.name}{index}") for s in rule.slots}
        inputs.update({"p": Text("p"), "decay": 0.5})
        return inputs

    def leaf_flag(self, index):
        return Text(f"flag{index}") if self.flags else None

    def slot_out(self, index, name, value):
        self.slots[(index, name)] = value.s


TRACE = Rule("trace", lambda o, x: (x.u + x.decay * x.tr, {"tr": x.u + x.decay * x.tr}),
             slots=(Slot("tr"),))
SIGN = Rule("sign", lambda o, x: (o.sign(x.u), {}))


def test_skip_aware_stages_select_the_old_slot_and_negative_zero():
    rec = Recorder()
    u = program.trace_chain([TRACE, SIGN], [True, True], rec, Text("g"))
    assert rec.slots[(0, "tr")] == "where(zero(g), tr0, (g + (0.5 * tr0)))"
    assert u.s == ("where(zero(g), -0.0, sign(where(zero(g), -0.0, (g + (0.5 * tr0)))))")


def test_without_skip_zeros_no_select_is_traced():
    rec = Recorder()
    u = program.trace_chain([TRACE, SIGN], [False, False], rec, Text("g"))
    assert rec.slots[(0, "tr")] == "(g + (0.5 * tr0))" and "where" not in u.s
    rec = Recorder()  # a kernel that stores no zero-gradient lane selects nothing either
    u = program.trace_chain([TRACE], [True], rec, Text("g"), selects=False)
    assert "where" not in u.s + rec.slots[(0, "tr")]


def test_a_leaf_a_stage_passes_through_is_still_skipped():
    rec = Recorder(active={1})
    u = program.trace_chain([TRACE, SIGN], [True, True], rec, Text("g"))
    assert (0, "tr") not in rec.slots
    assert u.s == "where(zero(g), -0.0, sign(where(zero(g), -0.0, g)))"
    rec = Recorder(flags=True)  # leaf masks kept in the values (the fused kernels)
    u = program.trace_chain([SIGN], [False], rec, Text("g"))
    assert u.s == "where(flag0, sign(g), g)"


def test_every_backend_traces_through_it(monkeypatch):
    """The eager, chunked and fused paths all run the chain through trace_chain."""
    import torch

    calls = []
    real = program.trace_chain
    monkeypatch.setattr(program, "trace_chain",
                        lambda *a, **k: calls.append(type(a[2]).__name__) or real(*a, **k))
    tx = ftopt.chain(ftopt.scale_by_sign(), ftopt.scale(0.1), ftopt.skip_zeros())
    params, grads = {"w": torch.randn(8)}, {"w": torch.randn(8)}
    state = tx.init(params)
    ftopt.step(tx, params, grads, state, backend="eager")  # the chunked CPU step
    with torch.enable_grad():  # differentiable: the Vec path, one op per leaf
        wanting = {"w": grads["w"].clone().requires_grad_()}
        ftopt.step(tx, params, wanting, state, backend="eager")
    from ftopt.lowering.plan import plan_chain

    plan_chain(ftopt.chain(ftopt.scale_by_sign(), ftopt.scale(0.2))).traced(False, "p")
    assert {"_StepAlgebra", "_VecAlgebra", "SymbolicAlgebra"} <= set(calls), calls
