"""Chunked evaluation of rule bodies on the CPU (used by the eager backend).

A rule body is traced into a :class:`Program` (values are :class:`Sym`) and run chunk by
chunk over all leaves by :func:`run_program`: the same torch ops as the :class:`Vec`
path of :mod:`ftopt.eager`, so the same bits, with each chunk kept in cache from the first
op of the body to the last.
"""

from __future__ import annotations

import math
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ftopt.eager import _scalar_fn, _sign_number, _where

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

#: Elements per chunk (1 MiB of fp32): the ten or so chunk-sized tensors a program touches
#: stay in the last-level cache, and each op is large enough to split over the intra-op
#: threads (ATen's grain is 32768 elements) and to hide the per-op dispatch cost. On a
#: 2-core CPU (benchmarks/eager_cpu.py) 64Ki and 512Ki elements were both ~20% slower.
#: Each thread that runs a program keeps its chunk buffers (about ten chunks) for reuse.
CHUNK = 1 << 18


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
    chunk: int | None = None,
) -> None:
    """Run ``prog`` over all leaves, chunk by chunk.

    ``inputs`` and ``outputs`` hold one tensor per leaf for each name (all of a leaf's
    tensors have the same number of elements); outputs are written in place. An output
    named in ``aliases`` is the same memory as the input of that name (a donated state):
    it is written only once nothing reads the input any more. Non-contiguous inputs are
    read through contiguous copies; outputs must be contiguous.
    """
    chunk = CHUNK if chunk is None else chunk
    missing = [n for n in prog.inputs if n not in inputs]
    if missing:
        raise ValueError(f"program inputs {missing} not given")
    out_names = list(outputs)
    ins = [inputs[n] for n in prog.inputs]
    outs = [outputs[n] for n in out_names]
    for name, ts in zip(out_names, outs):
        if not all(t.is_contiguous() for t in ts):
            raise ValueError(f"output {name}: tensors must be contiguous")
    numels = [t.numel() for t in (ins[0] if ins else outs[0])]
    solo, packed = _waves(numels, chunk)
    largest = max([e - s for _, bounds in solo for s, e in bounds]
                  + [sum(numels[i] for i in leaves) for leaves in packed] + [0])
    if largest == 0:
        return
    prog.drop_identities()
    plan = _Plan(prog, out_names, [ts[0].dtype if len(ts) else None for ts in outs],
                 aliases, largest)
    for i, bounds in solo:
        if len(bounds) == 1:
            # A whole leaf in one chunk: its tensors as they are (no flattened views).
            fi = [x[i] if x[i].is_contiguous() else x[i].contiguous() for x in ins]
            fo = [x[i] for x in outs]
            shape = (fi or fo)[0].shape
            if all(t.shape == shape for t in fi) and all(t.shape == shape for t in fo):
                plan.run_wave(numels[i], fi, fo, shape)
                continue
        fi = [_flat(x[i]) for x in ins]
        fo = [_flat(x[i]) for x in outs]
        if len(bounds) == 1:
            plan.run_wave(numels[i], fi, fo)
            continue
        for s, e in bounds:
            plan.run_wave(e - s, [t[s:e] for t in fi], [t[s:e] for t in fo])
    for leaves in packed:
        plan.run_packed(leaves, [[_flat(x[i]) for i in leaves] for x in ins],
                        [[_flat(x[i]) for i in leaves] for x in outs])


def _flat(t: torch.Tensor) -> torch.Tensor:
    if t.ndim == 1 and t.is_contiguous():
        return t
    return t.contiguous().view(-1)


#: Leaves of at least this many elements are never packed: gathering and scattering them
#: would cost more than the per-op overhead of their own smaller chunk.
_SOLO = 1 << 14


