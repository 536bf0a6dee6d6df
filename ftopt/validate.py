"""The per-leaf input checks that every backend runs before it computes or writes anything.

The eager ``update`` (:mod:`ftopt.rules`) and the fused planner (:mod:`ftopt.lowering.plan`)
call the same functions here, so a bad input gets the same error, naming the leaf's pytree
path and what was expected, whichever backend the call takes. Raising before any write is
what keeps ``step(..., donate=True)`` from leaving half-updated params behind.
"""

from __future__ import annotations

from typing import Any

import torch

from ftopt.rules import QuantizedSlot, Rule, check_param
from ftopt.shards import full_numel

__all__ = ["check_leaf", "check_slots", "check_count", "check_running", "check_layout",
           "check_state_class"]


def check_state_class(rule: Rule, state: Any) -> None:
    """A stateful rule's state is its own NamedTuple (not another transform's)."""
    if (rule.slots or rule.counted or rule.running) and not isinstance(state,
                                                                      rule.state_class):
        raise ValueError(f"{rule.name} expects a {rule.state_class.__name__} state, got "
                         f"{type(state).__name__} (a state made by another transform?)")


def check_layout(what: str, path: str, t: torch.Tensor) -> None:
    """Only dense (strided) tensors: sparse ones have no per-element storage to update."""
    if t.layout != torch.strided:
        hint = "densify it first: g.to_dense()" if what == "grad" else "expected a dense tensor"
        raise TypeError(f"{what} at {path}: a sparse tensor ({t.layout}) is not supported "
                        f"({hint})")


def check_stage_state(name: str, path: str, s: Any, shape: tuple, device: Any) -> None:
    """One leaf of a matrix stage's state field ``name``: a dense floating-point tensor of
    ``shape`` on ``device`` (errors name the field and the leaf's path)."""
    where = f"state {name} at {path}"
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"{where}: expected a tensor, got {type(s).__name__}")
    check_layout(f"state {name}", path, s)
    if not s.is_floating_point():
        raise TypeError(f"{where}: expected a floating-point tensor, got {s.dtype}")
    if tuple(s.shape) != tuple(shape):
        raise ValueError(f"{where}: shape {tuple(s.shape)} does not match the update's: "
                         f"expected {tuple(shape)}")
    if s.device != device:
        raise ValueError(f"{where}: on {s.device}, expected {device}")


def check_leaf(path: str, u: Any, p: Any, params_given: bool = True) -> None:
    """One leaf's update (gradient) and param: a dense floating-point tensor each, of one
    shape, on one device (``params_given=False``: an update called without params)."""
    if not isinstance(u, torch.Tensor):
        raise TypeError(f"update at {path}: expected a tensor or None, got {type(u).__name__}")
    check_layout("grad", path, u)
    if not u.is_floating_point():
        raise TypeError(f"update at {path}: expected a floating-point tensor, got {u.dtype}")
    if p is None:
        if params_given:
            raise TypeError(f"params at {path}: expected a tensor, got NoneType (the params "
                            "hold None where the gradient holds a tensor)")
        return
    check_param(path, p)
    if p.shape != u.shape:
        raise ValueError(f"update at {path}: shape {tuple(u.shape)} does not match the "
                         f"param's shape: expected {tuple(p.shape)}")
    if u.device != p.device:
        raise ValueError(f"grad at {path}: on {u.device}, expected the param's device "
                         f"{p.device}")


def check_slots(stage: Any, path: str, u: torch.Tensor, p: Any, slots: dict) -> None:
    """The states of one leaf for ``stage``: shaped like the update, floating-point, on the
    param's device, and of the kind ``stage`` keeps for a leaf of this size (8-bit
    ``QuantizedSlot`` for leaves of at least ``min_size`` elements under ``state_bits=8``,
    32-bit tensors otherwise, with as many absmax entries as the block size gives)."""
    device, whose = (p.device, "param's") if p is not None else (u.device, "update's")
    per_leaf = _per_leaf(stage)
    for name, s in slots.items():
        where = f"state {name} at {path}"
        if name in per_leaf:
            _check_per_leaf(name, path, s)
            tensors = (s,)
        elif isinstance(s, QuantizedSlot):
            tensors = _check_quantized(stage, where, u, p, s)
        elif isinstance(s, torch.Tensor):
            check_layout(f"state {name}", path, s)
            if s.shape != u.shape:
                raise ValueError(f"{where}: shape {tuple(s.shape)} does not match the "
                                 f"update's shape: expected {tuple(u.shape)}")
            if not s.is_floating_point():
                raise TypeError(f"{where}: expected a floating-point tensor, got {s.dtype}")
            quant = stage.quant
            if quant is not None and _at_least(full_numel(p if p is not None else u),
                                               quant.min_size) \
                    and name not in _full_width(stage):
                raise ValueError(f"{where}: a 32-bit state given to a transform with 8-bit "
                                 f"states (state_bits={quant.bits}, leaves of >= "
                                 f"{quant.min_size} elements)")
            tensors = (s,)
        else:
            raise TypeError(f"{where}: expected a tensor (or an 8-bit QuantizedSlot), got "
                            f"{type(s).__name__}")
        for t in tensors:
            if t.device != device:
                raise ValueError(f"{where}: on {t.device}, expected the {whose} device "
                                 f"{device}")


