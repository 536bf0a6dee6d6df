"""Symbolic evaluation of rule bodies: a chain of rules becomes one expression graph.

Running a rule body on :class:`Sym` values records each operation as a :class:`Node`
whose ``expr`` is Triton source. Nodes are created in dependency order, so any subset of
them, emitted in creation order, is a valid kernel body. Norms become
:class:`Reduction` records: the kernel that needs a norm reads it from a buffer filled by
an earlier reduction pass.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

from ftopt.eager import U32_MASK, check_u32_constant

_KIND_ORDER = {"scalar": 0, "leaf": 1, "elem": 2}


@dataclass
class Node:
    name: str
    expr: str
    deps: tuple[str, ...]
    kind: str
    level: int  # 1 + the highest reduction level this node reads (0: none)


@dataclass
class Reduction:
    """sum(x²) over a leaf (``scope='leaf'``) or over every leaf (``scope='global'``);
    sum(x) where ``square`` is false (``global_sum``)."""

    index: int
    source: str
    scope: str
    level: int
    square: bool = True


@dataclass
class Graph:
    nodes: dict[str, Node] = field(default_factory=dict)
    reductions: list[Reduction] = field(default_factory=list)
    scalars: list[tuple[int, str]] = field(default_factory=list)  # (stage, name)
    leaf_values: list[tuple[int, str]] = field(default_factory=list)
    # ``@triton.jit`` helpers the nodes call (name -> source), printed before the kernel.
    helpers: dict[str, str] = field(default_factory=dict)
    # An element-position node -> the node of its block's first position (``o.paired``).
    firsts: dict[str, str] = field(default_factory=dict)
    _cse: dict[str, str] = field(default_factory=dict)

    def add(self, expr: str, deps: tuple[str, ...], kind: str, level: int | None = None,
            name: str | None = None) -> Sym:
        if name is None and expr in self._cse:
            return self.sym(self._cse[expr])
        name = name or f"v{len(self.nodes)}"
        if level is None:
            level = max((self.nodes[d].level for d in deps if d in self.nodes), default=0)
        self.nodes[name] = Node(name, expr, deps, kind, level)
        self._cse[expr] = name
        return Sym(name, kind, self)

    def sym(self, name: str) -> Sym:
        return Sym(name, self.nodes[name].kind, self)

    def _needs(self, roots: list[str]) -> set[str]:
        """The names of ``roots`` and of every node they depend on."""
        needed: set[str] = set()
        stack = list(roots)
        while stack:
            name = stack.pop()
            if name in needed or name not in self.nodes:
                continue
            needed.add(name)
            stack.extend(self.nodes[name].deps)
        return needed

    def closure(self, roots: list[str]) -> list[Node]:
        """The nodes ``roots`` depend on, in creation order."""
        needed = self._needs(roots)
        return [n for n in self.nodes.values() if n.name in needed]

    def loads_first(self, nodes: list[Node]) -> list[Node]:
        """``nodes`` (in creation order) with every load (of a state: ``*_old``) and
        what it needs first, the rest after: a later stage's load is issued before the
        earlier stages' arithmetic, not after it (``tiles.LOADS_FIRST``)."""
        early = self._needs([n.name for n in nodes
                             if n.name.endswith("_old") or n.expr.startswith("tl.load(")])
        return ([n for n in nodes if n.name in early]
                + [n for n in nodes if n.name not in early])

    def scalar(self, stage: int, name: str) -> Sym:
        index = len(self.scalars)
        self.scalars.append((stage, name))
        return self.add(f"tl.load(scalars_ptr + {index})", (), "scalar", name=f"s{index}")

    def leaf_value(self, stage: int, name: str) -> Sym:
        index = len(self.leaf_values)
        self.leaf_values.append((stage, name))
        return self.add(f"tl.load(leaf_values_ptr + leaf * N_LEAF_VALUES + {index})", (),
                        "leaf", name=f"lv{index}")


def _literal(x) -> str:
    if isinstance(x, bool):
        return "True" if x else "False"
    x = float(x)
    if x == 0.0 and math.copysign(1.0, x) < 0:
        # Written "-0.0", the sign can be lost (unary minus lowered as 0 - x).
        return "(0.0 * -1.0)"
    return repr(x)


