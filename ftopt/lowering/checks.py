"""Whether new tensors fit tables built for earlier ones, in as few C calls as possible.

A fused step over new gradient tensors (``zero_grad(set_to_none=True)``, a
``torch.func.grad`` loop) must check each one's shape, dtype, device and layout before
the kernel reads it through a raw address. Property by property from Python that is five
passes over the leaves (~0.1 us per tensor and property). torch's compiled-graph guards
(``torch._C._dynamo.guards.TensorGuards``) check dtype, device, sizes, strides,
``requires_grad`` and dispatch keys of a whole list in one C++ call; they are used where
this torch has them in the form probed here, and the Python passes otherwise.
"""

from __future__ import annotations

import operator

import torch

_shape = operator.attrgetter("shape")
_dtype = operator.attrgetter("dtype")
_device = operator.attrgetter("device")
_is_contiguous = torch.Tensor.is_contiguous

try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - every supported torch has it
    _TensorGuards = None

USE_GUARDS = True  # False: always the Python passes (tests run both)


def _guard(tensors: list):
    """A ``TensorGuards`` over ``tensors``, or ``None`` where this torch's differs from
    the form probed (the probe: it accepts the same tensors and refuses another dtype)."""
    if _TensorGuards is None or not USE_GUARDS or not tensors:
        return None
    try:
        guard = _TensorGuards(
            *tensors, tensor_check_names=[f"t{i}" for i in range(len(tensors))],
            dynamic_dims_sizes=[list(t.shape) for t in tensors],
            dynamic_dims_strides=[list(t.stride()) for t in tensors])
        other = tensors[0].new_empty(tensors[0].shape, dtype=(
            torch.float64 if tensors[0].dtype != torch.float64 else torch.float32))
        if guard.check(*tensors) is not True or guard.check(other, *tensors[1:]) is not False:
            return None
    except Exception:  # noqa: BLE001 - a private API: any failure means "do not use it"
        return None
    return guard


class TensorCheck:
    """Built from contiguous tensors; ``check(tensors)`` is True when ``tensors`` (a
    sequence of as many) have the same shapes, dtypes and devices, and are contiguous.
    The C++ check is stricter (also strides, ``requires_grad`` and dispatch keys): a
    False only sends the caller to its full path, which decides."""

    __slots__ = ("n", "guard", "meta", "grad_free")

    def __init__(self, tensors: list, device: torch.device | None = None):
        del device  # each tensor's own device is recorded
        self.n = len(tensors)
        self.meta = (list(map(_shape, tensors)), list(map(_dtype, tensors)),
                     list(map(_device, tensors)))
        contiguous = all(map(_is_contiguous, tensors))
        self.guard = _guard(tensors) if contiguous else None
        # The C++ check compares requires_grad too: built from tensors that need no
        # grad, it refuses any that do.
        self.grad_free = self.guard is not None and not any(
            t.requires_grad for t in tensors)

    def check(self, tensors) -> bool:
        if len(tensors) != self.n:
            return False
        if self.guard is not None:
            return self.guard.check(*tensors)
        try:
            return ((list(map(_shape, tensors)), list(map(_dtype, tensors)),
                     list(map(_device, tensors))) == self.meta
                    and all(map(_is_contiguous, tensors)))
        except (AttributeError, TypeError, RuntimeError):  # not a (dense) tensor
            return False
