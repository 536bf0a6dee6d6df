"""Rule bodies traced into straight-line programs, for chunked evaluation on the CPU.

A rule body is traced into a :class:`Program` (values are :class:`Sym`) with the ops of
:class:`TraceOps`; :mod:`ftopt.chunked.run` runs it chunk by chunk over all leaves: the
same torch ops as the :class:`~ftopt.eager.Vec` path of :mod:`ftopt.eager`, so the same
bits, with each chunk kept in cache from the first op of the body to the last.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch

from ftopt.eager import _cbrt_number, _scalar_fn, _sign_number, _where, cbrt_tensor

# -- chunked evaluation on the CPU ----------------------------------------------------------
#
# On the CPU a foreach op is a loop over the leaves, so a body of k ops streams every leaf
# through memory k times, and every intermediate is a new full-size tensor. Instead a body
# is traced (once per step: scalars and Python control flow may change between steps) into
# a small straight-line program over symbolic values, and the program runs over chunks of
# all leaves at once: each chunk is small enough to stay in cache while every op of the
# program runs on it, intermediates live in a few reused chunk-sized buffers (an op writes
# over an operand that is dead after it), and results go straight into the output tensors.
# Every op is the torch op the foreach path calls on the whole leaf, so the numbers are the
# same bits; only the order of work and the memory it touches change.

class NotTraceable(Exception):
    """A body (or a call) the chunked evaluator cannot run; the caller uses :class:`Vec`."""


def _convert_into(src: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    return out.copy_(src)  # ``src.to(out.dtype)``, written into ``out``


def _fill_into(value, *, out: torch.Tensor) -> torch.Tensor:
    return out.fill_(value)


_TORCH_BINARY = {
    operator.add: torch.add,
    operator.sub: torch.sub,
    operator.mul: torch.mul,
    operator.truediv: torch.div,
    operator.gt: torch.gt,
    operator.ge: torch.ge,
    operator.lt: torch.lt,
    operator.le: torch.le,
    operator.eq: torch.eq,
    operator.ne: torch.ne,
    operator.and_: torch.bitwise_and,
    operator.or_: torch.bitwise_or,
}
_COMMUTATIVE = (operator.add, operator.mul, operator.eq, operator.ne, operator.and_,
                operator.or_)
_FLIPPED = {operator.gt: operator.lt, operator.lt: operator.gt, operator.ge: operator.le,
            operator.le: operator.ge}
_ARITHMETIC = (operator.add, operator.sub, operator.mul, operator.truediv)
# Ops whose results are never a signaling NaN (IEEE arithmetic quiets NaNs).
_ARITHMETIC_FNS = (torch.add, torch.sub, torch.mul, torch.div, torch.sqrt, torch.reciprocal,
                   torch.lerp)


class Sym:
    """A value of a traced body: one tensor per leaf once the :class:`Program` runs."""

    __slots__ = ("prog", "index")

    def __init__(self, prog: Program, index: int):
        self.prog = prog
        self.index = index

    @property
    def dtype(self) -> torch.dtype:
        return self.prog.dtypes[self.index]

    def __add__(self, o):
        return self.prog.binary(operator.add, self, o)

    def __radd__(self, o):
        return self.prog.binary(operator.add, o, self)

    def __sub__(self, o):
        return self.prog.binary(operator.sub, self, o)

    def __rsub__(self, o):
        return self.prog.binary(operator.sub, o, self)

    def __mul__(self, o):
        return self.prog.binary(operator.mul, self, o)

    def __rmul__(self, o):
        return self.prog.binary(operator.mul, o, self)

    def __truediv__(self, o):
        return self.prog.binary(operator.truediv, self, o)

    def __rtruediv__(self, o):
        return self.prog.binary(operator.truediv, o, self)

    def __gt__(self, o):
        return self.prog.binary(operator.gt, self, o)

    def __ge__(self, o):
        return self.prog.binary(operator.ge, self, o)

    def __lt__(self, o):
        return self.prog.binary(operator.lt, self, o)

    def __le__(self, o):
        return self.prog.binary(operator.le, self, o)

    def __eq__(self, o):  # type: ignore[override]
        return self.prog.binary(operator.eq, self, o)

    def __ne__(self, o):  # type: ignore[override]
        return self.prog.binary(operator.ne, self, o)

    def __and__(self, o):
        return self.prog.binary(operator.and_, self, o)

    def __or__(self, o):
        return self.prog.binary(operator.or_, self, o)

    def __neg__(self):
        return self.prog.unary(torch.neg, self)

    __hash__ = None


class Program:
    """A straight-line program of elementwise torch ops, built by tracing rule bodies.

    Values are inputs (one tensor per leaf, bound when the program runs), constants (a
    Python number or a 0-d tensor, the same for every leaf) or op results. Each op is
    recorded with a one-element probe evaluation, which gives its result dtype by torch's
    own promotion rules.
    """

    def __init__(self):
        self.dtypes: list[torch.dtype | None] = []
        self.kinds: list[str] = []  # "in", "const" or "op"
        self.consts: dict[int, Any] = {}
        self.code: list[tuple[Callable, tuple[int, ...], int]] = []
        self.inputs: dict[str, int] = {}
        self.outputs: list[tuple[str, int]] = []
        self._probes: list = []
        self._converted: dict[tuple[int, torch.dtype], Sym] = {}
        #: Set when some leaf is 0-d: a 0-d constant result is then that very tensor for
        #: such a leaf on the foreach path, which a program cannot express.
        self.zero_dim_leaves = False

    # -- building ---------------------------------------------------------------------
    def _new(self, kind: str, dtype, probe) -> int:
        self.dtypes.append(dtype)
        self.kinds.append(kind)
        self._probes.append(probe)
        return len(self.dtypes) - 1

    def input(self, name: str, dtype: torch.dtype) -> Sym:
        """A per-leaf input bound to the tensors named ``name`` when the program runs."""
        if name in self.inputs:
            return Sym(self, self.inputs[name])
        index = self._new("in", dtype, torch.ones(1, dtype=dtype, device="cpu"))
        self.inputs[name] = index
        return Sym(self, index)

    def _const(self, value) -> int:
        index = self._new("const", None, value)
        self.consts[index] = value
        return index

    def _operand(self, x) -> int:
        return x.index if isinstance(x, Sym) else self._const(x)

    def _emit(self, fn: Callable, args: tuple, probe: torch.Tensor) -> Sym:
        index = self._new("op", probe.dtype, probe)
        self.code.append((fn, args, index))
        return Sym(self, index)

    def _call(self, fn: Callable, *operands) -> Sym:
        args = tuple(self._operand(x) for x in operands)
        probe = fn(*(self._probes[a] for a in args))
        return self._emit(fn, args, probe)

    def binary(self, op: Callable, a, b):
        """``op(a, b)`` as the eager :class:`Vec` path computes it, leaf by leaf."""
        if not isinstance(a, Sym) and not isinstance(b, Sym):
            return op(a, b)  # scalars: computed now, as Vec does for two scalars
        if op not in _TORCH_BINARY:
            raise NotTraceable(f"operator {op.__name__}")
        if not isinstance(a, Sym):
            if op in _COMMUTATIVE:
                a, b = b, a
            elif op in _FLIPPED:
                a, b, op = b, a, _FLIPPED[op]
            elif op is operator.truediv and not isinstance(a, torch.Tensor):
                # ``number / tensor`` is ``tensor.reciprocal() * number`` in torch.
                return self.binary(operator.mul, self.unary(torch.reciprocal, b), a)
        sym = a if isinstance(a, Sym) else b
        if op in _ARITHMETIC:
            a, b = (_as_operand_tensor(x, sym.dtype) for x in (a, b))
        return self._call(_TORCH_BINARY[op], a, b)

    def unary(self, fn: Callable, x):
        if not isinstance(x, Sym):
            raise NotTraceable("unary op on a scalar")
        return self._call(fn, x)

    def where(self, cond, a, b):
        """``torch.where(cond, a, b)`` as :func:`_where` computes it, leaf by leaf."""
        if not any(isinstance(v, Sym) for v in (cond, a, b)):
            return _where(cond, a, b)
        if not isinstance(cond, (Sym, torch.Tensor)):
            return a if cond else b
        probes = [self._probes[v.index] if isinstance(v, Sym) else v for v in (cond, a, b)]
        dtype = torch.where(*probes).dtype
        a, b = (v if isinstance(v, (Sym, torch.Tensor))
                else torch.tensor(v, dtype=dtype, device="cpu") for v in (a, b))
        return self._call(torch.where, cond, a, b)

    def convert(self, x: Sym, dtype: torch.dtype) -> Sym:
        """``x.to(dtype)`` (``x`` itself when it already has that dtype)."""
        if x.dtype == dtype:
            return x
        key = (x.index, dtype)
        if key not in self._converted:
            probe = self._probes[x.index].to(dtype)
            self._converted[key] = self._emit(_convert_into, (x.index,), probe)
        return self._converted[key]

    def as_elem(self, x, dtype: torch.dtype) -> Sym:
        """A body result as a per-leaf value: a constant becomes a filled tensor of
        ``dtype``, as :func:`ftopt.rules._as_elem_items` broadcasts it."""
        if isinstance(x, Sym):
            return x
        if isinstance(x, torch.Tensor) and (x.ndim != 0 or self.zero_dim_leaves):
            raise NotTraceable("a body returned a constant tensor")
        value = torch.as_tensor(x, dtype=dtype, device="cpu")
        return self._emit(_fill_into, (self._const(value),), value.reshape(1).clone())

    def output(self, name: str, x: Sym) -> None:
        """Write ``x`` to the per-leaf tensors named ``name``."""
        self.outputs.append((name, x.index))

    # -- simplification ---------------------------------------------------------------
    def drop_identities(self) -> None:
        """Drop the ops whose result has the bits of their operand wherever it is seen.

        * ``x * 1`` and ``x / 1`` (Adam's bias corrections are exactly 1 after a few
          hundred, or thousand, steps), ``x + (-0.0)`` and ``x - (+0.0)``: always ``x``.
        * ``x + (+0.0)`` differs from ``x`` only for ``x = -0.0`` (it gives +0.0): dropped
          when nothing downstream can see the sign of a zero, e.g. Adam's
          ``sqrt(v + eps_root) + eps`` with ``eps_root = 0`` and ``eps != 0``, where the
          sign of ``sqrt(±0) = ±0`` is lost in ``±0 + eps``.

        ``x`` must come from arithmetic (never a signaling NaN, which the op would quiet).
        Every output keeps its bits.
        """
        uses: dict[int, list[int]] = {}
        producer: dict[int, Callable] = {}
        for k, (fn, args, res) in enumerate(self.code):
            producer[res] = fn
            for a in args:
                uses.setdefault(a, []).append(k)
        outputs = {v for _, v in self.outputs}
        replace: dict[int, int] = {}
        memo: dict[int, bool] = {}
        for fn, args, res in self.code:
            if fn not in (torch.add, torch.sub, torch.mul, torch.div) or len(args) != 2:
                continue
            x, c = args
            if producer.get(x) not in _ARITHMETIC_FNS or self.dtypes[x] != self.dtypes[res]:
                continue
            if fn in (torch.mul, torch.div):
                if self._const_value(c) == 1.0:
                    replace[res] = x
                continue
            zero = self._zero_const(c)
            if zero is None:
                continue
            exact = (fn is torch.add) == (zero < 0)  # x + (-0.0), x - (+0.0)
            if exact or self._sign_of_zero_unseen(res, uses, outputs, memo):
                replace[res] = x
        if not replace:
            return

        def resolve(v: int) -> int:
            while v in replace:
                v = replace[v]
            return v

        code = []
        for fn, args, res in self.code:
            if res not in replace:
                code.append((fn, tuple(resolve(a) for a in args), res))
        self.code = code
        self.outputs = [(name, resolve(v)) for name, v in self.outputs]

    def _const_value(self, index: int):
        """The value of a constant number or 0-d tensor (``None`` otherwise)."""
        if self.kinds[index] != "const":
            return None
        c = self.consts[index]
        if isinstance(c, torch.Tensor):
            return c.item() if c.ndim == 0 and c.is_floating_point() else None
        return c if isinstance(c, float) else None

    def _zero_const(self, index: int) -> float | None:
        """``+1.0``/``-1.0`` for a constant +0.0/-0.0 (the sign), else ``None``."""
        c = self._const_value(index)
        if c is None or c != 0.0:
            return None
        return math.copysign(1.0, c)

    def _nonzero_const(self, index: int) -> bool:
        if self.kinds[index] != "const":
            return False
        c = self.consts[index]
        if isinstance(c, torch.Tensor):
            if c.ndim != 0:
                return False
            c = c.item()
        return isinstance(c, (int, float)) and not isinstance(c, bool) and c != 0

    def _sign_of_zero_unseen(self, v: int, uses: dict, outputs: set, memo: dict) -> bool:
        """Whether no output depends on the sign of a zero in value ``v``."""
        if v in memo:
            return memo[v]
        memo[v] = False  # (the code is acyclic; this only guards the recursion)
        ok = v not in outputs
        for k in uses.get(v, ()) if ok else ():
            fn, args, res = self.code[k]
            others = [a for a in args if a != v]
            if fn in (torch.gt, torch.ge, torch.lt, torch.le, torch.eq, torch.ne, torch.abs):
                continue  # ±0 compare equal; |±0| = +0
            if fn in (torch.add, torch.sub) and len(others) == 1 and \
                    self._nonzero_const(others[0]):
                continue  # ±0 + c = c for c != 0
            if fn in (torch.sqrt, torch.neg, _convert_into) or (
                    fn in (torch.mul, torch.div) and args[0] == v and len(others) == 1
                    and self._nonzero_const(others[0])):
                if self._sign_of_zero_unseen(res, uses, outputs, memo):
                    continue  # ±0 maps to ±0: the sign only matters downstream
            ok = False
            break
        memo[v] = ok
        return ok


def _as_operand_tensor(x, dtype: torch.dtype):
    """A Python number operand of an arithmetic op as a 0-d tensor of the other operand's
    (floating) dtype: torch rounds a number to that dtype the same way, so the result has
    the same bits, and a 0-d tensor saves wrapping the number again on every call."""
    if isinstance(x, (Sym, torch.Tensor)) or isinstance(x, bool) or not dtype.is_floating_point:
        return x
    if isinstance(x, float) or (isinstance(x, int) and abs(x) <= 1 << 24):
        return torch.tensor(float(x), dtype=dtype, device="cpu")
    return x


class TraceOps:
    """The ``ops`` namespace of rule bodies while tracing a :class:`Program`."""

    def __init__(self, prog: Program):
        self.prog = prog

    def _map(self, x, number_fn: Callable, tensor_fn: Callable):
        if isinstance(x, Sym):
            return self.prog.unary(tensor_fn, x)
        return _scalar_fn(number_fn, tensor_fn)(x)

    def sqrt(self, x):
        return self._map(x, math.sqrt, torch.sqrt)

    def abs(self, x):
        return self._map(x, abs, torch.abs)

    def cbrt(self, x):
        return self._map(x, _cbrt_number, cbrt_tensor)

    def sign(self, x):
        return self._map(x, _sign_number, torch.sign)

    def where(self, cond, a, b):
        return self.prog.where(cond, a, b)

    def lerp(self, start, end, weight):
        """``torch.lerp`` as :meth:`ftopt.eager.EagerOps.lerp` computes it."""
        if not (isinstance(start, Sym) and isinstance(end, Sym)) or (
                isinstance(weight, torch.Tensor) and weight.ndim != 0) or isinstance(
                weight, Sym):
            return start + weight * (end - start)
        if start.dtype != end.dtype:
            raise NotTraceable("lerp of values of different dtypes")
        if isinstance(weight, torch.Tensor):
            weight = weight.to(start.dtype)
        return self.prog._call(torch.lerp, start, end, weight)

    def maximum(self, a, b):
        return self.where(a >= b, a, b)

    def minimum(self, a, b):
        return self.where(a <= b, a, b)

    def leaf_norm(self, x):
        raise NotTraceable("leaf_norm reduces over whole leaves")

    def global_norm(self, x):
        raise NotTraceable("global_norm reduces over all leaves")

    def global_sum(self, x):
        raise NotTraceable("global_sum reduces over all leaves")
