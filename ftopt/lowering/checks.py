"""Whether new tensors fit tables built for earlier ones, in one C call where possible.

A cached fused step must check, for every param, state and gradient tensor it was
planned for, that the tensor it is given now has the same shape, strides, dtype and
device (and, for params and states, the same memory) before a kernel reads or writes it
through a raw address. In order of preference:

* the native check (:mod:`ftopt.lowering.native`): pointers and layout of the whole list
  in one C++ pass (~7 ns a tensor); built on first use on an accelerator;
* torch's compiled-graph guards (``torch._C._dynamo.guards.TensorGuards``: dtype, device,
  sizes, strides, ``requires_grad`` and dispatch keys in one call) plus one Python call
  per tensor for its pointer (~55 ns each);
* property-by-property Python passes (~0.1 us per tensor and property).

All three give the same answers on what they all check; the first two are stricter
(``requires_grad``), which only sends a caller to its full path, which decides.
"""

from __future__ import annotations

import operator

import torch

from ftopt.lowering import native
from ftopt.shards import dtensor_class, is_dtensor

_shape = operator.attrgetter("shape")
_dtype = operator.attrgetter("dtype")
_device = operator.attrgetter("device")
_is_contiguous = torch.Tensor.is_contiguous
_data_ptr = torch.Tensor.data_ptr

try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - every supported torch has it
    _TensorGuards = None

USE_NATIVE = True  # False: never the native check (tests run every way)
USE_GUARDS = True  # False: the Python passes where the native check is not used


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
    """The layout of a list of contiguous tensors, and their data pointers.

    * ``check(tensors)``: as many tensors, with the same shapes, dtypes and devices,
      contiguous;
    * ``pointers(tensors)`` (where ``n_fixed`` is 0): their data pointers if they pass
      ``check``, else ``None``;
    * ``fit(*parts)``, for a donated step over the tensors of ``parts`` (tuples or lists)
      in order, whose first ``n_fixed`` (params and states) must be the memory recorded:
      ``None`` if the check fails or one of those moved; ``True`` if every pointer is the
      recorded one; else the pointers after ``n_fixed`` (new gradients), which
      :meth:`record` makes the recorded ones once the caller has accepted them.
    """

    __slots__ = ("n", "n_fixed", "guard", "meta", "grad_free", "table", "fixed",
                 "trailing", "contiguous")

    def __init__(self, tensors: list, device: torch.device | None = None, *,
                 n_fixed: int = 0):
        del device  # each tensor's own device is recorded
        self.n = len(tensors)
        self.n_fixed = n_fixed
        self.meta = (list(map(_shape, tensors)), list(map(_dtype, tensors)),
                     list(map(_device, tensors)))
        self.contiguous = all(map(_is_contiguous, tensors))
        pointers = list(map(_data_ptr, tensors))
        self.fixed, self.trailing = pointers[:n_fixed], pointers[n_fixed:]
        self.table = None
        self.guard = None
        if self.contiguous:
            accelerator = any(d.type != "cpu" for d in self.meta[2])
            self.table = _native_table(tensors, n_fixed, start=accelerator)
            if self.table is None:
                self.guard = _guard(tensors)
        # The C++ checks compare requires_grad too: built from tensors that need no grad,
        # they refuse any that do.
        self.grad_free = (self.table is not None or self.guard is not None) and not any(
            t.requires_grad for t in tensors)

    def _layout_fits(self, tensors) -> bool:
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

    def check(self, tensors) -> bool:
        if self.table is not None:
            return _NATIVE[0].fit(self.table, (tensors,), True) is not None
        return self._layout_fits(tensors)

    def pointers(self, tensors) -> list[int] | None:
        if self.table is not None:
            return _NATIVE[0].fit(self.table, (tensors,), True)
        if not self._layout_fits(tensors):
            return None
        return list(map(_data_ptr, tensors))

    def fit(self, *parts) -> list[int] | bool | None:
        """``parts``: tuples or lists of tensors, checked as their concatenation."""
        if self.table is not None:
            return _NATIVE[0].fit(self.table, parts, False)
        tensors = [t for part in parts for t in part]
        if not self._layout_fits(tensors):
            return None
        pointers = list(map(_data_ptr, tensors))
        n = self.n_fixed
        if pointers[:n] != self.fixed:
            return None
        if self.contiguous and native.module(start=False) is not None:
            # Built since this check was: use it from now on (same layout as recorded).
            self.table = _native_table(tensors, n, start=False)
            if self.table is not None:
                _NATIVE[0].record(self.table, self.trailing)
                self.guard = None
        trailing = pointers[n:]
        return True if trailing == self.trailing else trailing

    def record(self, pointers: list[int]) -> None:
        self.trailing = pointers
        if self.table is not None:
            _NATIVE[0].record(self.table, pointers)


# The loaded native module, once (a list: read on every check without a function call).
_NATIVE: list = [None]


def _native_table(tensors, n_fixed: int, start: bool):
    if not USE_NATIVE:
        return None
    module = native.module(start=start)
    if module is None:
        return None
    _NATIVE[0] = module
    return module.make(tensors, n_fixed)


def holds_dtensor(tensors) -> bool:
    """Whether any of ``tensors`` is a ``DTensor``."""
    cls = dtensor_class()
    return cls is not None and any([isinstance(t, cls) for t in tensors])


def refuse_dtensors(tensors) -> None:
    """No kernel is given a DTensor's address: ``DTensor.data_ptr()`` is 0 (its data is
    the local tensor's), so a kernel would read address 0. ``ftopt.step`` hands the
    kernels local shards (:mod:`ftopt.distributed`); reaching here with a DTensor is a
    bug, stopped before any launch."""
    if dtensor_class() is None:
        return
    for t in tensors:
        if is_dtensor(t):
            raise TypeError(f"a DTensor {tuple(t.shape)} with placements "
                            f"{tuple(t.placements)} reached the fused kernels: they take "
                            "local tensors (t.to_local()), which ftopt.step passes them")
