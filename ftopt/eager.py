"""The eager evaluator: runs an elementwise rule body over all leaves at once.

A rule body is ordinary Python arithmetic over values plus the ``ops`` namespace. Here a
value is a :class:`Vec`: one entry per leaf, of one of three kinds

* ``elem``: a tensor per leaf (updates, params, states and everything computed from them);
* ``leaf``: a scalar per leaf (a per-leaf norm, a trust ratio);
* ``scalar``: one scalar for all leaves (a hyperparameter, a bias correction).

Binary operations broadcast the lower kind up. In ``foreach`` mode operations on tensor
lists call ``torch._foreach_*`` (one dispatch for all leaves); in ``loop`` mode every op
is a plain torch op per leaf, which autograd and ``torch.func`` transforms understand.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

_KIND_ORDER = {"scalar": 0, "leaf": 1, "elem": 2}

# Binary operators with a foreach counterpart that accepts (list, list), (list, float)
# and (list, list-of-floats).
_FOREACH_BINARY = {
    operator.add: torch._foreach_add,
    operator.sub: torch._foreach_sub,
    operator.mul: torch._foreach_mul,
    operator.truediv: torch._foreach_div,
}


def functorch_active() -> bool:
    """True inside ``torch.func.grad``/``vmap``/... (the eager loop mode must be used)."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class Vec:
    """One value of a rule body, for every active leaf (see the module docstring)."""

    __slots__ = ("kind", "items", "mode")

    def __init__(self, kind: str, items: list, mode: str):
        self.kind = kind
        self.items = items
        self.mode = mode

    # -- broadcasting -----------------------------------------------------------------
    def _expanded(self, n: int) -> list:
        return self.items * n if self.kind == "scalar" else self.items

    def _binary(self, other, op: Callable, reverse: bool = False) -> Vec:
        other = _as_vec(other, self.mode)
        a, b = (other, self) if reverse else (self, other)
        kind = max(a.kind, b.kind, key=_KIND_ORDER.__getitem__)
        if kind == "scalar":
            return Vec("scalar", [op(a.items[0], b.items[0])], self.mode)
        n = len(a.items) if a.kind != "scalar" else len(b.items)
        fast = self.mode == "foreach" and kind == "elem" and op in _FOREACH_BINARY
        if fast and a.kind == "elem" and _foreach_operand(b):
            rhs = b.items[0] if b.kind == "scalar" else b.items
            return Vec("elem", list(_FOREACH_BINARY[op](a.items, rhs)), self.mode)
        return Vec(kind, [op(x, y) for x, y in zip(a._expanded(n), b._expanded(n))], self.mode)

    def __add__(self, o):
        return self._binary(o, operator.add)

    def __radd__(self, o):
        return self._binary(o, operator.add, reverse=True)

    def __sub__(self, o):
        return self._binary(o, operator.sub)

    def __rsub__(self, o):
        return self._binary(o, operator.sub, reverse=True)

    def __mul__(self, o):
        return self._binary(o, operator.mul)

    def __rmul__(self, o):
        return self._binary(o, operator.mul, reverse=True)

    def __truediv__(self, o):
        return self._binary(o, operator.truediv)

    def __rtruediv__(self, o):
        return self._binary(o, operator.truediv, reverse=True)

    def __gt__(self, o):
        return self._binary(o, operator.gt)

    def __ge__(self, o):
        return self._binary(o, operator.ge)

    def __lt__(self, o):
        return self._binary(o, operator.lt)

    def __le__(self, o):
        return self._binary(o, operator.le)

    def __eq__(self, o):  # type: ignore[override]
        return self._binary(o, operator.eq)

    def __ne__(self, o):  # type: ignore[override]
        return self._binary(o, operator.ne)

    def __and__(self, o):
        return self._binary(o, operator.and_)

    def __or__(self, o):
        return self._binary(o, operator.or_)

    def __neg__(self):
        if self.kind == "elem" and self.mode == "foreach":
            return Vec("elem", list(torch._foreach_neg(self.items)), self.mode)
        return self._unary(operator.neg)

    def _unary(self, fn: Callable) -> Vec:
        return Vec(self.kind, [fn(x) for x in self.items], self.mode)

    __hash__ = None  # comparisons build values, they do not compare objects


