"""Argument checks shared by the loss functions.

Every check takes ``fn``, the public function being called, and raises a ``TypeError``
(wrong kind of argument) or ``ValueError`` (wrong shape or value) whose message reads
``"{fn}: {name} must be <what is expected>, got <what was given>"``. No check reads a
tensor's value, so all of them work under ``torch.func`` transforms.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch

Tensor = torch.Tensor
Scalar = float | Tensor
Bound = Literal["> 0", ">= 0", "< 0", "in [0, 1]"]


# --- tensors ---------------------------------------------------------------------------

def tensor(fn: str, name: str, x: object) -> Tensor:
    """``x``, checked to be a tensor."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _of_dtype(fn: str, name: str, x: object, what: str,
              ok: Callable[[Tensor], bool]) -> Tensor:
    x = tensor(fn, name, x)
    if not ok(x):
        raise TypeError(f"{fn}: {name} must be {what}, got {x.dtype}")
    return x


def floating(fn: str, name: str, x: object) -> Tensor:
    """``x``, checked to be a real floating-point tensor."""
    return _of_dtype(fn, name, x, "a real floating-point tensor",
                     lambda t: t.is_floating_point())


def integer(fn: str, name: str, x: object) -> Tensor:
    """``x``, checked to be a tensor of an integer dtype (bool is refused)."""
    return _of_dtype(fn, name, x, "a tensor of integer class labels (e.g. torch.int64)",
                     lambda t: not (t.is_floating_point() or t.is_complex()
                                    or t.dtype == torch.bool))


def real(fn: str, name: str, x: object) -> Tensor:
    """``x``, checked to be a tensor of a real (or bool) dtype: complex is refused."""
    return _of_dtype(fn, name, x, "a real or bool tensor", lambda t: not t.is_complex())


def boolean(fn: str, name: str, x: object) -> Tensor:
    """``x``, checked to be a bool tensor."""
    return _of_dtype(fn, name, x, "a bool tensor", lambda t: t.dtype == torch.bool)


# --- shapes ----------------------------------------------------------------------------

def _listing(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def broadcast(fn: str, named: Mapping[str, Tensor | torch.Size]) -> torch.Size:
    """The shape that the named tensors (or shapes) broadcast to, checked."""
    shapes = [x.shape if isinstance(x, Tensor) else x for x in named.values()]
    try:
        return torch.broadcast_shapes(*shapes)
    except RuntimeError:
        raise ValueError(f"{fn}: {_listing(list(named))} must have shapes that broadcast "
                         f"together, got {_listing([str(tuple(s)) for s in shapes])}"
                         ) from None


def broadcast_to(fn: str, name: str, x: Tensor, shape: torch.Size, *,
                 of: str = "the input's") -> Tensor:
    """``x`` expanded to ``shape`` (``of`` says whose shape it is), checked."""
    try:
        return x.broadcast_to(shape)
    except RuntimeError:
        raise ValueError(f"{fn}: {name} must have a shape that broadcasts to {of} shape "
                         f"{tuple(shape)}, got {tuple(x.shape)}") from None


def dims(fn: str, axis: int | Sequence[int] | None, ndim: int, *,
         any_sequence: bool = False, allow_empty: bool = False) -> tuple[int, ...]:
    """``axis`` as non-negative dimensions of a tensor of ``ndim`` dimensions, in the
    order given (``None``: all of them), checked.

    ``axis`` is an int or a tuple of ints (with ``any_sequence``, any sequence of ints,
    a list say); an empty one is refused unless ``allow_empty``.
    """
    if axis is None:
        return tuple(range(ndim))
    kind = Sequence if any_sequence else tuple
    axes = (axis,) if isinstance(axis, int) else axis
    if (not isinstance(axes, kind) or (not axes and not allow_empty)
            or any(isinstance(a, bool) or not isinstance(a, int) for a in axes)):
        what = f"{'' if allow_empty else 'non-empty '}{kind.__name__.lower()}"
        raise TypeError(f"{fn}: axis must be an int, a {what} of ints or None, got {axis!r}")
    if any(not -ndim <= a < ndim for a in axes):
        raise ValueError(f"{fn}: axis must be in [-{ndim}, {ndim}) for a tensor of {ndim} "
                         f"dimension(s), got {axis!r}")
    found = tuple(a % ndim for a in axes)
    if len(set(found)) != len(found):
        raise ValueError(f"{fn}: axis must not repeat a dimension, got {axis!r}")
    return found


def mask(fn: str, where: object, shape: torch.Size, *, of: str = "the input's",
         batch_dims: tuple[int, ...] | None = None, widen: bool = False) -> Tensor | None:
    """``where`` (``None``, or a bool tensor of the elements to include) expanded to
    ``shape`` (``of`` says whose shape it is), checked.

    With ``batch_dims``, a mask of the batch shape (``shape`` without those dimensions)
    is taken too: it gets them back, of size 1. With ``widen``, ``where`` and ``shape``
    broadcast both ways (the mask may add dimensions to the result).
    """
    if where is None:
        return None
    where = boolean(fn, "where", where)
    if batch_dims is not None and where.ndim != len(shape):
        if where.ndim + len(batch_dims) != len(shape):
            raise ValueError(f"{fn}: where must have {of} shape {tuple(shape)} or its "
                             f"batch shape (without axis {batch_dims}), got "
                             f"{tuple(where.shape)}")
        for d in sorted(batch_dims):
            where = where.unsqueeze(d)
    if widen:
        try:
            shape = torch.broadcast_shapes(where.shape, shape)
        except RuntimeError:
            raise ValueError(f"{fn}: where must have a shape that broadcasts with {of} "
                             f"shape {tuple(shape)}, got {tuple(where.shape)}") from None
    return broadcast_to(fn, "where", where, shape, of=of)


# --- numbers ---------------------------------------------------------------------------

_BOUNDS: dict[Bound, Callable[[float], bool]] = {
    "> 0": lambda v: v > 0,
    ">= 0": lambda v: v >= 0,
    "< 0": lambda v: v < 0,
    "in [0, 1]": lambda v: 0 <= v <= 1,
}


def number(fn: str, name: str, value: object, bound: Bound | None = None) -> None:
    """Checks a hyper-parameter given as a Python number: real, finite and within
    ``bound``, if given. A tensor passes unread."""
    if isinstance(value, Tensor):
        return
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{fn}: {name} must be a real number or a tensor, got "
                        f"{type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{fn}: {name} must be finite, got {value}")
    if bound is not None and not _BOUNDS[bound](value):
        raise ValueError(f"{fn}: {name} must be {bound}, got {value}")
