"""The eager evaluator: runs an elementwise rule body over all leaves at once.

A rule body is ordinary Python arithmetic over values plus the ``ops`` namespace. Here a
value is a :class:`Vec`: one entry per leaf, of one of three kinds

* ``elem``: a tensor per leaf (updates, params, states and everything computed from them);
* ``leaf``: a scalar per leaf (a per-leaf norm, a trust ratio);
* ``scalar``: one scalar for all leaves (a hyperparameter, a bias correction).

Binary operations broadcast the lower kind up. A ``scalar`` or ``leaf`` tensor meets an
``elem`` tensor in that tensor's floating dtype, as torch casts a 0-d operand to the dtype
of a tensor with dimensions: so a 0-d leaf computes as the same values in a 1-D leaf
would, not in float64 where the per-step scalars are float64 tensors.

In ``foreach`` mode operations on tensor lists call ``torch._foreach_*`` (one dispatch for
all leaves); in ``loop`` mode every op is a plain torch op per leaf, which autograd and
``torch.func`` transforms understand.

On the CPU, ``foreach`` bodies without norms are instead run by
:mod:`ftopt.chunked` (a backend): the same torch ops, so the same bits, chunk by chunk.
"""

from __future__ import annotations

import math
import operator
import struct
from collections.abc import Callable, Sequence

import torch

from ftopt import shards
from ftopt._counts import device_decided, host_count, remember_count

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


def known_count(count: torch.Tensor) -> int | None:
    """The value of the step count ``count`` for per-step scalars computed on the host: its
    host record (:mod:`ftopt._counts`), else one read of the tensor, recorded (on every
    device, as the fused path does). ``None``, for scalars computed on the device, where
    the count may not be read: under ``torch.func`` or ``torch.compile``, while a CUDA
    graph is captured, or for a count decided on the device.

    One rule for every device, because host scalars (Python floats) and device scalars
    (0-d tensors) take different ops, which may round differently on an accelerator: a
    state whose count the host does not know (a clone, a checkpoint, a donated step's
    write-back) must step bit for bit as the same state with a known count."""
    known = host_count(count)
    if known is not None:
        return known
    if functorch_active() or torch.compiler.is_compiling() or device_decided(count):
        return None
    if count.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    known = int(count)
    remember_count(count, known)
    return known


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
        if fast and b.kind == "elem" and a.kind != "elem" and op in (operator.add, operator.mul):
            a, b = b, a  # number * tensor is tensor * number (the same bits)
        if fast and a.kind == "elem" and _foreach_operand(b):
            rhs = b.items[0] if b.kind == "scalar" else b.items
            return Vec("elem", list(_FOREACH_BINARY[op](a.items, rhs)), self.mode)
        if fast and op is operator.truediv and a.kind == "elem" and a.items[:1] and (
                a.items[0].is_cuda):
            # CUDA's foreach division by a number multiplies by its reciprocal, rounded
            # from float64: a tensor divisor likewise, for the same bits as a number.
            b = b._unary(lambda y: torch.as_tensor(y, dtype=torch.float64).reciprocal())
            op = operator.mul
        pairs = _met(a, b, n)
        return Vec(kind, [op(x, y) for x, y in pairs], self.mode)

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


def _as_met(value, t):
    """``value`` (a per-step or per-leaf value) as an operand of the per-element tensor
    ``t``: a floating 0-d tensor in ``t``'s floating dtype where ``t`` is 0-d itself (with
    dimensions, torch casts it so; between two 0-d tensors it would promote instead)."""
    if (isinstance(value, torch.Tensor) and isinstance(t, torch.Tensor) and t.ndim == 0
            and value.ndim == 0 and value.dtype != t.dtype
            and value.is_floating_point() and t.is_floating_point()):
        return value.to(t.dtype)
    return value


def _met(a: Vec, b: Vec, n: int) -> list[tuple]:
    """The per-leaf operand pairs of ``a`` and ``b``, a non-``elem`` one met to the
    ``elem`` one (:func:`_as_met`)."""
    pairs = zip(a._expanded(n), b._expanded(n))
    if a.kind == "elem" and b.kind != "elem":
        return [(x, _as_met(y, x)) for x, y in pairs]
    if b.kind == "elem" and a.kind != "elem":
        return [(_as_met(x, y), y) for x, y in pairs]
    return list(pairs)


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