def _foreach_operand(b: Vec) -> bool:
    """Whether ``b`` can be the right operand of a foreach binary op."""
    if b.kind == "elem":
        return True
    return all(_is_number(x) for x in b.items)


def _as_vec(x, mode: str) -> Vec:
    return x if isinstance(x, Vec) else Vec("scalar", [x], mode)


def _scalar_fn(number_fn: Callable, tensor_fn: Callable) -> Callable:
    return lambda x: tensor_fn(x) if isinstance(x, torch.Tensor) else number_fn(x)


_sqrt = _scalar_fn(math.sqrt, torch.sqrt)
_abs = _scalar_fn(abs, torch.abs)


def _sign_number(x: float) -> float:
    return float((x > 0) - (x < 0))


class EagerOps:
    """The ``ops`` namespace of rule bodies, evaluated with torch on :class:`Vec` values."""

    def __init__(self, mode: str):
        self.mode = mode

    def _map(self, x, fn: Callable, foreach: Callable | None = None) -> Vec:
        x = _as_vec(x, self.mode)
        if foreach is not None and x.kind == "elem" and self.mode == "foreach":
            return Vec("elem", list(foreach(x.items)), self.mode)
        return x._unary(fn)

    def sqrt(self, x) -> Vec:
        return self._map(x, _sqrt, torch._foreach_sqrt)

    def abs(self, x) -> Vec:
        return self._map(x, _abs, torch._foreach_abs)

    def sign(self, x) -> Vec:
        return self._map(x, _scalar_fn(_sign_number, torch.sign), torch._foreach_sign)

    def where(self, cond, a, b) -> Vec:
        cond, a, b = (_as_vec(v, self.mode) for v in (cond, a, b))
        kind = max(cond.kind, a.kind, b.kind, key=_KIND_ORDER.__getitem__)
        n = max(len(v.items) for v in (cond, a, b))
        items = [
            _where(c, x, y) for c, x, y in zip(cond._expanded(n), a._expanded(n), b._expanded(n))
        ]
        return Vec(kind, items, self.mode)

    def maximum(self, a, b) -> Vec:
        return self.where(_as_vec(a, self.mode) >= b, a, b)

    def minimum(self, a, b) -> Vec:
        return self.where(_as_vec(a, self.mode) <= b, a, b)

    def leaf_norm(self, x) -> Vec:
        """‖x‖₂ of each leaf (a ``leaf`` value)."""
        x = _as_vec(x, self.mode)
        if self.mode == "foreach" and x.items:
            return Vec("leaf", list(torch._foreach_norm(x.items)), self.mode)
        return Vec("leaf", [torch.linalg.vector_norm(t) for t in x.items], self.mode)

    def global_norm(self, x) -> Vec:
        """‖x‖₂ over all leaves (a ``scalar`` value)."""
        norms = self.leaf_norm(x).items
        if not norms:
            return Vec("scalar", [0.0], self.mode)
        return Vec("scalar", [torch.linalg.vector_norm(torch.stack(norms))], self.mode)


def _where(c, x, y):
    if isinstance(c, torch.Tensor):
        return torch.where(c, x, y)
    return x if c else y


def elem(items: Sequence[torch.Tensor], mode: str) -> Vec:
    return Vec("elem", list(items), mode)


def leafwise(items: Sequence, mode: str) -> Vec:
    return Vec("leaf", list(items), mode)


def scalar(value, mode: str) -> Vec:
    return Vec("scalar", [value], mode)


def choose_mode(tensors: Sequence[torch.Tensor], *, force_loop: bool = False) -> str:
    """``loop`` under autograd or ``torch.func``, ``foreach`` otherwise."""
    if force_loop or functorch_active():
        return "loop"
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "loop"
    return "foreach"


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

#: Elements per chunk: a few chunk buffers stay in the L2/L3 cache, and each op of a chunk
#: is large enough (>= 2 x the 32768-element grain of ATen's intra-op parallelism) to use
#: two threads and to hide the per-op dispatch cost.
CHUNK = 1 << 16


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
        index = self._new("in", dtype, torch.ones(1, dtype=dtype))
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
        a, b = (v if isinstance(v, (Sym, torch.Tensor)) else torch.tensor(v, dtype=dtype)
                for v in (a, b))
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
        value = torch.as_tensor(x, dtype=dtype)
        return self._emit(_fill_into, (self._const(value),), value.reshape(1).clone())

    def output(self, name: str, x: Sym) -> None:
        """Write ``x`` to the per-leaf tensors named ``name``."""
        self.outputs.append((name, x.index))