class Sym:
    """A value of a rule body during tracing (see the module docstring)."""

    __slots__ = ("name", "kind", "graph")

    def __init__(self, name: str, kind: str, graph: Graph):
        self.name = name
        self.kind = kind
        self.graph = graph

    def _operand(self, other) -> tuple[str, tuple[str, ...], str]:
        if isinstance(other, Sym):
            return other.name, (other.name,), other.kind
        if isinstance(other, (int, float)):
            return _literal(other), (), "scalar"
        raise TypeError(f"cannot use {type(other).__name__} in a fused rule body")

    def _binary(self, other, template: str, reverse: bool = False) -> Sym:
        o_expr, o_deps, o_kind = self._operand(other)
        a, b = (o_expr, self.name) if reverse else (self.name, o_expr)
        kind = max(self.kind, o_kind, key=_KIND_ORDER.__getitem__)
        return self.graph.add(template.format(a=a, b=b), (self.name, *o_deps), kind)

    def __add__(self, o):
        return self._binary(o, "{a} + {b}")

    def __radd__(self, o):
        return self._binary(o, "{a} + {b}", True)

    def __sub__(self, o):
        return self._binary(o, "{a} - {b}")

    def __rsub__(self, o):
        return self._binary(o, "{a} - {b}", True)

    def __mul__(self, o):
        return self._binary(o, "{a} * {b}")

    def __rmul__(self, o):
        return self._binary(o, "{a} * {b}", True)

    def __truediv__(self, o):
        o = _constant(o, self.graph)
        if self.kind == "elem" and o.kind != "elem":
            # One correctly rounded reciprocal per program, then a multiply per element.
            inverse = self.graph.add(f"tl.div_rn(1.0, {o.name})", (o.name,), o.kind)
            return self * inverse
        return self._binary(o, "tl.div_rn({a}, {b})")

    def __rtruediv__(self, o):
        return self._binary(_constant(o, self.graph), "tl.div_rn({a}, {b})", True)

    def __neg__(self):
        # x * -1.0 flips the sign of zeros too (0 - x, which some Triton versions emit
        # for a unary minus, does not).
        return self.graph.add(f"{self.name} * -1.0", (self.name,), self.kind)

    def __gt__(self, o):
        return self._binary(o, "{a} > {b}")

    def __ge__(self, o):
        return self._binary(o, "{a} >= {b}")

    def __lt__(self, o):
        return self._binary(o, "{a} < {b}")

    def __le__(self, o):
        return self._binary(o, "{a} <= {b}")

    def __eq__(self, o):  # type: ignore[override]
        return self._binary(o, "{a} == {b}")

    def __ne__(self, o):  # type: ignore[override]
        return self._binary(o, "{a} != {b}")

    def __and__(self, o):
        return self._binary(o, "{a} & {b}")

    def __or__(self, o):
        return self._binary(o, "{a} | {b}")

    __hash__ = None