def cbrt_tensor(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x^(1/3) for x >= 0 (NaN below 0), elementwise: the eager and chunked cube root.

    ``pow(x, 1/3)`` alone is ~1e-6 off in fp32 for small x (1/3 rounds to fp32); one
    Newton step y + (x/y² − y)/3 brings it to about an ulp, as the fused root."""
    y = torch.pow(x, 1.0 / 3.0)
    refined = y + (x / (y * y) - y) * (1.0 / 3.0)
    root = torch.where((x > 0) & torch.isfinite(x), refined, y)
    return root if out is None else out.copy_(root)


def _cbrt_number(x: float) -> float:
    return x ** (1.0 / 3.0) if x >= 0 else math.nan


_cbrt = _scalar_fn(_cbrt_number, cbrt_tensor)


U32_MASK = 0xFFFFFFFF


def check_u32_constant(constant: int) -> None:
    """A ``mul32`` constant: an int in (0, 2**31), so that its products with 32-bit values
    fit in int64 on the eager path and in an int32 literal in the kernels."""
    if not isinstance(constant, int) or not 0 < constant < 2**31:
        raise ValueError(f"mul32: the constant must be an int in (0, 2**31), got {constant!r}")


def _add32(a, b):
    return (a + b) & U32_MASK


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

    def cbrt(self, x) -> Vec:
        """The cube root of x >= 0 (NaN below 0)."""
        return self._map(x, _cbrt)

    def sign(self, x) -> Vec:
        return self._map(x, _scalar_fn(_sign_number, torch.sign), torch._foreach_sign)

    def where(self, cond, a, b) -> Vec:
        cond, a, b = (_as_vec(v, self.mode) for v in (cond, a, b))
        kind = max(cond.kind, a.kind, b.kind, key=_KIND_ORDER.__getitem__)
        n = max(len(v.items) for v in (cond, a, b))
        items = [_where(c, x, y) for c, (x, y) in zip(cond._expanded(n), _met(a, b, n))]
        return Vec(kind, items, self.mode)

    def lerp(self, start, end, weight) -> Vec:
        """start + weight·(end − start), as ``torch.lerp`` (one op): an EMA with
        ``weight = 1 − decay`` computed on the host."""
        start, end, weight = (_as_vec(v, self.mode) for v in (start, end, weight))
        if weight.kind != "scalar" or start.kind != "elem" or end.kind != "elem":
            return start + weight * (end - start)
        w = weight.items[0]
        same = all(a.dtype == b.dtype for a, b in zip(start.items, end.items))
        if self.mode == "foreach" and _is_number(w) and same:
            return Vec("elem", list(torch._foreach_lerp(start.items, end.items, w)),
                       self.mode)
        return Vec("elem", [_lerp(a, b, w) for a, b in zip(start.items, end.items)],
                   self.mode)

    def log(self, x) -> Vec:
        return self._map(x, _scalar_fn(math.log, torch.log), torch._foreach_log)

    def cos(self, x) -> Vec:
        return self._map(x, _scalar_fn(math.cos, torch.cos), torch._foreach_cos)

    def sin(self, x) -> Vec:
        return self._map(x, _scalar_fn(math.sin, torch.sin), torch._foreach_sin)

    def paired(self, fn, index, *args) -> Vec:
        """Per element, ``even`` or ``odd`` of ``fn(o, k, *args) -> (even, odd)`` for its
        pair ``k = index >> 1`` (``index``: ``x.index``, each leaf's consecutive element
        positions): ``fn`` runs once per pair of each leaf, the pairs that cover its
        positions, and each element takes its value (no host read of the positions)."""
        index = _as_vec(index, self.mode)
        if index.kind != "elem":
            raise TypeError("o.paired takes the element positions x.index")
        pairs = []
        for positions in index.items:
            flat = positions.reshape(-1)
            count = flat.numel() // 2 + 1  # enough pairs for either parity of the first
            steps = torch.arange(count, dtype=torch.int64, device=flat.device)
            pairs.append(((flat[:1] >> 1) + steps) & 0x7FFFFFFF)
        even, odd = fn(self, Vec("elem", pairs, self.mode), *args)
        out = []
        for positions, a, b in zip(index.items, _as_vec(even, self.mode)._expanded(len(pairs)),
                                   _as_vec(odd, self.mode)._expanded(len(pairs))):
            flat = positions.reshape(-1)
            both = torch.stack([a, b], dim=-1).reshape(-1)  # the values of 2·count positions
            lanes = torch.arange(flat.numel(), dtype=torch.int64, device=flat.device)
            out.append(both[lanes + (flat[:1] & 1)].view(positions.shape))
        return Vec("elem", out, self.mode)

    # 32-bit unsigned integers (counter-based random numbers): held as Python ints or int64
    # tensors in [0, 2**32); ``mul32``'s constant is below 2**31, so no product overflows.
    def u32(self, x) -> Vec:
        """An integer-valued number (or float tensor) as a 32-bit unsigned integer."""
        return self._map(x, _scalar_fn(lambda v: int(v) & U32_MASK,
                                       lambda v: v.to(torch.int64) & U32_MASK))

    def xor(self, a, b) -> Vec:
        return _as_vec(a, self.mode)._binary(b, operator.xor)

    def shr(self, a, bits: int) -> Vec:
        return self._map(a, lambda v: v >> bits)

    def mul32(self, a, constant: int) -> Vec:
        """``a * constant`` modulo 2**32 (``0 < constant < 2**31``)."""
        check_u32_constant(constant)
        return self._map(a, lambda v: (v * constant) & U32_MASK)

    def add32(self, a, b) -> Vec:
        return _as_vec(a, self.mode)._binary(b, _add32)

    def to_float(self, a) -> Vec:
        """A 32-bit integer below 2**24 as a float32 (exact)."""
        return self._map(a, _scalar_fn(float, lambda v: v.to(torch.float32)))

    def float_bits(self, x) -> Vec:
        """The bit pattern of a float32 value as a 32-bit unsigned integer."""
        return self._map(x, _scalar_fn(
            lambda v: struct.unpack("<I", struct.pack("<f", v))[0],
            lambda v: v.to(torch.float32).view(torch.int32).to(torch.int64) & U32_MASK))

    def from_bits(self, a) -> Vec:
        """The float32 value of a 32-bit bit pattern (the inverse of ``float_bits``)."""
        return self._map(a, _scalar_fn(
            lambda v: struct.unpack("<f", struct.pack("<I", int(v) & U32_MASK))[0],
            lambda v: ((v & U32_MASK) - ((v >> 31) & 1) * (1 << 32)).to(torch.int32)
            .view(torch.float32)))

    def maximum(self, a, b) -> Vec:
        return self.where(_as_vec(a, self.mode) >= b, a, b)

    def minimum(self, a, b) -> Vec:
        return self.where(_as_vec(a, self.mode) <= b, a, b)

    def leaf_norm(self, x) -> Vec:
        """‖x‖₂ of each leaf (a ``leaf`` value)."""
        x = _as_vec(x, self.mode)
        if self.mode == "foreach" and x.items:
            norms = list(torch._foreach_norm(x.items))
        else:
            norms = [torch.linalg.vector_norm(t) for t in x.items]
        if norms and shards.in_local_shards():
            norms = _norms_over_shards(norms)
        return Vec("leaf", norms, self.mode)

    def global_norm(self, x) -> Vec:
        """‖x‖₂ over all leaves (a ``scalar`` value)."""
        norms = self.leaf_norm(x).items
        if not norms:
            return Vec("scalar", [0.0], self.mode)
        return Vec("scalar", [torch.linalg.vector_norm(torch.stack(norms))], self.mode)


    def global_sum(self, x) -> Vec:
        """Σ x over every element of every leaf (a ``scalar`` value)."""
        x = _as_vec(x, self.mode)
        if shards.in_local_shards():
            raise NotImplementedError("global_sum over local shards of DTensors is not "
                                      "supported (expected whole leaves)")
        if not x.items:
            return Vec("scalar", [0.0], self.mode)
        return Vec("scalar", [torch.stack([t.sum() for t in x.items]).sum()], self.mode)


def _norms_over_shards(norms: list[torch.Tensor]) -> list[torch.Tensor]:
    """The norms of whole leaves from the norms of their local shards: the squares, in
    float64, summed over the ranks in one collective (:func:`ftopt.shards.reduce_squares`)."""
    squares = torch.stack([n.to(torch.float64) for n in norms]).square()
    total = shards.reduce_squares(squares).sqrt()
    return [t.to(n.dtype) for t, n in zip(total.unbind(), norms)]


def _lerp(start: torch.Tensor, end: torch.Tensor, weight) -> torch.Tensor:
    """torch.lerp on the promoted dtype, with a tensor weight of that dtype."""
    dtype = torch.promote_types(start.dtype, end.dtype)
    if isinstance(weight, torch.Tensor):
        weight = weight.to(dtype)
    return torch.lerp(start.to(dtype), end.to(dtype), weight)


def _where(c, x, y):
    if isinstance(c, torch.Tensor):
        return torch.where(c, x, y)
    chosen, other = (x, y) if c else (y, x)
    if isinstance(other, torch.Tensor) and not isinstance(chosen, torch.Tensor):
        # A number picked for an element-wise result: the tensor torch.where would give.
        return torch.full_like(other, chosen, dtype=torch.result_type(other, chosen))
    return chosen


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