def _as_operand_tensor(x, dtype: torch.dtype):
    """A Python number operand of an arithmetic op as a 0-d tensor of the other operand's
    (floating) dtype: torch rounds a number to that dtype the same way, so the result has
    the same bits, and a 0-d tensor saves wrapping the number again on every call."""
    if isinstance(x, (Sym, torch.Tensor)) or isinstance(x, bool) or not dtype.is_floating_point:
        return x
    if isinstance(x, float) or (isinstance(x, int) and abs(x) <= 1 << 24):
        return torch.tensor(float(x), dtype=dtype)
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

    def sign(self, x):
        return self._map(x, _sign_number, torch.sign)

    def where(self, cond, a, b):
        return self.prog.where(cond, a, b)

    def maximum(self, a, b):
        return self.where(a >= b, a, b)

    def minimum(self, a, b):
        return self.where(a <= b, a, b)

    def leaf_norm(self, x):
        raise NotTraceable("leaf_norm reduces over whole leaves")

    def global_norm(self, x):
        raise NotTraceable("global_norm reduces over all leaves")


def chunkable(tensors: Sequence) -> bool:
    """Whether the chunked evaluator may run over these per-leaf tensors (CPU only: on an
    accelerator a foreach op over whole leaves is already one launch)."""
    return all(t.device.type == "cpu" for t in tensors)


def run_program(
    prog: Program,
    inputs: dict[str, Sequence[torch.Tensor]],
    outputs: dict[str, Sequence[torch.Tensor]],
    *,
    aliases: Sequence[str] = (),
    chunk: int = CHUNK,
) -> None:
    """Run ``prog`` over all leaves, chunk by chunk.

    ``inputs`` and ``outputs`` hold one tensor per leaf for each name (all of a leaf's
    tensors have the same number of elements); outputs are written in place. An output
    named in ``aliases`` is the same memory as the input of that name (a donated state):
    it is written only once nothing reads the input any more. Non-contiguous inputs are
    read through contiguous copies; outputs must be contiguous.
    """
    names_in = [n for n in prog.inputs if n in inputs]
    if len(names_in) != len(prog.inputs):
        raise ValueError(f"program inputs {sorted(prog.inputs)} not all given")
    numels = [t.numel() for t in inputs[names_in[0]]] if names_in else \
        [t.numel() for t in next(iter(outputs.values()))]
    plan = _Plan(prog, outputs, aliases, chunk)
    flat_in = {n: [t.contiguous().view(-1) for t in inputs[n]] for n in names_in}
    flat_out = {}
    for n, ts in outputs.items():
        if not all(t.is_contiguous() for t in ts):
            raise ValueError(f"output {n}: tensors must be contiguous")
        flat_out[n] = [t.view(-1) for t in ts]
    solo, packed = _waves(numels, chunk)
    for i, s, e in solo:
        plan.run_wave(e - s, {n: v[i][s:e] for n, v in flat_in.items()},
                      {n: v[i][s:e] for n, v in flat_out.items()})
    for pieces in packed:
        plan.run_packed(pieces, flat_in, flat_out)