class SymOps:
    """The ``ops`` namespace of rule bodies, recording Triton expressions."""

    def __init__(self, graph: Graph):
        self.graph = graph

    def _unary(self, x, template: str) -> Sym:
        if not isinstance(x, Sym):
            raise TypeError("fused ops take traced values")
        return self.graph.add(template.format(x=x.name), (x.name,), x.kind)

    def sqrt(self, x) -> Sym:
        return self._unary(x, "tl.sqrt_rn({x})")

    def abs(self, x) -> Sym:
        return self._unary(x, "tl.abs({x})")

    def cbrt(self, x) -> Sym:
        """The cube root of x >= 0 (NaN below 0): 2^(log2(x)/3), then one Newton step
        (y + (x/y² − y)/3), so an approximate log2/exp2 still gives the root to about an
        ulp. x <= 0 (and NaN) take √x: 0, or NaN; inf is its own root."""
        x = _as_sym(x, self.graph)
        positive = x > 0.0
        safe = self.where(positive, x, 1.0)  # no log2(0) or 0/0 in the lanes not taken
        guess = self._unary(safe, "tl.exp2(tl.log2({x}) * 0.3333333333333333)")
        root = guess + (safe / (guess * guess) - guess) * 0.3333333333333333
        finite = guess * 0.0 == 0.0  # false for inf
        return self.where(positive, self.where(finite, root, guess), self.sqrt(x))

    def sign(self, x) -> Sym:
        return self._unary(x, "tl.where({x} > 0, 1.0, tl.where({x} < 0, -1.0, 0.0))")

    def where(self, cond, a, b) -> Sym:
        return self._call("tl.where", cond, a, b)

    def _call(self, fn: str, *args) -> Sym:
        parts = [Sym._operand(_as_sym(args[0], self.graph), v) for v in args]
        kind = max((p[2] for p in parts), key=_KIND_ORDER.__getitem__)
        deps = tuple(d for p in parts for d in p[1])
        return self.graph.add(f"{fn}({', '.join(p[0] for p in parts)})", deps, kind)

    def lerp(self, start, end, weight) -> Sym:
        """start + weight·(end − start) as ``torch.lerp`` computes it: its two formulas,
        each one fused multiply-add (torch's kernels are compiled so, on the CPU and on
        CUDA), so the fused path rounds as the eager one does. An explicit ``tl.fma`` is
        the same in every kernel variant (no contraction is left to the compiler)."""
        start, end, weight = (_as_sym(v, self.graph) for v in (start, end, weight))
        diff = end - start
        low = self._call("tl.fma", weight, diff, start)  # start + weight·diff
        high = self._call("tl.fma", diff * -1.0, 1.0 - weight, end)  # end − diff·(1−w)
        return self.where(weight < 0.5, low, high)

    def log(self, x) -> Sym:
        return self._unary(_as_sym(x, self.graph), "tl.log({x})")

    def cos(self, x) -> Sym:
        return self._unary(_as_sym(x, self.graph), "tl.cos({x})")

    def sin(self, x) -> Sym:
        return self._unary(_as_sym(x, self.graph), "tl.sin({x})")

    def paired(self, fn, index, *args) -> Sym:
        """Per element, ``even`` or ``odd`` of ``fn(o, k, *args) -> (even, odd)`` for its
        pair ``k = index >> 1``, as the eager op: each pair is computed once.

        ``fn`` is traced into a ``@triton.jit`` helper over the ``BLOCK // 2`` pairs of a
        block, whose two results are interleaved. A leaf whose elements start at an odd
        position (a shard) has blocks that cut pairs in two: its programs take the other
        branch of the helper, which computes each element's pair (twice the work)."""
        graph = self.graph
        first = graph.firsts.get(index.name) if isinstance(index, Sym) else None
        if first is None:
            raise TypeError("o.paired takes the element positions x.index")
        args = [_as_sym(a, graph) for a in args]
        sub = Graph()
        inputs = ["k"] + [f"a{i}" for i in range(len(args))]
        k, *params = (sub.add(name, (), "elem" if name == "k" else "scalar", name=name)
                      for name in inputs)
        even, odd = fn(SymOps(sub), k, *params)
        body = [f"{n.name} = {n.expr}" for n in sub.closure([even.name, odd.name])
                if n.name not in inputs]
        pair = "\n".join(["(" + ", ".join(inputs) + "):"] + body
                         + [f"return {even.name}, {odd.name}"])
        key = hashlib.sha256(pair.encode()).hexdigest()[:12]
        graph.helpers.setdefault(f"ftopt_pair_{key}", _pair_helpers(key, inputs, body,
                                                                      even.name, odd.name))
        call = ", ".join([index.name, first] + [a.name for a in args] + ["BLOCK // 2"])
        deps = (index.name, first, *(a.name for a in args))
        return graph.add(f"ftopt_paired_{key}({call})", deps, "elem")

    # 32-bit unsigned integers: uint32 in the kernel (its arithmetic wraps modulo 2**32).
    def u32(self, x) -> Sym:
        if not isinstance(x, Sym):
            return self.graph.add(_u32_literal(int(x)), (), "scalar")
        return self._unary(x, "{x}.to(tl.uint32)")

    def _int_binary(self, a, b, template: str) -> Sym:
        a = a if isinstance(a, Sym) else self.u32(a)
        b_expr, b_deps, b_kind = ((b.name, (b.name,), b.kind) if isinstance(b, Sym)
                                  else (_u32_literal(int(b)), (), "scalar"))
        kind = max(a.kind, b_kind, key=_KIND_ORDER.__getitem__)
        return self.graph.add(template.format(a=a.name, b=b_expr), (a.name, *b_deps), kind)

    def xor(self, a, b) -> Sym:
        return self._int_binary(a, b, "{a} ^ {b}")

    def shr(self, a, bits: int) -> Sym:
        return self._int_binary(a, int(bits), "{a} >> {b}")

    def mul32(self, a, constant: int) -> Sym:
        check_u32_constant(constant)
        return self._int_binary(a, constant, "{a} * {b}")

    def add32(self, a, b) -> Sym:
        return self._int_binary(a, b, "{a} + {b}")

    def to_float(self, a) -> Sym:
        return self._unary(a, "{x}.to(tl.float32)")

    def float_bits(self, x) -> Sym:
        return self._unary(x, "{x}.to(tl.float32).to(tl.uint32, bitcast=True)")

    def from_bits(self, a) -> Sym:
        return self._unary(a, "{x}.to(tl.uint32).to(tl.float32, bitcast=True)")

    def maximum(self, a, b) -> Sym:
        return self.where(_as_sym(a, self.graph) >= b, a, b)

    def minimum(self, a, b) -> Sym:
        return self.where(_as_sym(a, self.graph) <= b, a, b)

    def _norm(self, x: Sym, scope: str, square: bool = True) -> Sym:
        graph = self.graph
        x = _as_sym(x, graph)
        level = graph.nodes[x.name].level + 1
        index = len(graph.reductions)
        graph.reductions.append(Reduction(index, x.name, scope, level, square))
        if not square:
            return graph.add(f"tl.load(global_reductions_ptr + {index})", (), "scalar",
                             level=level, name=f"r{index}")
        if scope == "leaf":
            expr = f"tl.sqrt_rn(tl.load(reductions_ptr + leaf * N_REDUCTIONS + {index}))"
            kind = "leaf"
        else:
            expr = f"tl.sqrt_rn(tl.load(global_reductions_ptr + {index}))"
            kind = "scalar"
        return graph.add(expr, (), kind, level=level, name=f"r{index}")

    def leaf_norm(self, x) -> Sym:
        return self._norm(x, "leaf")

    def global_norm(self, x) -> Sym:
        return self._norm(x, "global")

    def global_sum(self, x) -> Sym:
        """Σ x over every element of every leaf: per-block partials in the reduction
        pass, summed per leaf in a fixed order, then over the leaves."""
        return self._norm(x, "global", square=False)


