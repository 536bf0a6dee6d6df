"""Momentum, averages and accumulation: ``trace``, ``ema``, ``scale_by_optimistic_gradient``,
``apply_every``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ftopt.base import GradientTransformation, register_state
from ftopt.domains import NONNEG, UNIT, UNIT_OPEN, check_int
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


def decay_scalars(bias_correction: bool):
    """The per-step scalars of a running average with hyperparameter ``decay``:
    ``one_minus_decay`` and, with ``bias_correction``, ``bc`` = 1 − decayᵗ."""

    def scalars(t, h):
        out = {"one_minus_decay": 1 - h["decay"]}
        if bias_correction:
            out["bc"] = 1 - h["decay"] ** t
        return out

    return scalars


@register_state
class EmaState(NamedTuple):
    """The step count and the exponential moving average (optax's layout)."""

    count: torch.Tensor
    ema: Any


def ema(decay: float | torch.Tensor, debias: bool = True) -> GradientTransformation:
    """An exponential moving average of the updates, as optax.

    ema ← decay·ema + (1−decay)·u; u ← ema/(1−decayᵗ), or u ← ema with ``debias=False``.
    (:func:`trace` accumulates instead: tr ← u + decay·tr.)

    Args:
        decay: the decay of the average, in [0, 1]; with ``debias``, in [0, 1) (the
            correction divides by 1 − decayᵗ).
        debias: divide by 1 − decayᵗ (default: True).
    """

    def body(o, x):
        average = o.lerp(x.ema, x.u, x.one_minus_decay)  # decay·ema + (1−decay)·u
        return (average / x.bc if debias else average), {"ema": average}

    rule = Rule(
        "ema",
        body,
        state_class=EmaState,
        slots=(Slot("ema"),),
        hparams={"decay": decay},
        domains={"decay": UNIT_OPEN if debias else UNIT},
        scalars=decay_scalars(debias),
        counted=True,
    )
    return rule_transform(rule)


@register_state
class ScaleByOptimisticGradientState(NamedTuple):
    """The step count (optax keeps a flag ``is_initial_step``) and the previous update."""

    count: torch.Tensor
    previous_gradient: Any


def _optimistic_body(o, x):
    # On the first step there is no previous gradient: optax uses the current one.
    previous = o.where(x.first > 0.5, x.u, x.previous_gradient)
    return x.alpha_plus_beta * x.u - x.beta * previous, {"previous_gradient": x.u}


def _optimistic_scalars(t, h):
    first = t <= 1
    if isinstance(first, torch.Tensor):
        first = first.to(torch.float64)
    return {"first": float(first) if isinstance(first, bool) else first,
            "alpha_plus_beta": h["alpha"] + h["beta"]}


def scale_by_optimistic_gradient(
    alpha: float | torch.Tensor = 1.0, beta: float | torch.Tensor = 1.0
) -> GradientTransformation:
    """Generalized optimistic gradient, as optax: u ← (alpha + beta)·u − beta·u_prev,
    where u_prev is the previous step's incoming update (the current one on the first
    step, so the first update is alpha·u).

    The state holds a step count where optax holds a boolean ``is_initial_step``.

    Args:
        alpha: the weight of the current update, any finite value (default: 1.0).
        beta: the weight of the negative momentum, any finite value (default: 1.0).
    """
    rule = Rule(
        "scale_by_optimistic_gradient",
        _optimistic_body,
        state_class=ScaleByOptimisticGradientState,
        slots=(Slot("previous_gradient"),),
        hparams={"alpha": alpha, "beta": beta},
        scalars=_optimistic_scalars,
        counted=True,
    )
    return rule_transform(rule)


@register_state
class ApplyEveryState(NamedTuple):
    """The step count and the updates accumulated since the last emitted step."""

    count: torch.Tensor
    grad_acc: Any


def _every_body(o, x):
    acc = x.keep * x.grad_acc + x.u
    return x.emit * acc, {"grad_acc": acc}


def _every_scalars(k: int):
    def scalars(t, h):  # t = count + 1; c = count mod k: keep the sum unless c = 0, emit at k - 1
        c = (t - 1) % k
        if isinstance(c, torch.Tensor):
            return {"keep": c.clamp(max=1.0), "emit": (c - (k - 2)).clamp(0.0, 1.0)}
        return {"keep": float(min(c, 1)), "emit": float(min(max(c - (k - 2), 0), 1))}

    return scalars


def apply_every(k: int = 1) -> GradientTransformation:
    """Accumulates updates and emits their sum every ``k`` steps, as optax: with
    ``c = count mod k``, acc ← u + (c ≠ 0)·acc; u ← (c = k − 1)·acc (zero on the others).

    The other transforms of a chain still step on every call (``MultiSteps`` steps them
    once per ``k`` calls instead). ``ApplyEveryState.count`` counts every call (optax
    keeps it modulo ``k``).

    Args:
        k: an int >= 1.
    """
    k = check_int("apply_every", "k", k, minimum=1)
    rule = Rule("apply_every", _every_body, state_class=ApplyEveryState,
                slots=(Slot("grad_acc"),), scalars=_every_scalars(k), counted=True)
    return rule_transform(rule)
