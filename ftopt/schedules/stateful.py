"""Stateful schedules (optax's ``StatefulSchedule``): a schedule whose value depends on a
state it carries from step to step, and on keywords of the step (the loss, say), for
:func:`ftopt.inject_hyperparams`.

A stateful schedule is any object with three methods:

* ``init() -> state``: its state before the first step (a pytree of tensors, numbers or
  ``None``);
* ``__call__(state, **extra) -> value``: the hyperparameter for the step about to run
  (a number, or a 0-d floating-point tensor);
* ``update(state, **extra) -> state``: its state after that step.

``extra`` holds the keywords given to the step (``update(..., value=loss)``); a schedule
takes the ones it reads and ignores the rest. One that reads some names them in an
``update_keywords`` attribute, so :class:`ftopt.Optimizer` passes them on
(:func:`ftopt.update_keywords`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from ftopt._counts import new_count, remember_count
from ftopt.base import register_state
from ftopt.eager import known_count
from ftopt.schedules.decays import Schedule

__all__ = ["StatefulSchedule", "WrappedSchedule", "WrappedScheduleState"]


@runtime_checkable
class StatefulSchedule(Protocol):
    """The protocol of a stateful schedule (see the module docstring)."""

    def init(self) -> Any: ...

    def update(self, state: Any, **extra: Any) -> Any: ...

    def __call__(self, state: Any, **extra: Any) -> float | torch.Tensor: ...


@register_state
class WrappedScheduleState(NamedTuple):
    """The state of :class:`WrappedSchedule`: its steps so far (0-d int32)."""

    count: torch.Tensor


class WrappedSchedule:
    """A plain schedule (a function of the step count) as a stateful one, counting its
    own steps (optax's ``WrappedSchedule``). The schedule is called with the count as an
    ``int`` (host math, a kernel argument of a fused step; a count loaded from a
    checkpoint is read once), or as the tensor where it may not be read
    (:func:`ftopt.eager.known_count`)."""

    def __init__(self, schedule_fn: Schedule):
        if not callable(schedule_fn):
            raise TypeError(f"WrappedSchedule: schedule_fn must be callable, got "
                            f"{type(schedule_fn).__name__}")
        self.schedule_fn = schedule_fn

    def init(self) -> WrappedScheduleState:
        return WrappedScheduleState(new_count(0, "cpu"))

    def update(self, state: WrappedScheduleState, **extra: Any) -> WrappedScheduleState:
        del extra
        known = known_count(state.count)
        count = state.count + 1
        if known is not None:
            remember_count(count, known + 1)
        return WrappedScheduleState(count)

    def __call__(self, state: WrappedScheduleState, **extra: Any) -> float | torch.Tensor:
        del extra
        known = known_count(state.count)
        return self.schedule_fn(state.count if known is None else known)