def _waves(numels: Sequence[int], chunk: int):
    """Split leaves into chunks: a large leaf into pieces of at most ``chunk`` elements
    (its tensors are used in place, ``(leaf, [(start, stop), ...])``), small leaves packed
    together into waves of at most ``chunk`` elements (gathered into, and scattered from,
    buffers; a list of leaves)."""
    solo, packed, cur, cur_n = [], [], [], 0
    for i, n in enumerate(numels):
        if n == 0:
            continue
        if n >= min(chunk // 2, _SOLO):
            pieces = -(-n // chunk)
            size = -(-n // pieces)
            size = -(-size // 64) * 64  # a multiple of the vector width
            solo.append((i, [(s, min(n, s + size)) for s in range(0, n, size)]))
            continue
        if cur_n + n > chunk:
            packed.append(cur)
            cur, cur_n = [], 0
        cur.append(i)
        cur_n += n
    if cur:
        packed.append(cur)
    return solo, packed


def check_aliases(prog: Program, aliases) -> None:
    """Raise :class:`NotTraceable` if an output is a donated input of another name (it
    would be copied from memory that the other output overwrites)."""
    aliased_inputs = {prog.inputs[n] for n in aliases if n in prog.inputs}
    for name, v in prog.outputs:
        if v in aliased_inputs and prog.inputs.get(name) != v:
            raise NotTraceable("an output reads a donated input of another name")


_SCRATCH = threading.local()


def _scratch(key, dtype: torch.dtype, size: int) -> torch.Tensor:
    """A chunk buffer kept for the next step (per thread): allocating it afresh each
    step would map and fault in new pages every time."""
    cache = getattr(_SCRATCH, "buffers", None)
    if cache is None:
        cache = _SCRATCH.buffers = {}
    buf = cache.get((key, dtype))
    if buf is None or buf.numel() < size:
        buf = cache[key, dtype] = torch.empty(size, dtype=dtype, device="cpu")
    return buf if buf.numel() == size else buf[:size]


class _Plan:
    """Where every value of a program lives while a chunk runs."""

    def __init__(self, prog: Program, out_names: list[str], out_dtypes: list,
                 aliases: Sequence[str], chunk: int):
        self.chunk = chunk
        n_vals = len(prog.dtypes)
        end = len(prog.code)
        last = [-1] * n_vals
        for k, (_, args, _) in enumerate(prog.code):
            for a in args:
                last[a] = k
        for _, v in prog.outputs:
            last[v] = end
        out_pos = {name: j for j, name in enumerate(out_names)}
        missing = [name for name, _ in prog.outputs if name not in out_pos]
        if missing:
            raise ValueError(f"program outputs {missing} not given")
        aliases = set(aliases)
        check_aliases(prog, aliases)
        produced = {res: k for k, (_, _, res) in enumerate(prog.code)}
        # Results written straight into an output's memory.
        direct: dict[int, str] = {}
        for name, v in prog.outputs:
            if v not in produced or v in direct or out_dtypes[out_pos[name]] != prog.dtypes[v]:
                continue
            if name in aliases and name in prog.inputs and last[prog.inputs[name]] > produced[v]:
                continue  # the donated input is still read after this op
            direct[v] = name
        # Chunk buffers for the other results: a result reuses the buffer of an operand
        # that dies at its op (the op then runs in place).
        buf_dtypes: list[torch.dtype] = []
        free: dict[torch.dtype, list[int]] = {}
        buf_of: dict[int, int] = {}
        for k, (_, args, res) in enumerate(prog.code):
            for a in set(args):
                if a in buf_of and last[a] == k:
                    free.setdefault(prog.dtypes[a], []).append(buf_of[a])
            if res not in direct:
                pool = free.setdefault(prog.dtypes[res], [])
                buf_of[res] = pool.pop() if pool else len(buf_dtypes)
                if buf_of[res] == len(buf_dtypes):
                    buf_dtypes.append(prog.dtypes[res])
                if last[res] < k:  # never read
                    pool.append(buf_of[res])
        self.bufs = [_scratch(("tmp", k), d, chunk) for k, d in enumerate(buf_dtypes)]
        # End-of-chunk copies: outputs not written directly (an input value or a result
        # that also feeds another output), except a donated input left as it is.
        self.copies: list[tuple[int, int]] = []
        kept = set()
        for name, v in prog.outputs:
            if direct.get(v) == name:
                continue
            if name in aliases and prog.inputs.get(name) == v:
                kept.add(out_pos[name])
                continue
            self.copies.append((out_pos[name], v))
        self.loc: list = [None] * n_vals
        for index, value in prog.consts.items():
            self.loc[index] = value
        self.in_slots = list(prog.inputs.values())
        self.in_dtypes = [prog.dtypes[v] for v in self.in_slots]
        self.buf_slots = list(buf_of.items())
        self.direct_slots = [(v, out_pos[name]) for v, name in direct.items()]
        self.code = list(prog.code)
        # Packed chunks scatter every output but the donated inputs left as they are.
        self.scattered = [(j, d) for j, d in enumerate(out_dtypes) if j not in kept]
        self._gather: list = [None] * len(self.in_slots)
        self._scatter: dict[int, torch.Tensor] = {}

    def run_wave(self, n: int, ins: list, outs: list, shape=None) -> None:
        """One chunk: ``ins``/``outs`` are the chunk's tensors, per name, all of ``n``
        elements (flat, or all of ``shape``)."""
        loc = self.loc
        for v, t in zip(self.in_slots, ins):
            loc[v] = t
        if shape is not None and len(shape) != 1:
            bufs = [b[:n].view(shape) for b in self.bufs]
        else:
            bufs = self.bufs if n == self.chunk else [b[:n] for b in self.bufs]
        for v, j in self.buf_slots:
            loc[v] = bufs[j]
        for v, j in self.direct_slots:
            loc[v] = outs[j]
        for fn, args, res in self.code:
            fn(*[loc[a] for a in args], out=loc[res])
        for j, v in self.copies:
            outs[j].copy_(loc[v])

    def run_packed(self, leaves: list[int], ins: list[list], outs: list[list]) -> None:
        """One chunk of several small leaves: inputs are gathered into chunk buffers and
        outputs scattered from them (``ins``/``outs``: per name, the leaves' flat views)."""
        sizes = [t.numel() for t in (ins[0] if ins else outs[0])]
        n = sum(sizes)
        gathered = []
        for j, pieces in enumerate(ins):
            if self._gather[j] is None:
                self._gather[j] = _scratch(("in", j), self.in_dtypes[j], self.chunk)
            gathered.append(torch.cat(pieces, out=self._gather[j][:n]))
        scatter = [None] * len(outs)
        for j, dtype in self.scattered:
            if j not in self._scatter:
                self._scatter[j] = _scratch(("out", j), dtype, self.chunk)
            scatter[j] = self._scatter[j][:n]
        self.run_wave(n, gathered, scatter)
        for j, _ in self.scattered:
            torch._foreach_copy_(outs[j], list(scatter[j].split(sizes)))
