"""Prodigy (optax.contrib.prodigy): AdamW whose learning rate is a running estimate d of
the distance to the solution, adapted from two global reductions.

Per step, with E the estimate (``estim_lr``), E0 its initial value, t the step after
increment, bc = √(1 − b2ᵗ)/(1 − b1ᵗ) and dlr = E·lr(count)·bc::

    dg = E·g;  m ← b1·m + (1−b1)·dg;  v ← b2·v + (1−b2)·dg²
    s ← b3·s + (dlr·dg)/E0            (safeguard_warmup: (E·dg)/E0)
    num ← b3·num + (E/E0)·dlr·Σ g·(x0 − p)       (a global dot product)
    E ← max(E, coef·num/Σ|s|)                    (a global L1 norm of the new s)
                                                 (kept where Σ|s| = 0: optax's 0/0
                                                  gives NaN, the PyTorch reference skips)
    u ← −dlr·m/(√v + E·eps) − wd·dlr·p           (the new E; wd where the mask holds)

How it runs: one elementwise rule (:func:`prodigy_rule`). Σ g·(x0 − p) and Σ|s| are global
sums (``o.global_sum``): on the fused backend a reduction pass over all leaves, then the main
kernel, which computes num and the new E from them and stores both (0-d tensors of the state
on the params' device: no host read, launches per step independent of the number of leaves);
on the eager backend torch sums. 1 − b1, 1 − b2, 1/E0 and the bias correction are per-step
scalars computed in float64 on the host. E and num are fp32 (float64 for fp64 params). The
two backends sum in different orders: each step both are within fp32 rounding of float64,
but num is a dot product that may cancel, and E feeds back into s and num (as E²), so over
many steps fused and eager agree as two fp32 runs of the recurrence do (SPEC §6's relative
1e-6 from the same inputs; tests/test_prodigy_fused.py).

``weight_decay_mask`` needs a per-leaf value, which a rule has not: with a mask the
transform runs as one stage of torch ops (:mod:`ftopt.transforms.prodigy_stage`),
batched over the leaves of one dtype and device (each line above one ``torch._foreach_*``
call), then the fused ``p + u``; same state, same math.

``skip_zeros`` (SPEC §3): where the raw gradient is zero, m, v and s keep their bits and
the update is ``-0.0``; Σ|s| is the norm of the state as kept (a skipped element adds its
old |s|), the dot product gets nothing from it (g = 0); E, num and the count advance.

State storage (``quantize_states``, an alias' ``state_bits=8`` or ``state_dtype``): m, v
and s are stored as every rule's slots are (SPEC §5: 8-bit blockwise codes for leaves of at
least ``min_size`` elements, v with the unsigned map; or bf16/fp16): a step reads them in
the compute dtype, runs the math above (Σ|s| over the new s before it is stored) and stores
each once; with ``skip_zeros`` a block whose gradients are all zero keeps its bytes.
``params0``, a copy of the params, stays in their compute dtype (a rounded copy would bias
Σ g·(x0 − p)), as MADGRAD's x0 does. The body returns it as it was: a donated fused step
reads it in the reduction pass only and never writes it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ftopt.base import GradientTransformation, register_state
from ftopt.domains import NONNEG, POSITIVE, UNIT_OPEN, check_hparam
from ftopt.rule_transform import rule_transform
from ftopt.rules import Rule, Slot
from ftopt.schedules import ScalarOrSchedule
from ftopt.transforms.prodigy_stage import ScaleByProdigy

__all__ = ["ProdigyState", "scale_by_prodigy"]

Float = float | torch.Tensor


@register_state
class ProdigyState(NamedTuple):
    """optax's ``ProdigyState``: per element ``exp_avg`` (m), ``exp_avg_sq`` (v),
    ``grad_sum`` (s) and ``params0`` (x0, a copy of the params at ``init``); 0-d
    ``estim_lr`` (E) and ``numerator_weighted`` (num), fp32 (fp64 for fp64 params);
    ``count`` (0-d int32)."""

    exp_avg: Any
    exp_avg_sq: Any
    grad_sum: Any
    params0: Any
    estim_lr: torch.Tensor
    numerator_weighted: torch.Tensor
    count: torch.Tensor


def _bias_scalars(t, h) -> dict:
    """``lr_bc`` = lr·√(1 − b2ᵗ)/(1 − b1ᵗ), in float64 (a device tensor where the count is
    or a beta is a tensor), ``one_minus_b1``, ``one_minus_b2`` and ``inv_estim_lr0`` = 1/E0."""
    if isinstance(t, torch.Tensor) or any(isinstance(h[k], torch.Tensor)
                                          for k in ("b1", "b2")):
        b1, b2 = (torch.as_tensor(h[k], dtype=torch.float64) for k in ("b1", "b2"))
        bc = torch.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    else:
        bc = math.sqrt(1 - h["b2"] ** t) / (1 - h["b1"] ** t)
    # 1 − b1, 1 − b2 and 1/E0 in float64 here, not in the kernel from fp32 b1, b2 and E0:
    # 1 − fp32(0.999) is 1.3e-5 off (√v 6e-6), 1/fp32(1e-3) rounds to 999.99994 (a bias s
    # and num would carry every step).
    return {"lr_bc": h["learning_rate"] * bc, "one_minus_b1": 1 - h["b1"],
            "one_minus_b2": 1 - h["b2"], "inv_estim_lr0": 1.0 / h["estim_lr0"]}


def _carry(t, h, old) -> tuple[dict, dict]:
    """The old estimate and numerator, read by the body, which computes the new ones."""
    return {"estim_lr": old["estim_lr"], "numerator_weighted": old["numerator_weighted"]}, {}


def _body(safeguard: bool):
    def body(o, x):
        est = x.estim_lr
        dlr = est * x.lr_bc
        dg = est * x.u
        m = x.b1 * x.exp_avg + x.one_minus_b1 * dg
        v = x.b2 * x.exp_avg_sq + x.one_minus_b2 * (dg * dg)
        s = x.b3 * x.grad_sum + (dg * (est if safeguard else dlr)) * x.inv_estim_lr0
        # Σ|s| over the state as kept: a skipped element adds its old |s|.
        kept = s if x.skip is None else o.where(x.skip, x.grad_sum, s)
        dot = o.global_sum(x.u * (x.params0 - x.p))
        l1 = o.global_sum(o.abs(kept))
        num = x.b3 * x.numerator_weighted + (est * x.inv_estim_lr0) * dlr * dot
        # Σ|s| = 0 (no gradient yet: all zero, or no elements) keeps the estimate, where
        # optax's 0/0 would make it NaN (the PyTorch reference skips such a step).
        new_est = o.where(l1 > 0, o.maximum(est, x.estim_lr_coef * num / l1), est)
        u = (dlr * -1.0) * m / (o.sqrt(v) + new_est * x.eps) - x.weight_decay * dlr * x.p
        return u, {"exp_avg": m, "exp_avg_sq": v, "grad_sum": s, "params0": x.params0,
                   "estim_lr": new_est, "numerator_weighted": num}
    return body


def prodigy_rule(learning_rate, b1, b2, b3, eps, estim_lr0: float, estim_lr_coef,
                 weight_decay, safeguard_warmup: bool) -> Rule:
    """Prodigy as one elementwise rule (the module docstring's math): Σ g·(x0 − p) and
    Σ|s| are global sums (``o.global_sum``: the fused reduction pass), E and num running
    scalars the body computes from them (the fused main kernel stores them)."""
    return Rule(
        "scale_by_prodigy", _body(bool(safeguard_warmup)), state_class=ProdigyState,
        slots=(Slot("exp_avg"), Slot("exp_avg_sq", signed=False), Slot("grad_sum"),
               Slot("params0", from_params=True)),
        hparams={"learning_rate": learning_rate, "b1": b1, "b2": b2, "b3": b3, "eps": eps,
                 "estim_lr0": float(estim_lr0), "estim_lr_coef": estim_lr_coef,
                 "weight_decay": weight_decay},
        scalars=_bias_scalars, counted=True, uses_params=True,
        running={"estim_lr": "estim_lr0", "numerator_weighted": 0.0}, advance=_carry)


def scale_by_prodigy(
    learning_rate: ScalarOrSchedule = 1.0,
    betas: tuple[Float, Float] = (0.9, 0.999),
    beta3: Float | None = None,
    eps: Float = 1e-8,
    estim_lr0: float = 1e-6,
    estim_lr_coef: Float = 1.0,
    weight_decay: Float = 0.0,
    safeguard_warmup: bool = False,
    weight_decay_mask: Any | Callable[[Any], Any] | None = None,
) -> GradientTransformation:
    """Prodigy's update (optax.contrib.prodigy's ``update``, the math in the module
    docstring): the updates to add to the params, learning rate and decay included.

    Args:
        learning_rate: a schedule-like multiplier of the estimate (default: 1.0), a float,
            0-d tensor or schedule of the step count.
        betas: (b1, b2) of the underlying AdamW, each in [0, 1) (default: (0.9, 0.999)).
        beta3: decay of s and num, in [0, 1) (default: √b2).
        eps: added to √v, scaled by the estimate, >= 0 (default: 1e-8).
        estim_lr0: the initial estimate, > 0 (default: 1e-6).
        estim_lr_coef: the estimates are multiplied by it, >= 0 (default: 1.0).
        weight_decay: AdamW's decay wd, >= 0, applied as −wd·dlr·p (default: 0.0).
        safeguard_warmup: s accumulates E·dg in place of dlr·dg (default: False).
        weight_decay_mask: a tree of bools like the params (or a function of the params
            returning one): the decay applies where it holds (default: every leaf). With
            a mask the transform runs as a stage of torch ops, not as the fused rule.
    """
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"prodigy: betas must be a pair (b1, b2), got {betas!r}")
    b1, b2 = betas
    if beta3 is None:
        beta3 = b2 ** 0.5
    if isinstance(estim_lr0, bool) or not isinstance(estim_lr0, (int, float)):
        raise TypeError(f"prodigy: estim_lr0 must be a float > 0, got {estim_lr0!r}")
    for name, value, domain in (("b1", b1, UNIT_OPEN), ("b2", b2, UNIT_OPEN),
                                ("beta3", beta3, UNIT_OPEN), ("eps", eps, NONNEG),
                                ("estim_lr0", estim_lr0, POSITIVE),
                                ("estim_lr_coef", estim_lr_coef, NONNEG),
                                ("weight_decay", weight_decay, NONNEG)):
        check_hparam("prodigy", name, value, domain)
    if not callable(learning_rate):
        check_hparam("prodigy", "learning_rate", learning_rate, NONNEG)
    if weight_decay_mask is None:
        return rule_transform(prodigy_rule(learning_rate, b1, b2, beta3, eps, float(estim_lr0),
                                           estim_lr_coef, weight_decay,
                                           bool(safeguard_warmup)))
    stage = ScaleByProdigy(learning_rate, b1, b2, beta3, eps, float(estim_lr0),
                           estim_lr_coef, weight_decay, bool(safeguard_warmup),
                           weight_decay_mask, ProdigyState)
    return GradientTransformation(stage.init, stage.update)
