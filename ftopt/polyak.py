"""Polyak's step size (optax's ``scale_by_polyak`` and ``polyak_sgd``): the step from the
loss passed to ``update`` as ``value=`` and the squared norm of the updates, decided on
the device (``torch.where`` on 0-d tensors, no host read)."""

from __future__ import annotations

import sys
from typing import Any

import torch

from ftopt import tree as tree_lib
from ftopt.alias import sgd
from ftopt.base import EmptyState, GradientTransformation, register_owner
from ftopt.combine import chain
from ftopt.domains import NONNEG, check_finite
from ftopt.schedules import ScalarOrSchedule
from ftopt.skip_fns import squared_norm

__all__ = ["scale_by_polyak", "polyak_sgd"]

_TINY = sys.float_info.epsilon  # optax: jnp.finfo(float).eps


class ScaleByPolyak:
    """The object behind :func:`scale_by_polyak` (see there)."""

    unfused_reason = "scale_by_polyak runs eagerly: it reads the loss passed to update as value="
    update_keywords = ("value",)

    def __init__(self, f_min: float, max_learning_rate: float, eps: float, variant: str):
        name = "scale_by_polyak"
        self.f_min = check_finite(name, "f_min", f_min)
        self.max_learning_rate = check_finite(name, "max_learning_rate", max_learning_rate,
                                              NONNEG)
        self.eps = check_finite(name, "eps", eps, NONNEG)
        if variant not in ("sps", "sps+"):
            raise ValueError(f"{name}: variant must be 'sps' or 'sps+', got {variant!r}")
        self.variant = variant
        register_owner(self)

    def init(self, params) -> EmptyState:
        del params
        return EmptyState()

    def update(self, updates, state, params=None, *, value: Any = None, **extra):
        del params, extra
        if value is None:
            raise TypeError("scale_by_polyak: update needs the loss as value= "
                            "(tx.update(grads, state, params, value=loss))")
        leaves = [u for u in tree_lib.leaves(updates) if u is not None]
        if not leaves:
            return updates, state
        sq = squared_norm(leaves)
        gap = torch.as_tensor(value, dtype=sq.dtype, device=sq.device).reshape(()) - self.f_min
        if self.variant == "sps+":
            gap = gap.clamp(min=0.0)
        denom = sq + self.eps
        step = torch.where(denom <= _TINY, torch.zeros_like(sq),
                           torch.clamp(gap / denom, max=self.max_learning_rate))
        return tree_lib.map(lambda u: (step.to(u.device) * u).to(u.dtype), updates), state


def scale_by_polyak(f_min: float = 0.0, max_learning_rate: float = 1.0, eps: float = 0.0,
                    variant: str = "sps") -> GradientTransformation:
    """Scales the updates by Polyak's step size, as optax: with ``value`` the loss passed
    to ``update`` and ‖u‖² over the whole tree, step = min((value − f_min)/(‖u‖² + eps),
    max_learning_rate), 0 where ‖u‖² + eps <= float64 epsilon; ``variant="sps+"`` takes
    max(value − f_min, 0).

    Args:
        f_min: a lower bound of the loss. max_learning_rate: >= 0. eps: >= 0.
        variant: ``"sps"`` or ``"sps+"``.
    """
    obj = ScaleByPolyak(f_min, max_learning_rate, eps, variant)
    return GradientTransformation(obj.init, obj.update)


def polyak_sgd(max_learning_rate: float = 1.0, scaling: ScalarOrSchedule = 1.0,
               f_min: float = 0.0, eps: float = 0.0, variant: str = "sps"
               ) -> GradientTransformation:
    """SGD with Polyak's step size (Loizou et al. 2021, as optax): ``chain(sgd(scaling),
    scale_by_polyak(f_min, max_learning_rate, eps, variant))``; call
    ``tx.update(grads, state, params, value=loss)``."""
    return chain(sgd(scaling), scale_by_polyak(f_min, max_learning_rate, eps, variant))