def _pair_helpers(key: str, inputs: list[str], body: list[str], even: str,
                  odd: str) -> str:
    """The source of ``o.paired``'s two helpers: the traced pair function, and the
    per-block evaluation (interleaved pairs where the block starts at an even position,
    each element's own pair where it starts at an odd one: a uniform branch)."""
    args = ", ".join(inputs[1:])
    tail = ", " + args if args else ""
    lines = ["@triton.jit", f"def ftopt_pair_{key}({', '.join(inputs)}):"]
    lines += ["    " + line for line in body] + [f"    return {even}, {odd}", "", "",
              "@triton.jit",
              f"def ftopt_paired_{key}(index, first{tail}, HALF: tl.constexpr):",
              # (Triton wants a name bound in both branches to have one type in both:
              # only ``value`` is shared, the halves have their own names.)
              "    if (first & 1) == 0:",
              "        # (pair positions wrap as the element positions do, modulo 2**31)",
              "        k = ((first >> 1) + tl.arange(0, HALF).to(tl.uint32)) & 0x7FFFFFFF",
              f"        even_half, odd_half = ftopt_pair_{key}(k{tail})",
              "        value = tl.interleave(even_half, odd_half)",
              "    else:",
              f"        even_own, odd_own = ftopt_pair_{key}(index >> 1{tail})",
              "        value = tl.where((index & 1) == 0, even_own, odd_own)",
              "    return value"]
    return "\n".join(lines) + "\n"


def _u32_literal(c: int) -> str:
    # An int literal below 2**31 is an int32 constant, which a uint32 operand promotes
    # to uint32; larger ones are spelled as uint32 (an int64 literal would widen).
    c &= U32_MASK
    return str(c) if c < 2**31 else f"tl.full((), {c}, tl.uint32)"


def _constant(x, graph: Graph) -> Sym:
    if isinstance(x, Sym):
        return x
    return graph.add(f"tl.full((), {_literal(x)}, tl.float32)", (), "scalar")


def _as_sym(x, graph: Graph) -> Sym:
    if isinstance(x, Sym):
        return x
    return graph.add(_literal(x), (), "scalar")
