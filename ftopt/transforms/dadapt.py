"""D-Adaptation AdamW (Defazio & Mishchenko 2023, optax.contrib's ``dadapt_adamw``):
AdamW whose step is d·lr, d a running lower bound of the distance to the solution.

With t the step count (after increment), β = √b2, the estimate E (d) and its numerator
num (0-d running scalars), dlr = E·lr(t−1)·√(1 − b2ᵗ)/(1 − b1ᵗ):

    A   = Σ g · s/(√v + eps)                        (old s and v; a global sum)
    m  ← b1·m + (1 − b1)·dlr·g;   v ← b2·v + (1 − b2)·g²;   s ← β·s + (1 − β)·dlr·g
    num ← β·num + (1 − β)·dlr·A;  E ← max(E, num/((1 − β)·Σ|s|))
    u   = −wd·dlr·p − m/(√v + eps)

One elementwise rule: the two global sums are the fused reduction pass, E and num are
computed by the body and stored by the main kernel (no host read). Where Σ|s| = 0 (no
gradient yet), E is kept (optax's 0/0 would make it NaN). ``skip_zeros`` (SPEC §3): m, v
and s keep their bits where the raw gradient is zero and the update is ``-0.0``; Σ|s| is
taken over s as kept, A gets nothing from a skipped element (g = 0); E, num and the count
advance.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from ftopt.base import GradientTransformation, register_state
from ftopt.domains import NONNEG, POSITIVE, UNIT_OPEN, check_hparam
from ftopt.rule_transform import rule_transform
from ftopt.rules import Rule, Slot
from ftopt.schedules import ScalarOrSchedule

__all__ = ["DAdaptAdamWState", "dadapt_adamw"]

Float = float | torch.Tensor


@register_state
class DAdaptAdamWState(NamedTuple):
    """optax.contrib's ``DAdaptAdamWState``: per element ``exp_avg`` (m), ``exp_avg_sq``
    (v) and ``grad_sum`` (s); 0-d ``estim_lr`` (E) and ``numerator_weighted`` (num), fp32
    (fp64 for fp64 params); ``count`` (0-d int32)."""

    exp_avg: Any
    exp_avg_sq: Any
    grad_sum: Any
    estim_lr: torch.Tensor
    numerator_weighted: torch.Tensor
    count: torch.Tensor


def _scalars(t, h) -> dict:
    """``lr_bc`` = lr·√(1 − b2ᵗ)/(1 − b1ᵗ) and the betas' complements, in float64."""
    if isinstance(t, torch.Tensor) or any(isinstance(h[k], torch.Tensor) for k in ("b1", "b2")):
        b1, b2 = (torch.as_tensor(h[k], dtype=torch.float64) for k in ("b1", "b2"))
        bc = torch.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        sb2 = torch.sqrt(b2)
    else:
        bc = math.sqrt(1 - h["b2"] ** t) / (1 - h["b1"] ** t)
        sb2 = math.sqrt(h["b2"])
    return {"lr_bc": h["learning_rate"] * bc, "one_minus_b1": 1 - h["b1"],
            "one_minus_b2": 1 - h["b2"], "sb2": sb2, "one_minus_sb2": 1 - sb2}


def _carry(t, h, old) -> tuple[dict, dict]:
    """The old estimate and numerator, read by the body, which computes the new ones."""
    return {"estim_lr": old["estim_lr"], "numerator_weighted": old["numerator_weighted"]}, {}


def _body(o, x):
    dlr = x.estim_lr * x.lr_bc
    acc = o.global_sum(x.u * (x.grad_sum / (o.sqrt(x.exp_avg_sq) + x.eps)))
    m = x.b1 * x.exp_avg + x.one_minus_b1 * dlr * x.u
    v = x.b2 * x.exp_avg_sq + x.one_minus_b2 * (x.u * x.u)
    s = x.sb2 * x.grad_sum + x.one_minus_sb2 * dlr * x.u
    kept = s if x.skip is None else o.where(x.skip, x.grad_sum, s)  # Σ|s| as kept
    l1 = o.global_sum(o.abs(kept))
    num = x.sb2 * x.numerator_weighted + x.one_minus_sb2 * dlr * acc
    est = o.where(l1 > 0, o.maximum(x.estim_lr, num / (x.one_minus_sb2 * l1)), x.estim_lr)
    u = (x.weight_decay * dlr * -1.0) * x.p - m / (o.sqrt(v) + x.eps)
    return u, {"exp_avg": m, "exp_avg_sq": v, "grad_sum": s, "estim_lr": est,
               "numerator_weighted": num}


def dadapt_adamw(
    learning_rate: ScalarOrSchedule = 1.0,
    betas: tuple[Float, Float] = (0.9, 0.999),
    eps: Float = 1e-8,
    estim_lr0: float = 1e-6,
    weight_decay: Float = 0.0,
) -> GradientTransformation:
    """D-Adaptation AdamW (optax.contrib's ``dadapt_adamw``, same arguments and
    defaults; the math in :mod:`ftopt.transforms.dadapt`): the updates to add to the
    params, learning rate and decay included.

    Args:
        learning_rate: a schedule-like multiplier of the estimate (default: 1.0).
        betas: (b1, b2), each in [0, 1) (default: (0.9, 0.999)).
        eps: added to √v, >= 0 (default: 1e-8).
        estim_lr0: the initial estimate, > 0 (default: 1e-6).
        weight_decay: AdamW's decay, >= 0, applied as −wd·dlr·p (default: 0.0).
    """
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"dadapt_adamw: betas must be a pair (b1, b2), got {betas!r}")
    b1, b2 = betas
    if isinstance(estim_lr0, bool) or not isinstance(estim_lr0, (int, float)):
        raise TypeError(f"dadapt_adamw: estim_lr0 must be a float > 0, got {estim_lr0!r}")
    for name, value, domain in (("b1", b1, UNIT_OPEN), ("b2", b2, UNIT_OPEN),
                                ("eps", eps, NONNEG), ("estim_lr0", estim_lr0, POSITIVE),
                                ("weight_decay", weight_decay, NONNEG)):
        check_hparam("dadapt_adamw", name, value, domain)
    if not callable(learning_rate):
        check_hparam("dadapt_adamw", "learning_rate", learning_rate, NONNEG)
    rule = Rule(
        "dadapt_adamw", _body, state_class=DAdaptAdamWState,
        slots=(Slot("exp_avg"), Slot("exp_avg_sq", signed=False), Slot("grad_sum")),
        hparams={"learning_rate": learning_rate, "b1": b1, "b2": b2, "eps": eps,
                 "estim_lr0": float(estim_lr0), "weight_decay": weight_decay},
        scalars=_scalars, counted=True, uses_params=True,
        running={"estim_lr": "estim_lr0", "numerator_weighted": 0.0}, advance=_carry)
    return rule_transform(rule)
