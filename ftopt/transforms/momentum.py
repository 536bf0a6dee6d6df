"""Momentum: ``trace``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ftopt.base import GradientTransformation, register_state
from ftopt.domains import NONNEG
from ftopt.rule_transform import rule_transform
from ftopt.rules import Rule, Slot


@register_state
class TraceState(NamedTuple):
    """The momentum buffer."""

    trace: Any


def trace(decay: float | torch.Tensor, nesterov: bool = False) -> GradientTransformation:
    """Momentum: tr ← u + decay·tr; u ← tr (u ← u + decay·tr with nesterov).

    Args:
        decay: the momentum coefficient, >= 0.
        nesterov: use Nesterov momentum (default: False).
    """
    def body(o, x):
        tr = x.u + x.decay * x.trace
        out = x.u + x.decay * tr if nesterov else tr
        return out, {"trace": tr}

    rule = Rule(
        "trace",
        body,
        state_class=TraceState,
        slots=(Slot("trace"),),
        hparams={"decay": decay},
        domains={"decay": NONNEG},  # torch.optim.SGD's rule for momentum
    )
    return rule_transform(rule)