def _waves(numels: Sequence[int], chunk: int):
    """Split leaves into chunks: a large leaf into pieces of at most ``chunk`` elements
    (each its own wave: its tensors are used in place), small leaves packed together into
    waves of at most ``chunk`` elements (gathered into, and scattered from, buffers)."""
    solo, packed, cur, cur_n = [], [], [], 0
    for i, n in enumerate(numels):
        if n == 0:
            continue
        if n >= chunk // 2:
            pieces = -(-n // chunk)
            size = -(-n // pieces)
            size = -(-size // 64) * 64
            solo.extend((i, s, min(n, s + size)) for s in range(0, n, size))
            continue
        if cur_n + n > chunk:
            packed.append(cur)
            cur, cur_n = [], 0
        cur.append((i, n))
        cur_n += n
    if cur:
        packed.append(cur)
    return solo, packed


class _Plan:
    """Where every value of a program lives while a chunk runs."""

    def __init__(self, prog: Program, outputs: dict, aliases: Sequence[str], chunk: int):
        self.prog = prog
        self.chunk = chunk
        n_vals = len(prog.dtypes)
        end = len(prog.code)
        last = [-1] * n_vals
        for k, (_, args, _) in enumerate(prog.code):
            for a in args:
                last[a] = k
        out_sources = {}
        for name, v in prog.outputs:
            last[v] = end
            out_sources.setdefault(v, []).append(name)
        aliased_inputs = {prog.inputs[n] for n in aliases if n in prog.inputs}
        for name, v in prog.outputs:
            if v in aliased_inputs and prog.inputs.get(name) != v:
                # An output copied from a donated input that another output overwrites.
                raise NotTraceable("an output reads a donated input of another name")
        out_dtype = {n: ts[0].dtype for n, ts in outputs.items() if len(ts)}
        produced = {res: k for k, (_, _, res) in enumerate(prog.code)}
        # Results written straight into an output's memory.
        self.direct: dict[int, str] = {}
        for name, v in prog.outputs:
            if v not in produced or v in self.direct or out_dtype.get(name) != prog.dtypes[v]:
                continue
            if name in aliases and name in prog.inputs and last[prog.inputs[name]] > produced[v]:
                continue  # the donated input is still read after this op
            self.direct[v] = name
        # Chunk buffers for the other results: a result reuses the buffer of an operand
        # that dies at its op (the op then runs in place).
        self.buf_dtypes: list[torch.dtype] = []
        free: dict[torch.dtype, list[int]] = {}
        self.buf_of: dict[int, int] = {}
        for k, (_, args, res) in enumerate(prog.code):
            for a in set(args):
                if a in self.buf_of and last[a] == k:
                    free.setdefault(prog.dtypes[a], []).append(self.buf_of[a])
            if res not in self.direct:
                pool = free.setdefault(prog.dtypes[res], [])
                if pool:
                    self.buf_of[res] = pool.pop()
                else:
                    self.buf_of[res] = len(self.buf_dtypes)
                    self.buf_dtypes.append(prog.dtypes[res])
                if last[res] < k:  # never read
                    free[prog.dtypes[res]].append(self.buf_of[res])
        self.bufs = [torch.empty(chunk, dtype=d) for d in self.buf_dtypes]
        # End-of-chunk copies: outputs not written directly (an input value or a result
        # that also feeds another output), except a donated input left as it is.
        self.copies = []
        self.kept = set()
        for name, v in prog.outputs:
            if self.direct.get(v) == name:
                continue
            if name in aliases and prog.inputs.get(name) == v:
                self.kept.add(name)
                continue
            self.copies.append((name, v))
        self.loc: list = [None] * n_vals
        for index, value in prog.consts.items():
            self.loc[index] = value
        self.in_index = dict(prog.inputs)
        self.code = [(fn, args, res) for fn, args, res in prog.code]
        self.out_dtype = out_dtype
        self._gather: dict[str, torch.Tensor] = {}
        self._scatter: dict[str, torch.Tensor] = {}

    def run_wave(self, n: int, ins: dict, outs: dict) -> None:
        loc = self.loc
        for name, index in self.in_index.items():
            loc[index] = ins[name]
        bufs = self.bufs if n == self.chunk else [b[:n] for b in self.bufs]
        for v, j in self.buf_of.items():
            loc[v] = bufs[j]
        for v, name in self.direct.items():
            loc[v] = outs[name]
        for fn, args, res in self.code:
            fn(*[loc[a] for a in args], out=loc[res])
        for name, v in self.copies:
            outs[name].copy_(loc[v])

    def run_packed(self, pieces, flat_in: dict, flat_out: dict) -> None:
        n = sum(m for _, m in pieces)
        ins = {}
        for name in self.in_index:
            if name not in self._gather:
                self._gather[name] = torch.empty(self.chunk, dtype=self.prog.dtypes[
                    self.in_index[name]])
            ins[name] = torch.cat([flat_in[name][i] for i, _ in pieces],
                                  out=self._gather[name][:n])
        outs = {}
        for name, dtype in self.out_dtype.items():
            if name in self.kept:
                continue
            if name not in self._scatter:
                self._scatter[name] = torch.empty(self.chunk, dtype=dtype)
            outs[name] = self._scatter[name][:n]
        self.run_wave(n, ins, outs)
        sizes = [m for _, m in pieces]
        for name, buf in outs.items():
            torch._foreach_copy_([flat_out[name][i] for i, _ in pieces], list(buf.split(sizes)))