def _per_leaf(stage: Any) -> set[str]:
    rule = getattr(stage, "rule", None)
    return {slot.name for slot in getattr(rule, "slots", ()) if slot.per_leaf}


def _check_per_leaf(name: str, path: str, s: Any) -> None:
    """A per-leaf slot's value: a 0-d floating-point tensor."""
    where = f"state {name} at {path}"
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"{where}: expected a 0-d tensor (one value per leaf), got "
                        f"{type(s).__name__}")
    check_layout(f"state {name}", path, s)
    if not s.is_floating_point():
        raise TypeError(f"{where}: expected a floating-point tensor, got {s.dtype}")
    if s.ndim != 0:
        raise ValueError(f"{where}: expected a 0-d tensor (one value per leaf), got shape "
                         f"{tuple(s.shape)}")


def _at_least(numel: int | None, size: int) -> bool:
    return numel is not None and numel >= size


def _full_width(stage: Any) -> set[str]:
    """The slots ``stage`` keeps in the compute dtype whatever its state format (a rule's
    ``from_params`` slots, or a stage's ``full_width_slots``)."""
    names = getattr(stage, "full_width_slots", None)
    if names is not None:
        return set(names)
    return {slot.name for slot in stage.rule.slots if slot.from_params or slot.per_leaf}


def _check_quantized(stage: Any, where: str, u: torch.Tensor, p: Any,
                     s: QuantizedSlot) -> tuple:
    quant = stage.quant
    if quant is None:
        raise ValueError(f"{where}: an 8-bit state (QuantizedSlot) given to a transform "
                         "with 32-bit states (state_bits=32)")
    numel = full_numel(p if p is not None else u)
    if numel is not None and numel < quant.min_size:
        raise ValueError(f"{where}: an 8-bit state (QuantizedSlot) given to a transform "
                         f"that keeps 32-bit states for leaves of < {quant.min_size} elements "
                         f"(this one has {numel})")
    codes, absmax = s
    for part, t, dtype in (("codes", codes, torch.uint8), ("absmax", absmax, torch.float32)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: 8-bit {part} must be a tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise TypeError(f"{where}: 8-bit {part} is a sparse tensor ({t.layout})")
        if t.dtype != dtype:
            raise TypeError(f"{where}: 8-bit {part} must be {dtype}, got {t.dtype}")
    if codes.shape != u.shape:
        raise ValueError(f"{where}: shape {tuple(codes.shape)} does not match the update's "
                         f"shape: expected {tuple(u.shape)}")
    expected = -(-u.numel() // quant.block_size)
    if absmax.numel() != expected:
        raise ValueError(f"{where}: absmax has {absmax.numel()} entries, expected {expected} "
                         f"(block_size={quant.block_size} for {u.numel()} elements; was the "
                         "state made with another block_size?)")
    return codes, absmax


def check_count(rule_name: str, count: Any) -> None:
    """A step count is a 0-d integer tensor with a value (not on the meta device)."""
    if (not isinstance(count, torch.Tensor) or count.ndim != 0 or count.is_floating_point()
            or count.is_complex() or count.dtype == torch.bool):
        got = (f"a {count.dtype} tensor of shape {tuple(count.shape)}"
               if isinstance(count, torch.Tensor) else type(count).__name__)
        raise ValueError(f"{rule_name}: state.count must be a 0-d integer tensor, got {got}")
    if count.device.type == "meta":
        raise ValueError(f"{rule_name}: state.count is on the meta device (it holds no "
                         "value): expected a 0-d integer tensor on the params' device")


def check_running(rule: Rule, state: Any) -> None:
    """A rule's running scalars (:attr:`Rule.running`) are 0-d fp32 tensors with values
    (fp64 too: a float64 computation keeps them in float64)."""
    for name in rule.running:
        value = getattr(state, name)
        if (not isinstance(value, torch.Tensor) or value.ndim != 0
                or value.dtype not in (torch.float32, torch.float64)
                or value.layout != torch.strided):
            got = (f"a {value.dtype} tensor of shape {tuple(value.shape)}"
                   if isinstance(value, torch.Tensor) else type(value).__name__)
            raise ValueError(f"{rule.name}: state.{name} must be a 0-d float32 tensor, got "
                             f"{got}")
        if value.device.type == "meta":
            raise ValueError(f"{rule.name}: state.{name} is on the meta device (it holds no "
                             "value): expected a 0-d float32 tensor on the params' device")
