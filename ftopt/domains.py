"""Domains of hyperparameters, checked when a transform, alias or schedule is built.

A bad hyperparameter rarely fails loudly: ``b1 = 1`` makes Adam's bias correction
``1 − b1ᵗ`` zero (every param NaN after one step), a negative ``max_norm`` flips the
update's sign. So each hyperparameter carries an :class:`Interval` and is checked once, at
construction, by :func:`check_hparam`; the message names the transform, the argument, the
allowed range and the value (``scale_by_adam: b1 must be in [0, 1), got 1.0``).

What is checked:

* a Python ``int``/``float`` (``bool`` is rejected): finite, and inside its interval;
* a 0-d tensor on the CPU: its value, the same way (reading a CPU tensor costs no device
  synchronisation);
* a 0-d tensor on an accelerator, or one wrapped by a ``torch.func`` transform or traced
  by ``torch.compile``: only its shape and dtype. Its value is **not** read: that would
  block on the device, so a bad value there is the caller's responsibility;
* a schedule (a callable): nothing; it is not called at construction. The schedules of
  :mod:`ftopt.schedules` check their own arguments when they are built.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Interval", "FINITE", "NONNEG", "POSITIVE", "UNIT", "UNIT_OPEN", "OPEN_UNIT",
           "check_hparam", "check_int", "check_finite"]


def _num(x: float) -> str:
    return f"{x:g}"


@dataclass(frozen=True)
class Interval:
    """A range of real numbers: ``[lo, hi]``, an end open where ``lo_open``/``hi_open``,
    unbounded where ``None``. ``Interval()`` is every finite number."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, x: float) -> bool:
        if self.lo is not None and (x <= self.lo if self.lo_open else x < self.lo):
            return False
        return not (self.hi is not None and (x >= self.hi if self.hi_open else x > self.hi))

    def __str__(self) -> str:
        if self.lo is not None and self.hi is not None:
            return (f"in {'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}"
                    f"{')' if self.hi_open else ']'}")
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        if self.hi is not None:
            return f"{'<' if self.hi_open else '<='} {_num(self.hi)}"
        return "finite"


FINITE = Interval()
NONNEG = Interval(0.0)
POSITIVE = Interval(0.0, lo_open=True)
UNIT = Interval(0.0, 1.0)  # [0, 1]
UNIT_OPEN = Interval(0.0, 1.0, hi_open=True)  # [0, 1): 1 − bᵗ is a divisor
OPEN_UNIT = Interval(0.0, 1.0, lo_open=True, hi_open=True)  # (0, 1): log b is a divisor


def _readable(t: torch.Tensor) -> bool:
    """Whether reading ``t``'s value is free: a plain CPU tensor, outside ``torch.func``
    and ``torch.compile``."""
    if t.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    return not torch._C._functorch.is_functorch_wrapped_tensor(t)


def check_hparam(owner: str, name: str, value: Any, domain: Interval | None = None) -> None:
    """Raise if the hyperparameter ``name`` of ``owner`` is not a float, a 0-d tensor or a
    schedule, or (where its value can be read for free, see the module docstring) is not
    finite or lies outside ``domain``.

    Raises:
        TypeError: a value of another type (``bool`` included).
        ValueError: a tensor that is not 0-d and real, or a value out of range.
    """
    if callable(value):
        return
    if isinstance(value, torch.Tensor):
        if value.ndim != 0 or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{owner}: hyperparameter {name} must be a 0-d real tensor, got "
                             f"shape {tuple(value.shape)} and dtype {value.dtype}")
        if _readable(value):
            _check_value(owner, name, float(value.detach()), domain, " (a 0-d tensor)")
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(
            f"{owner}: hyperparameter {name} must be a float, a 0-d tensor or a schedule, "
            f"got {type(value).__name__}"
        )
    _check_value(owner, name, float(value), domain, "")


def _check_value(owner: str, name: str, x: float, domain: Interval | None, note: str) -> None:
    if not math.isfinite(x):
        raise ValueError(f"{owner}: hyperparameter {name} must be finite, got {x}{note}")
    if domain is not None and x not in domain:
        raise ValueError(f"{owner}: {name} must be {domain}, got {x}{note}")


def check_finite(owner: str, name: str, value: Any, domain: Interval | None = None) -> float:
    """``float(value)`` for a real number (not ``bool``) that is finite and in ``domain``;
    raises ``TypeError``/``ValueError`` naming ``owner`` and ``name`` otherwise."""
    if isinstance(value, torch.Tensor):
        if value.ndim != 0 or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{owner}: {name} must be a real number or 0-d tensor, got "
                             f"shape {tuple(value.shape)} and dtype {value.dtype}")
        value = float(value.detach())  # schedules hold host floats: one read, at build time
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be a real number, got {type(value).__name__}")
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"{owner}: {name} must be finite, got {x}")
    if domain is not None and x not in domain:
        raise ValueError(f"{owner}: {name} must be {domain}, got {x}")
    return x


def check_int(owner: str, name: str, value: Any, minimum: int | None = None, *,
              integral_floats: bool = False) -> int:
    """``value`` as an ``int``, if it is an integer (not ``bool``, not a float) of at least
    ``minimum``; raises ``TypeError``/``ValueError`` naming ``owner`` and ``name``.

    ``integral_floats``: a float with an integer value (``1e4`` step counts, as optax
    accepts them) counts as that integer."""
    if (integral_floats and isinstance(value, float) and math.isfinite(value)
            and value.is_integer()):
        value = int(value)
    if minimum is None:
        what = "an int"
    elif minimum == 1:
        what = "a positive int"
    else:
        what = f"an int >= {minimum}"
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be {what}, got {type(value).__name__} "
                        f"{value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{owner}: {name} must be {what}, got {value}")
    return int(value)
