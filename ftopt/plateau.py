"""``reduce_on_plateau`` (optax.contrib's): scale the updates down when a metric stops
improving. ``update`` takes the metric as ``value=`` (the loss, a validation score);
every decision is a ``torch.where`` on 0-d tensors, so the step never reads the device
(a ``value`` on the GPU stays there)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ftopt import tree as tree_lib
from ftopt.base import GradientTransformation, register_owner, register_state
from ftopt.domains import check_finite, check_int
from ftopt.finite import safe_increment

__all__ = ["ReduceLROnPlateauState", "reduce_on_plateau"]


@register_state
class ReduceLROnPlateauState(NamedTuple):
    """optax's layout: the scale of the updates, the best average metric so far, the
    averages without improvement, the cooldown left, the values averaged so far and
    their average (0-d tensors)."""

    scale: torch.Tensor
    best_value: torch.Tensor
    plateau_count: torch.Tensor
    cooldown_count: torch.Tensor
    count: torch.Tensor
    avg_value: torch.Tensor


class ReduceOnPlateau:
    """The object behind :func:`reduce_on_plateau` (see there)."""

    unfused_reason = ("reduce_on_plateau runs eagerly: it reads the metric passed to "
                      "update as value=")
    update_keywords = ("value",)

    def __init__(self, factor, patience, rtol, atol, cooldown, accumulation_size, min_scale):
        name = "reduce_on_plateau"
        self.factor = check_finite(name, "factor", factor)
        if not 0.0 < self.factor < 1.0:
            raise ValueError(f"{name}: factor must be in (0, 1), got {factor}")
        self.rtol = check_finite(name, "rtol", rtol)
        self.atol = check_finite(name, "atol", atol)
        if self.rtol < 0.0 or self.atol < 0.0 or self.rtol > 1.0:
            raise ValueError(f"{name}: rtol must be in [0, 1] and atol >= 0, got rtol={rtol}, "
                             f"atol={atol}")
        if self.rtol == 0.0 and self.atol == 0.0:
            raise ValueError(f"{name}: rtol or atol must be > 0, got both 0")
        self.patience = check_int(name, "patience", patience, minimum=1)
        self.cooldown = check_int(name, "cooldown", cooldown, minimum=0)
        self.accumulation_size = check_int(name, "accumulation_size", accumulation_size,
                                           minimum=1)
        self.min_scale = check_finite(name, "min_scale", min_scale)
        register_owner(self)

    def init(self, params) -> ReduceLROnPlateauState:
        leaves = [x for x in tree_lib.leaves(params) if isinstance(x, torch.Tensor)]
        device = leaves[0].device if leaves else None
        dtype = torch.float32
        for x in leaves:
            if x.is_floating_point():
                dtype = torch.promote_types(dtype, x.dtype)
        zero = torch.zeros((), dtype=torch.int32, device=device)
        return ReduceLROnPlateauState(
            scale=torch.ones((), dtype=torch.float32, device=device),
            best_value=torch.full((), float("inf"), dtype=dtype, device=device),
            plateau_count=zero, cooldown_count=zero.clone(), count=zero.clone(),
            avg_value=torch.zeros((), dtype=dtype, device=device))

    def _new_scale(self, s: ReduceLROnPlateauState) -> ReduceLROnPlateauState:
        """optax's ``_update_scale``: after ``accumulation_size`` values."""
        improved = s.avg_value < (1 - self.rtol) * s.best_value - self.atol
        best = torch.where(improved, s.avg_value, s.best_value)
        plateau = torch.where(improved, torch.zeros_like(s.plateau_count),
                              safe_increment(s.plateau_count))
        reduce = plateau == self.patience
        cooling = s.cooldown_count > 0
        zero = torch.zeros_like(s.plateau_count)
        scale = torch.clamp(torch.where(reduce, s.scale * self.factor, s.scale),
                            min=self.min_scale)
        return ReduceLROnPlateauState(
            scale=torch.where(cooling, s.scale, scale),
            best_value=best,
            plateau_count=torch.where(cooling | reduce, zero, plateau),
            cooldown_count=torch.where(cooling, s.cooldown_count - 1, torch.where(
                reduce, torch.full_like(zero, self.cooldown), zero)),
            count=zero, avg_value=torch.zeros_like(s.avg_value))

    def update(self, updates, state, params=None, *, value: Any = None, **extra):
        del params, extra
        if not isinstance(state, ReduceLROnPlateauState):
            raise ValueError(f"reduce_on_plateau expects a ReduceLROnPlateauState, got "
                             f"{type(state).__name__} (a state made by another transform?)")
        if value is None:
            raise TypeError("reduce_on_plateau: update needs the metric as value= "
                            "(tx.update(grads, state, params, value=loss))")
        value = torch.as_tensor(value, dtype=state.avg_value.dtype,
                                device=state.avg_value.device)  # (a number: no float32 first)
        if value.numel() != 1:
            raise ValueError(f"reduce_on_plateau: value must be one number, got shape "
                             f"{tuple(value.shape)}")
        count = safe_increment(state.count)
        avg = (state.count * state.avg_value + value.reshape(())) / count
        new = state._replace(count=count, avg_value=avg)
        decided = self._new_scale(new)
        done = count == self.accumulation_size
        new = ReduceLROnPlateauState(*[torch.where(done, d, n) for d, n in zip(decided, new)])
        return tree_lib.map(lambda u: (new.scale.to(u.device) * u).to(u.dtype), updates), new


def reduce_on_plateau(factor: float = 0.1, patience: int = 10, rtol: float = 1e-4,
                      atol: float = 0.0, cooldown: int = 0, accumulation_size: int = 1,
                      min_scale: float = 0.0) -> GradientTransformation:
    """Scales the updates by ``factor`` after ``patience`` averages of the metric without
    improvement, as optax.contrib. ``update(..., value=metric)``; the values are averaged
    over ``accumulation_size`` calls, and each average counts as an improvement where it
    is below ``(1 − rtol)·best − atol``; after a reduction, ``cooldown`` averages pass
    without counting; the scale stays >= ``min_scale``. Put it after the learning rate
    (``chain(adam(lr), reduce_on_plateau())``) to scale the steps.

    Args:
        factor: in (0, 1). patience: an int >= 1. rtol: in [0, 1]; atol: >= 0 (not both
            0). cooldown: an int >= 0. accumulation_size: an int >= 1. min_scale: finite.
    """
    obj = ReduceOnPlateau(factor, patience, rtol, atol, cooldown, accumulation_size,
                          min_scale)
    return GradientTransformation(obj.init, obj.update)
