"""Elementwise rules: the one definition of each transform's per-element math.

A :class:`Rule` names its per-element state slots, its hyperparameters, the per-step
scalars derived from them (bias corrections and the like, computed once per step from the
step count ``t``) and a ``body(o, x) -> (u, new_slots)``: plain arithmetic over the values
in ``x`` (``x.u``, ``x.p``, ``x.<slot>``, ``x.<scalar>``) and the ``o`` namespace
(``sqrt``, ``cbrt``, ``abs``, ``sign``, ``where``, ``maximum``, ``minimum``, ``lerp``,
``log``, ``cos``, ``sin``, ``leaf_norm``, ``global_norm``, ``global_sum``; and 32-bit
unsigned integer ops for counter-based random numbers: ``u32``, ``xor``, ``shr``,
``mul32``, ``add32``, ``to_float``, and ``paired(fn, x.index, *args)``:
``fn(o, k, *args) -> (even, odd)`` computed once per pair ``k`` of element positions
(2k, 2k + 1), each element taking its own of the two). A rule may also keep **running
scalars**: 0-d fp32 tensors of its state
(next to the step count) that ``rule.advance`` moves once per step, with torch ops on
their device (no host read), giving the body per-step scalars that depend on the whole
history (Schedule-Free's averaging weight). A body may also return new values of its
running scalars (in its dict of new slots, under their names): values of this step that
depend on global reductions (Prodigy's estimate); the fused main kernel stores them
(program 0), and ``advance`` then leaves them out of its new values. A body reads
``x.skip``: where the chain skips zero gradients, the mask of the skipped elements
(``None`` elsewhere), so a reduction of a state can see the state as kept. The eager
backend evaluates the body on tensors (:mod:`ftopt.eager`); the fused backend evaluates
it on symbols and prints a Triton kernel (:mod:`ftopt.lowering`).

:class:`ftopt.rule_transform.RuleTransform` turns a rule into a
``GradientTransformation`` (the state layout: 32-bit or 8-bit blockwise slots, the step
count; validation), and :func:`ftopt.program.trace_chain` is what every backend runs a
chain of rules with (``skip_zeros`` included). This module holds only the types every
layer shares (the rule, its slots, the 8-bit layout) and the per-step scalars.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ftopt import tree as tree_lib
from ftopt.base import EmptyState, register_state
from ftopt.domains import Interval

__all__ = ["Slot", "Rule", "QuantizedSlot", "QuantConfig", "Env", "hparam_values",
           "step_scalars", "initial_running", "running_dtype", "running_step", "compute_dtype",
           "state_dtype", "check_param", "checked_params"]


@dataclass(frozen=True)
class Slot:
    """A per-element state of a rule.

    ``signed`` picks the 8-bit map (signed for states that can be negative); ``init`` names
    the hyperparameter holding the initial value (zero when ``None``); ``from_params``:
    the slot starts as a copy of the param instead (MADGRAD's x0), and is always stored in
    the param's compute dtype, never in 8 or 16 bits: a rounded copy of the params would
    move them where the gradients are zero. ``dtype``: a ``from_params`` slot's storage
    dtype when the user asked for one (Schedule-Free's ``state_dtype``), whatever the
    state format of the rest of the chain.

    ``per_leaf``: one value per *leaf*, not per element (NovoGrad's ``nu``): a 0-d tensor
    in the param's compute dtype, never stored in 8 or 16 bits. The body reads and
    returns it as a per-leaf value; with ``skip_zeros`` a leaf whose raw gradient is all
    zero keeps it bit for bit (:func:`ftopt.program.trace_chain`). The fused kernel loads
    it once per program and the first program of its leaf stores it.
    """

    name: str
    signed: bool = True
    init: str | None = None
    from_params: bool = False
    dtype: torch.dtype | None = None
    per_leaf: bool = False


@dataclass(frozen=True)
class QuantConfig:
    """8-bit blockwise storage for slots of leaves with at least ``min_size`` elements."""

    bits: int = 8
    block_size: int = 256
    min_size: int = 4096


@register_state
class QuantizedSlot(NamedTuple):
    """One leaf of an 8-bit state slot: uint8 codes and one fp32 absmax per block."""

    codes: torch.Tensor
    absmax: torch.Tensor


@dataclass(frozen=True)
class Rule:
    """The per-element math of one transform (see the module docstring)."""

    name: str
    body: Callable
    state_class: type = EmptyState
    slots: tuple[Slot, ...] = ()
    hparams: Mapping[str, Any] = field(default_factory=dict)
    scalars: Callable[[Any, dict], dict] | None = None
    counted: bool = False
    uses_params: bool = False
    # The body reads ``x.index`` (each element's row-major position in its leaf) and
    # ``x.leaf`` (the leaf's position in the flattened param tree), as 32-bit unsigned
    # integers for the ``o.xor``/``o.shr``/``o.mul32``/``o.add32`` ops (``add_noise``).
    indexed: bool = False
    leaf_mask: Any = None
    schedule_at_t: bool = False
    # The allowed range of each float hyperparameter, checked at construction (an absent
    # entry: any finite value). See :mod:`ftopt.domains`.
    domains: Mapping[str, Interval] = field(default_factory=dict)
    # Running scalars (see the module docstring): state field -> initial value (a float,
    # or the name of the hyperparameter holding it); ``advance(t, h, old) -> (scalars,
    # new)`` maps this step's ``t``, hyperparameters and old values (0-d fp32 tensors) to
    # the body's extra scalars and the new values, with torch ops only.
    running: Mapping[str, Any] = field(default_factory=dict)
    advance: Callable[[Any, dict, dict], tuple[dict, dict]] | None = None


def hparams_require_grad(rule: Rule) -> bool:
    """A tensor hyperparameter of ``rule`` requires grad (a meta-gradient flows through the
    step, so it must run on the differentiable path)."""
    return any(isinstance(v, torch.Tensor) and v.requires_grad for v in rule.hparams.values())


def hparam_values(rule: Rule, count: Any, t: Any) -> dict:
    """Hyperparameters at this step: schedules called with the count (or ``t``)."""
    at = t if rule.schedule_at_t else count
    return {k: (v(at) if callable(v) else v) for k, v in rule.hparams.items()}


def initial_running(rule: Rule, device: Any = None,
                    dtype: torch.dtype = torch.float32) -> dict:
    """The running scalars of a new state: 0-d tensors on ``device``, fp32 (``dtype``
    float64 where every param is: a float64 computation keeps them in float64)."""
    out = {}
    for name, value in rule.running.items():
        value = rule.hparams[value] if isinstance(value, str) else value
        out[name] = torch.full((), float(value), dtype=dtype, device=device)
    return out


def running_dtype(old: Any) -> torch.dtype:
    """The dtype of a running scalar's new value: float64 where the old one is, else fp32."""
    return torch.float64 if getattr(old, "dtype", None) == torch.float64 else torch.float32


def running_step(rule: Rule, count: Any, t: Any, old: dict) -> tuple[dict, dict]:
    """One step of ``rule``'s running scalars: ``(the body's scalars from them, the new
    values)``; every backend calls this, once per step (also with no active leaf)."""
    scalars, new = rule.advance(t, hparam_values(rule, count, t), old)
    return scalars, {k: v.to(running_dtype(old.get(k))) for k, v in new.items()}


def step_scalars(rule: Rule, count: Any, t: Any, carried: dict | None = None) -> dict:
    """The per-step scalars a body reads: the hyperparameters plus ``rule.scalars``, plus
    ``carried`` (the scalars :func:`running_step` gave this step; where it is not given,
    those of a new state, which name the same values)."""
    h = hparam_values(rule, count, t)
    if rule.advance is not None and carried is None:
        carried = running_step(rule, count, t, initial_running(rule))[0]
    if rule.scalars is not None:
        # A device count (under torch.func, or unknown on an accelerator) is an integer
        # tensor: ``b ** t`` on it would be float32, so 1 - b2**t would lose ~1e-5 relative
        # to the host path. Compute the per-step scalars in float64, as the host does.
        t_scalar = t.to(torch.float64) if isinstance(t, torch.Tensor) else t
        # Tensor hyperparameters likewise: b1 ** t on an fp32 b1 = 0.999 leaves
        # 1 - b1 ** t ~1e-4 off (float64 where the device has it).
        h = {**h, **rule.scalars(t_scalar, {k: _wide(v) for k, v in h.items()})}
    if carried:
        h = {**h, **carried}
    return h


def _wide(v: Any) -> Any:
    if (isinstance(v, torch.Tensor) and v.dtype == torch.float32
            and v.device.type in ("cpu", "cuda")):
        return v.to(torch.float64)
    return v


class Env:
    """The values a body reads, by attribute."""

    def __init__(self, values: dict):
        self.__dict__.update(values)


def state_dtype(p: torch.Tensor) -> torch.dtype:
    return torch.promote_types(p.dtype, torch.float32)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def check_param(path: str, p) -> None:
    """A param is a dense floating-point tensor (also checked by ``init``: a state built
    for an int or sparse param would fail only at the first step)."""
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"params at {path}: expected a tensor, got {type(p).__name__}")
    if p.layout != torch.strided:
        raise TypeError(f"params at {path}: a sparse tensor ({p.layout}) is not supported "
                        "(expected a dense tensor)")
    if not p.is_floating_point():
        raise TypeError(f"params at {path}: expected a floating-point tensor, got {p.dtype}")


def checked_params(params) -> tuple[list[str], list, Any]:
    """Paths, leaves and structure of ``params``, every leaf checked (:func:`check_param`):
    what an eager transform's ``init`` starts from."""
    paths, flat, spec = tree_lib.flatten_with_paths(params)
    for path, p in zip(paths, flat):
        check_param(path, p)
    return paths, flat, spec

def as_host_numbers(scalars: dict, dtype: torch.dtype) -> dict:
    """Per-step scalars that are float64 0-d tensors (a device count) in ``dtype``, as
    the host's numbers act: an op of a Python float and an fp32 tensor computes in fp32,
    while one of two 0-d tensors would promote to float64 (a rule whose body mixes them
    with its 0-d running scalars would round differently from the host path)."""
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.ndim == 0
            and v.dtype == torch.float64 and dtype != torch.float64 else v
            for k, v in scalars.items()}
