"""skip_zeros (SPEC §3) for every alias of the test registry (``tests/registry.py``; each
needs a :class:`Case` below) and bitsandbytes-table chain, 32-bit and 8-bit (§5).

Each test warms a chain up with dense random grads (the skip-aware and the plain chain must
agree bit for bit while no grad is zero), then takes one step whose grad has exact zeros
(+0.0 and -0.0; scattered elements, whole rows, whole 256-element blocks, the partial last
block of a leaf) and, where the chain's norms allow it, a NaN. From the same state it runs

* the chain with skip_zeros (asked for in one of three ways: ``skip_zeros=True`` on the
  alias, ``chain(..., ftopt.skip_zeros())``, ``ftopt.skip_zeros(tx)``),
* the same chain without skip_zeros (the control),
* an oracle of §3 built from the chain's parts: each part runs without skip_zeros, then the
  update is zeroed and every per-element state restored at the zero-grad elements before the
  next part (so norm-based parts see the skipped elements as 0).

and checks, bit for bit (integer views, so -0.0 != +0.0):

32-bit: zero-grad params and every per-element state unchanged; step counts advanced; NaN
elements not skipped; the whole result equals the oracle; where no norm follows a part that
makes zero-grad updates non-zero, every non-skipped element equals the plain run; the
control changes what the optimizer's math says it changes at the zero-grad elements.

8-bit: params unchanged at zero-grad elements; a block whose grads are all zero keeps codes
and absmax byte-identical; a skipped element of a partially skipped block moves by at most
one code step of its block's new absmax; the 8-bit result (skip and plain) equals the 32-bit
chain run from the dequantized state, then re-encoded as §5 says; blocks with no zero grad
equal the plain run's bytes; the control changes the bytes of all-zero-grad blocks.

Both entry points run: ``tx.update`` + ``ftopt.apply_updates`` and
``ftopt.step(..., backend="eager")``; params are fp32, bf16 and fp16 (states fp32 or 8-bit).

Smaller tests: ``skip_zeros(t)`` around each registry transform and combinator; the marker
first, in the middle or last of a chain; an all-zero step; ``None`` grad leaves; and the
same §3 checks on ``step(backend="fused")`` (Triton kernels, through the interpreter on CPU).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable

import optree
import pytest
import reference_prodigy as RP
import torch
from registry import (
    BY_NAME,
    SIGNED_STATES,
    TRANSFORMS,
    UNSIGNED_STATES,
    by_trait,
    leaf_state,
    names,
    require,
)

import ftopt
from ftopt.base import EmptyState
from ftopt.combine import Chain, owner
from ftopt.quant import create_dynamic_map, dequantize_blockwise, quantize_blockwise
from ftopt.rules import QuantizedSlot

BLOCK = 256
SHAPES = {
    "w": (64, 80),  # 5120 elements: 8-bit, 20 full blocks
    "v": (40, 103),  # 4120 elements: 8-bit, 16 full blocks + a partial block of 24
    "b": (80,),  # small: fp32 state
    "s": (7, 9),  # small: fp32 state
}
QUANTIZED = ("w", "v")
WARMUP = 3
SIGNED_SLOTS, UNSIGNED_SLOTS = SIGNED_STATES, UNSIGNED_STATES
# Copies of the params: fp32 under state_bits=8 too (the registry's ``wide_states``)
FULL_WIDTH_SLOTS = {n for e in TRANSFORMS for n in e.wide_states}
QMAP = {True: create_dynamic_map(signed=True), False: create_dynamic_map(signed=False)}
NAN_AT = {"w": 2000, "s": 40}  # flat indices; block 7 of "w" has no zero grads


# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """``make(bits)`` builds the plain chain; ``parts()`` its 32-bit parts (the oracle's).

    ``alias``: ``make`` accepts ``skip_zeros=``. ``norm``: None (no norm), "first" (a global
    norm of the raw grads: the plain run still equals the skip run off the zero-grad
    elements), "leaf" or "global" (norms of updates that differ at zero-grad elements).
    ``changes``: what the plain chain changes at zero-grad elements ("params" and state slot
    names); every other per-element value must stay bit-identical even without skip_zeros.
    ``nan_free``: state slots a NaN gradient does not reach (MADGRAD's x0; Rprop's step
    sizes, where a NaN comparison picks a factor, and its sign(NaN) = 0 steps); every other
    slot must be NaN there. ``warm_grads(params, gen)``: warm-up grads where random signs
    would leave much state at 0 (Rprop zeroes its step where the sign flips).
    ``step_grads(params, gen)``: the dense grads the zero-grad step starts from (default:
    dense_grads), for a chain whose norm only sees the skipped elements where the step's
    grads go on as the warm-up's did (Prodigy's estimate grows only then).
    ``reference(params, grads, state, mask)``: for a chain whose norm reads its state as
    kept (Prodigy's Σ|s|, where a skipped element adds its old |s|), which the parts'
    oracle (run, then restore) cannot build: a float64 step with §3 applied from the
    formula, giving (params, state) as the chain's; the 32-bit result must match it within
    rounding (the bit-exact checks at the zero-grad elements stay).
    """

    make: Callable[..., ftopt.GradientTransformation]
    parts: Callable[[], list]
    alias: bool
    norm: str | None
    changes: frozenset
    nan_free: frozenset = frozenset()
    warm_grads: Callable | None = None  # the warm-up grads (default: dense_grads)
    step_grads: Callable | None = None  # the zero-grad step's, before zeros (dense_grads)
    reference: Callable | None = None  # in place of the parts' oracle (see above)
    # state slots the plain chain moves at some zero-grad elements and not at others
    # (COCOB's running maximum L and clipped reward R): neither control holds for them
    may_change: frozenset = frozenset()


def _alias(fn, parts, norm=None, changes=(), nan_free=(), warm_grads=None, step_grads=None,
           reference=None, may_change=()):
    return Case(fn, parts, True, norm, frozenset(changes), frozenset(nan_free), warm_grads,
                step_grads, reference, frozenset(may_change))


def _bnb(parts, norm=None, changes=()):
    return Case(None, parts, False, norm, frozenset(changes))


T = ftopt
WD = 0.05
_SF_LR = ftopt.warmup_constant_schedule(0.0, 0.1, 2)


def _schedule_free_parts(base, learning_rate, b1) -> list:
    """schedule_free's two parts: the base chain and its Schedule-Free stage."""
    return list(ftopt.combine.owner(ftopt.schedule_free(base, learning_rate, b1)).transforms)

_LR_SCHEDULE = ftopt.linear_schedule(2e-2, 1e-2, 10)  # a counted scale_by_learning_rate
_MASK = {"w": True, "v": False, "b": False, "s": True}
CASES = {
    "sgd": _alias(
        lambda **kw: T.sgd(0.1, **kw),
        lambda: [T.scale_by_learning_rate(0.1)],
    ),
    "sgd[momentum]": _alias(
        lambda **kw: T.sgd(0.1, momentum=0.8, **kw),
        lambda: [T.trace(0.8), T.scale_by_learning_rate(0.1)],
        changes={"params", "trace"},
    ),
    "sgd_nesterov": _alias(
        lambda **kw: T.sgd(0.1, momentum=0.8, nesterov=True, **kw),
        lambda: [T.trace(0.8, nesterov=True), T.scale_by_learning_rate(0.1)],
        changes={"params", "trace"},
    ),
    "adam": _alias(
        lambda **kw: T.adam(_LR_SCHEDULE, b1=0.8, b2=0.95, **kw),
        lambda: [T.scale_by_adam(0.8, 0.95), T.scale_by_learning_rate(_LR_SCHEDULE)],
        changes={"params", "mu", "nu"},
    ),
    "adam_nesterov": _alias(
        lambda **kw: T.adam(1e-2, b1=0.8, b2=0.95, nesterov=True, **kw),
        lambda: [T.scale_by_adam(0.8, 0.95, nesterov=True), T.scale_by_learning_rate(1e-2)],
        changes={"params", "mu", "nu"},
    ),
    "adamw": _alias(
        lambda **kw: T.adamw(1e-2, b1=0.8, b2=0.95, weight_decay=WD, **kw),
        lambda: [T.scale_by_adam(0.8, 0.95), T.add_decayed_weights(WD),
                 T.scale_by_learning_rate(1e-2)],
        changes={"params", "mu", "nu"},
    ),
    "lion": _alias(
        lambda **kw: T.lion(1e-2, b1=0.8, b2=0.95, weight_decay=WD, **kw),
        lambda: [T.scale_by_lion(0.8, 0.95), T.add_decayed_weights(WD),
                 T.scale_by_learning_rate(1e-2)],
        changes={"params", "mu"},
    ),
    "rmsprop": _alias(  # u = 0/(...) = 0: only the running mean moves
        lambda **kw: T.rmsprop(1e-2, decay=0.8, eps=1e-3, **kw),
        lambda: [T.scale_by_rms(0.8, 1e-3), T.scale_by_learning_rate(1e-2)],
        changes={"nu"},
    ),
    "rmsprop[centered]": _alias(  # u = 0: only the running means move
        lambda **kw: T.rmsprop(1e-2, decay=0.8, eps=1e-3, centered=True, **kw),
        lambda: [T.scale_by_stddev(0.8, 1e-3), T.scale_by_learning_rate(1e-2)],
        changes={"mu", "nu"},
    ),
    "rmsprop[momentum]": _alias(
        lambda **kw: T.rmsprop(1e-2, decay=0.8, eps=1e-3, momentum=0.7, nesterov=True, **kw),
        lambda: [T.scale_by_rms(0.8, 1e-3), T.scale_by_learning_rate(1e-2),
                 T.trace(0.7, nesterov=True)],
        changes={"params", "nu", "trace"},
    ),
    "adagrad": _alias(  # s + 0² = s and u = 0: skip_zeros changes nothing here
        lambda **kw: T.adagrad(0.1, initial_accumulator_value=0.1, eps=1e-7, **kw),
        lambda: [T.scale_by_rss(0.1, 1e-7), T.scale_by_learning_rate(0.1)],
    ),
    "lamb": _alias(
        lambda **kw: T.lamb(1e-2, b1=0.8, b2=0.95, weight_decay=WD, **kw),
        lambda: [T.scale_by_adam(0.8, 0.95, 1e-6), T.add_decayed_weights(WD),
                 T.scale_by_trust_ratio(), T.scale_by_learning_rate(1e-2)],
        norm="leaf",
        changes={"params", "mu", "nu"},
    ),
    "lars": _alias(
        lambda **kw: T.lars(5.0, weight_decay=WD, trust_coefficient=0.01, momentum=0.8, **kw),
        lambda: [T.add_decayed_weights(WD), T.scale_by_trust_ratio(trust_coefficient=0.01),
                 T.scale_by_learning_rate(5.0), T.trace(0.8)],
        norm="leaf",
        changes={"params", "trace"},
    ),
    "ademamix": _alias(
        lambda **kw: T.ademamix(1e-2, b1=0.8, b2=0.95, b3=0.99, alpha=3.0, weight_decay=WD, **kw),
        lambda: [T.scale_by_ademamix(0.8, 0.95, 0.99, 3.0), T.add_decayed_weights(WD),
                 T.scale_by_learning_rate(1e-2)],
        changes={"params", "m1", "m2", "nu"},
    ),
    "lars[masked]": _alias(  # masked(): decay and trust ratio on some leaves only
        lambda **kw: T.lars(5.0, weight_decay=WD, weight_decay_mask=_MASK,
                            trust_coefficient=0.01, trust_ratio_mask=_MASK, momentum=0.8, **kw),
        lambda: [T.add_decayed_weights(WD, mask=_MASK),
                 T.masked(T.scale_by_trust_ratio(trust_coefficient=0.01), _MASK),
                 T.scale_by_learning_rate(5.0), T.trace(0.8)],
        norm="leaf",
        changes={"params", "trace"},
    ),
    # ---- ftopt.alias_variants
    "adamax": _alias(
        lambda **kw: T.adamax(1e-2, b1=0.8, b2=0.95, **kw),
        lambda: [T.scale_by_adamax(0.8, 0.95), T.scale_by_learning_rate(1e-2)],
        changes={"params", "mu", "nu"},
    ),
    "adamaxw": _alias(
        lambda **kw: T.adamaxw(1e-2, b1=0.8, b2=0.95, weight_decay=WD, **kw),
        lambda: [T.scale_by_adamax(0.8, 0.95), T.add_decayed_weights(WD),
                 T.scale_by_learning_rate(1e-2)],
        changes={"params", "mu", "nu"},
    ),
    "amsgrad": _alias(  # nu/(1−b2ᵗ) shrinks at a zero grad: the maximum stays
        lambda **kw: T.amsgrad(1e-2, b1=0.8, b2=0.95, **kw),
        lambda: [T.scale_by_amsgrad(0.8, 0.95), T.scale_by_learning_rate(1e-2)],
        changes={"params", "mu", "nu"},
    ),
    "nadam": _alias(
        lambda **kw: T.nadam(1e-2, b1=0.8, b2=0.95, **kw),
        lambda: [T.scale_by_adam(0.8, 0.95, nesterov=True), T.scale_by_learning_rate(1e-2)],
        changes={"params", "mu", "nu"},
    ),
    "nadamw": _alias(
        lambda **kw: T.nadamw(1e-2, b1=0.8, b2=0.95, weight_decay=WD, **kw),
        lambda: [T.scale_by_adam(0.8, 0.95, nesterov=True), T.add_decayed_weights(WD),
                 T.scale_by_learning_rate(1e-2)],
        changes={"params", "mu", "nu"},
    ),
    "radam": _alias(  # the zero-grad step (t = 4, ro < 4) is the momentum branch
        lambda **kw: T.radam(1e-2, b1=0.8, b2=0.95, **kw),
        lambda: [T.scale_by_radam(0.8, 0.95), T.scale_by_learning_rate(1e-2)],
        changes={"params", "mu", "nu"},
    ),
    # (zero-gradient elements move by the decay alone, lr·WD·p: seen in 16 bits at lr 0.5)
    "acprop": _alias(
        lambda **kw: T.acprop(0.5, b1=0.8, b2=0.95, eps=1e-6, weight_decay=WD, **kw),
        lambda: [T.scale_by_acprop(0.8, 0.95, 1e-6), T.add_decayed_weights(WD),
                 T.scale_by_learning_rate(0.5)],
        changes={"params", "mu", "nu"},
    ),
    "adabelief": _alias(
        lambda **kw: T.adabelief(1e-2, b1=0.8, b2=0.95, eps=1e-6, weight_decay=WD, **kw),
        lambda: [T.scale_by_belief(0.8, 0.95, 1e-6), T.add_decayed_weights(WD),
                 T.scale_by_learning_rate(1e-2)],
        changes={"params", "mu", "nu"},
    ),
    "yogi": _alias(  # nu − (1−b2)·sign(nu)·0 = nu: only mu moves
        lambda **kw: T.yogi(1e-2, b1=0.8, b2=0.95, **kw),
        lambda: [T.scale_by_yogi(0.8, 0.95, 1e-3), T.scale_by_learning_rate(1e-2)],
        changes={"params", "mu"},
    ),
    # (c = 0 + k·(0 − g_prev): a zero gradient still moves the moments, and last_grad)
    "mars": _alias(
        lambda **kw: T.mars(1e-2, b1=0.8, b2=0.95, gamma=0.2, weight_decay=WD, **kw),
        lambda: [T.scale_by_mars(0.8, 0.95, 1e-8, 0.2), T.add_decayed_weights(WD),
                 T.scale_by_learning_rate(1e-2)],
        norm="global",
        changes={"params", "last_grad", "mu", "nu"},
    ),
    # (nu ← b2·nu + (1−b2)·sign(−nu)·0 = b2·nu: both moments decay; the params by the
    # decay alone, lr·WD·p: seen in 16 bits at lr 0.5)
    "ano": _alias(
        lambda **kw: T.ano(0.5, b1=0.8, b2=0.95, weight_decay=WD, **kw),
        lambda: [T.scale_by_ano(0.8, 0.95), T.add_decayed_weights(WD),
                 T.scale_by_learning_rate(0.5)],
        changes={"params", "mu", "nu"},
    ),
    "adadelta": _alias(
        lambda **kw: T.adadelta(1.0, rho=0.8, eps=1e-4, weight_decay=WD, **kw),
        lambda: [T.add_decayed_weights(WD), T.scale_by_adadelta(0.8, 1e-4),
                 T.scale_by_learning_rate(1.0)],
        changes={"params", "e_g", "e_x"},
    ),
    "sign_sgd": _alias(  # sign(0) = 0: skip_zeros changes nothing here
        lambda **kw: T.sign_sgd(1e-2, **kw),
        lambda: [T.scale_by_sign(), T.scale_by_learning_rate(1e-2)],
    ),
    "signum": _alias(
        lambda **kw: T.signum(1e-2, beta=0.8, **kw),
        lambda: [T.ema(0.8, debias=False), T.scale_by_sign(), T.scale_by_learning_rate(1e-2)],
        changes={"params", "ema"},
    ),
    "optimistic_adam": _alias(
        lambda **kw: T.optimistic_adam(1e-2, 0.4, b1=0.8, b2=0.95, **kw),
        lambda: [T.scale_by_adam(0.8, 0.95, nesterov=True),
                 T.scale_by_optimistic_gradient(1e-2, 0.4), T.scale_by_learning_rate(1.0)],
        changes={"params", "mu", "nu", "previous_gradient"},
    ),
    "optimistic_adam_v2": _alias(
        lambda **kw: T.optimistic_adam_v2(1e-2, alpha=0.7, beta=0.4, b1=0.8, b2=0.95, **kw),
        lambda: [T.scale_by_adam(0.8, 0.95, nesterov=True),
                 T.scale_by_optimistic_gradient(0.7, 0.4), T.scale_by_learning_rate(1e-2)],
        changes={"params", "mu", "nu", "previous_gradient"},
    ),
    "optimistic_gradient_descent": _alias(  # the previous gradient becomes 0
        lambda **kw: T.optimistic_gradient_descent(1e-2, alpha=0.7, beta=0.4, **kw),
        lambda: [T.scale_by_optimistic_gradient(0.7, 0.4), T.scale_by_learning_rate(1e-2)],
        changes={"params", "previous_gradient"},
    ),
    "adopt": _alias(
        lambda **kw: T.adopt(1e-2, b1=0.8, b2=0.95, **kw),
        lambda: [T.scale_by_adopt(0.8, 0.95), T.scale_by_learning_rate(1e-2)],
        changes={"params", "mu", "nu"},
    ),
    "simplified_ademamix": _alias(
        lambda **kw: T.simplified_ademamix(1e-3, b1=0.9, b2=0.95, alpha=2.0, weight_decay=WD,
                                           **kw),
        lambda: [T.scale_by_simplified_ademamix(0.9, 0.95, 2.0), T.add_decayed_weights(WD),
                 T.scale_by_learning_rate(1e-3)],
        changes={"params", "m", "n"},
    ),
    # ---- ftopt.alias_more
    "adan": _alias(
        lambda **kw: T.adan(1e-2, b1=0.8, b2=0.9, b3=0.95, weight_decay=WD, **kw),
        lambda: [T.scale_by_adan(0.8, 0.9, 0.95, eps_root=1e-8), T.add_decayed_weights(WD),
                 T.scale_by_learning_rate(1e-2)],
        changes={"params", "m", "v", "n", "g"},
    ),
    # p is p0 + C/(...)·(L + R), a function of the state: where the gradient is 0 only the
    # decay's small u = lr·wd·p moves the state (C and G unless it rounds away, L and R
    # now and then) and so p
    "cocob": _alias(
        lambda **kw: T.cocob(0.5, alpha=20.0, eps=1e-3, weight_decay=WD, **kw),
        lambda: [T.add_decayed_weights(WD), T.scale_by_learning_rate(0.5, flip_sign=False),
                 T.scale_by_cocob(20.0, 1e-3)],
        changes={"params"}, nan_free={"init_particles"},
        may_change={"scale", "reward", "cumulative_gradients", "subgradients"},
    ),
    "madgrad": _alias(  # p moves towards z even where the gradient (and so G, s) is 0
        lambda **kw: T.madgrad(1e-2, momentum=0.8, **kw),
        lambda: [T.add_decayed_weights(0.0), T.scale_by_madgrad(1e-2, 0.8)],
        changes={"params"}, nan_free={"x0"},
    ),
    # Norms of the raw gradient only (a zero element counts 0 either way): the plain run
    # equals the skip run off the zero-grad elements; NovoGrad's per-leaf nu is not a slot.
    "novograd": _alias(
        lambda **kw: T.novograd(1e-2, b1=0.8, b2=0.5, weight_decay=WD, **kw),
        lambda: [T.scale_by_novograd(0.8, 0.5, 1e-6, 0.0, WD), T.scale_by_learning_rate(1e-2)],
        changes={"params", "mu"},
    ),
    "fromage": _alias(  # the shrink by m = 0.98 moves the params (in 16 bits too)
        lambda **kw: T.fromage(0.2, **kw),
        lambda: [T.scale_by_trust_ratio(1e-6), ftopt.transforms.fromage.fromage_step(0.2)],
        changes={"params"},
    ),
    "rprop": _alias(  # a zero gradient: the step size stays, the last step is applied
        lambda **kw: T.rprop(1e-2, **kw),
        lambda: [T.scale_by_rprop(1e-2), T.scale(-1.0)],
        changes={"params", "prev_updates"}, nan_free={"step_sizes", "prev_updates"},
        warm_grads=lambda params, gen: steady_sign_grads(params, gen),
    ),
    # ---- Schedule-Free: the base chain, then the Schedule-Free stage (y moves towards x and
    # z even where the gradient is 0; the decay moves z there)
    "schedule_free_sgd": _alias(
        lambda **kw: T.schedule_free_sgd(0.1, warmup_steps=2, b1=0.8, weight_decay=WD, **kw),
        lambda: _schedule_free_parts(
            T.chain(T.add_decayed_weights(WD), T.scale_by_learning_rate(_SF_LR)), _SF_LR, 0.8),
        changes={"params", "z"},
    ),
    "schedule_free_adamw": _alias(
        # (no decay: z then stays where the gradient is 0; the SGD case decays z there, a
        # decay moving z at the ±0.0 params of "s" only by -0.0)
        lambda **kw: T.schedule_free_adamw(5e-2, b2=0.95, **kw),
        lambda: _schedule_free_parts(
            T.chain(T.scale_by_adam(0.0, 0.95), T.add_decayed_weights(0.0),
                    T.scale_by_learning_rate(5e-2)), 5e-2, 0.9),
        changes={"params", "mu", "nu"},
    ),
    # ---- scheduled and cautious weight decay (u = Adam's momentum at a zero gradient: the
    # cautious decay acts where its sign is p's, about half the elements)
    "adam_cautious_decay": _bnb(
        lambda: [T.scale_by_adam(0.8, 0.95),
                 T.add_cautious_weight_decay(ftopt.linear_schedule(0.5, 0.1, 3)),
                 T.scale_by_learning_rate(1e-2)],
        changes={"params", "mu", "nu"},
    ),
    "sgd_scheduled_decay": _bnb(
        lambda: [T.add_decayed_weights(ftopt.cosine_decay_schedule(WD, 4)), T.trace(0.8),
                 T.scale_by_learning_rate(0.1)],
        changes={"params", "trace"},
    ),
    # ---- the bitsandbytes table of SPEC §4
    "bnb_sgd": _bnb(
        lambda: [T.add_decayed_weights(WD), T.trace(0.8), T.scale_by_learning_rate(0.1)],
        changes={"params", "trace"},
    ),
    "bnb_rmsprop": _bnb(
        lambda: [T.add_decayed_weights(WD), T.scale_by_rms(0.8, 1e-3, eps_in_sqrt=False),
                 T.scale_by_learning_rate(1e-2)],
        changes={"params", "nu"},
    ),
    "bnb_adagrad": _bnb(
        lambda: [T.add_decayed_weights(WD), T.scale_by_rss(0.0, 1e-7, eps_in_sqrt=False),
                 T.scale_by_learning_rate(0.1)],
        changes={"params", "sum_of_squares"},
    ),
    "bnb_lamb": _bnb(
        lambda: [T.scale_by_adam(0.8, 0.95, 1e-6), T.clip_by_param_norm_ratio(0.02),
                 T.add_decayed_weights(WD), T.scale_by_learning_rate(1.0)],
        norm="leaf",
        changes={"params", "mu", "nu"},
    ),
    "bnb_lars": _bnb(
        lambda: [T.add_decayed_weights(WD), T.trace(0.8), T.clip_by_param_norm_ratio(0.02),
                 T.scale_by_learning_rate(1.0)],
        norm="leaf",
        changes={"params", "trace"},
    ),
    # ---- clip_by_global_norm: of the raw grads, and of updates that include weight decay
    "clip_then_adamw": _bnb(
        lambda: [T.clip_by_global_norm(2.0),
                 T.adamw(1e-2, b1=0.8, b2=0.95, weight_decay=WD)],
        norm="first",
        changes={"params", "mu", "nu"},
    ),
    "decay_clip_trace": _bnb(
        lambda: [T.add_decayed_weights(WD), T.clip_by_global_norm(2.0), T.trace(0.8),
                 T.scale_by_learning_rate(1.0)],
        norm="global",
        changes={"params", "trace"},
    ),
    # ---- masked() and partition() with state inside
    "masked_trace": _bnb(
        lambda: [T.add_decayed_weights(WD, mask=lambda p: {k: k != "s" for k in p}),
                 T.masked(T.trace(0.8), _MASK), T.scale_by_learning_rate(0.1)],
        changes={"params", "trace"},
    ),
    "partition_aliases": _bnb(
        lambda: [T.partition({"adam": T.adamw(1e-2, b1=0.8, b2=0.95, weight_decay=WD),
                              "mom": T.sgd(0.1, momentum=0.8)},
                             {"w": "adam", "v": "mom", "b": "adam", "s": "mom"})],
        changes={"params", "mu", "nu", "trace"},
    ),
}
_PRODIGY = {"lr": 5.0, "betas": (0.8, 0.9), "eps": 0.1, "estim_lr0": 1e-3}


def _estimate_reference(ref_class, names: dict, hp: dict):
    """A float64 reference (tests/reference_prodigy.py: RefProdigy, RefDAdaptAdamW) one
    step on from ``state``: its slots ``names`` (short name -> state field), its estimate,
    numerator and count."""
    def reference(params, grads, state, mask):
        (st,) = state
        b1, b2 = hp["betas"]
        ref = ref_class(hp["lr"], b1, b2, eps=hp["eps"], estim_lr0=hp["estim_lr0"],
                        weight_decay=WD)
        ref.t, ref.estim = int(st.count), float(st.estim_lr)
        ref.num = float(st.numerator_weighted)
        ref.state = {k: {short: getattr(st, name)[k].double() for short, name in names.items()}
                     for k in params}
        new_params = ref.step(params, grads, skip=mask)
        slots = {name: {k: ref.state[k][short] for k in params}
                 for short, name in names.items()}
        f64 = torch.float64
        return new_params, (type(st)(**slots, estim_lr=torch.tensor(ref.estim, dtype=f64),
                                     numerator_weighted=torch.tensor(ref.num, dtype=f64),
                                     count=st.count + 1),)
    return reference


_prodigy_reference = _estimate_reference(
    RP.RefProdigy, {"m": "exp_avg", "v": "exp_avg_sq", "s": "grad_sum", "x0": "params0"},
    _PRODIGY)


# Prodigy's estimate reads Σ|s| over the kept state, a global norm; it grows only while the
# params go on moving along the gradients (steady signs, in the zero-grad step too) and
# lr·bias correction > 1 makes it grow within the warm-up; the new estimate reaches the
# update only through estim·eps in the denominator, hence a large eps: so the control (no
# skip_zeros) differs off the zero-grad elements for every dtype.
CASES["prodigy"] = _alias(
    lambda **kw: T.prodigy(_PRODIGY["lr"], betas=_PRODIGY["betas"], eps=_PRODIGY["eps"],
                           estim_lr0=_PRODIGY["estim_lr0"], weight_decay=WD, **kw),
    lambda: [ftopt.transforms.prodigy.scale_by_prodigy(
        _PRODIGY["lr"], _PRODIGY["betas"], None, _PRODIGY["eps"], _PRODIGY["estim_lr0"],
        1.0, WD)],
    norm="global", changes={"params", "exp_avg", "exp_avg_sq", "grad_sum"},
    warm_grads=lambda params, gen: steady_sign_grads(params, gen),
    step_grads=lambda params, gen: steady_sign_grads(params, gen),
    reference=_prodigy_reference,
)
_DADAPT = {"lr": 5.0, "betas": (0.8, 0.9), "eps": 0.1, "estim_lr0": 1e-3}


_dadapt_reference = _estimate_reference(
    RP.RefDAdaptAdamW, {"m": "exp_avg", "v": "exp_avg_sq", "s": "grad_sum"}, _DADAPT)


# D-Adaptation's estimate reads Σ|s| over the kept state, as Prodigy's (above); its new
# value reaches the updates one step later (this step's dlr is the old estimate's), so off
# the zero-grad elements the step equals the plain chain's, as after a norm of the raw
# gradients ("first"; no NaN gradients: a global sum would carry them everywhere).
CASES["dadapt_adamw"] = _alias(
    lambda **kw: T.dadapt_adamw(_DADAPT["lr"], betas=_DADAPT["betas"], eps=_DADAPT["eps"],
                                estim_lr0=_DADAPT["estim_lr0"], weight_decay=WD, **kw),
    lambda: [ftopt.transforms.dadapt.dadapt_adamw(
        _DADAPT["lr"], _DADAPT["betas"], _DADAPT["eps"], _DADAPT["estim_lr0"], WD)],
    norm="first", changes={"params", "exp_avg", "exp_avg_sq", "grad_sum"},
    warm_grads=lambda params, gen: steady_sign_grads(params, gen),
    step_grads=lambda params, gen: steady_sign_grads(params, gen),
    reference=_dadapt_reference,
)
# DoG and DoWG: one step size for the tree, from global norms of the update (weight decay
# in it, so the skipped elements' share differs) and of the distance from init_params. The
# step is ~r/‖g‖ over ~9,000 elements: a large learning rate, so that the weight decay
# alone moves bf16 params in the control.
CASES["dog"] = _alias(
    lambda **kw: T.dog(100.0, ("distance", 1e-2), weight_decay=WD, **kw),
    lambda: [T.add_decayed_weights(WD), T.scale_by_dog(("distance", 1e-2)),
             T.scale_by_learning_rate(100.0)],
    norm="global", changes={"params"},
)
CASES["dowg"] = _alias(
    lambda **kw: T.dowg(100.0, 1e-3, weight_decay=WD, **kw),
    lambda: [T.add_decayed_weights(WD), T.scale_by_dowg(1e-3),
             T.scale_by_learning_rate(100.0)],
    norm="global", changes={"params"},
)
CASES["noisy_sgd"] = _alias(  # the noise moves params where the gradient is zero, so the
    lambda **kw: T.noisy_sgd(1e-2, eta=0.05, gamma=0.5, seed=3, **kw),  # warm-up has none
    lambda: [T.add_noise(0.05, 0.5, seed=3), T.scale_by_learning_rate(1e-2)],
    changes={"params"}, warm_grads=lambda params, gen: steady_sign_grads(params, gen),
)


def build(case: Case, bits: int, mode: str | None):
    """The chain: plain (``mode=None``) or skip-aware, asked for the way ``mode`` names.

    Returns ``(tx, to_skip, from_skip)``: functions between the plain chain's state and the
    skip-aware chain's (which holds the skip_zeros marker's ``EmptyState``).
    """

    def append(s):
        return (*s, EmptyState())

    def drop_last(s):
        assert isinstance(s, tuple) and s[-1] == EmptyState(), type(s)
        return s[:-1]

    def wrap(s):
        return (s, EmptyState())

    def unwrap(s):
        assert isinstance(s, tuple) and len(s) == 2 and s[1] == EmptyState(), type(s)
        return s[0]

    def same(s):
        return s

    def quantized(tx):
        return tx if bits == 32 else ftopt.quantize_states(tx, bits=bits, min_size=4096)

    if case.alias:
        plain = case.make(state_bits=bits)
        if mode is None:
            return plain, same, same
        if mode == "alias":
            return case.make(skip_zeros=True, state_bits=bits), append, drop_last
        if mode == "chain":
            return ftopt.chain(plain, ftopt.skip_zeros()), wrap, unwrap
        return ftopt.skip_zeros(plain), wrap, unwrap
    if mode is None:
        return quantized(ftopt.chain(*case.parts())), same, same
    if mode == "chain":
        return quantized(ftopt.chain(*case.parts(), ftopt.skip_zeros())), append, drop_last
    return ftopt.skip_zeros(quantized(ftopt.chain(*case.parts()))), wrap, unwrap


# --------------------------------------------------------------------------------------------
# State walking and bit comparisons
# --------------------------------------------------------------------------------------------


def map_slots(state, fn, path=()):
    """``state`` rebuilt with every per-element slot leaf replaced by
    ``fn(path, slot_name, key, leaf)`` (``leaf``: a tensor or a QuantizedSlot)."""
    if isinstance(state, QuantizedSlot):
        raise AssertionError("QuantizedSlot outside a slot field")
    if isinstance(state, torch.Tensor) and state.ndim == 0:
        return state  # a scalar outside the slots: apply_if_finite's bookkeeping
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        values = {}
        for f in state._fields:
            v = getattr(state, f)
            if f == "count" or leaf_state(state, f):
                values[f] = v
            elif _is_slot(v):  # params-like dict; None where a masked() leaf has no state
                values[f] = {k: None if x is None else fn((*path, f), f, k, x)
                             for k, x in v.items()}
            else:
                values[f] = map_slots(v, fn, (*path, f))
        return type(state)(**values)
    if isinstance(state, tuple):
        return tuple(map_slots(s, fn, (*path, i)) for i, s in enumerate(state))
    if isinstance(state, dict):  # partition's states by label
        return {k: map_slots(s, fn, (*path, k)) for k, s in state.items()}
    raise AssertionError(f"unexpected state node {type(state).__name__}")


def _is_slot(v) -> bool:
    # (A dict of 0-d tensors only is bookkeeping, inject_hyperparams' values: no param of
    # these tests is 0-d.)
    return isinstance(v, dict) and all(
        x is None or isinstance(x, (torch.Tensor, QuantizedSlot)) for x in v.values()) and \
        not (v and all(isinstance(x, torch.Tensor) and x.ndim == 0 for x in v.values()))


def slot_leaves(state) -> dict:
    out = {}

    def collect(path, name, key, leaf):
        out[(path, key)] = (name, leaf)
        return leaf

    map_slots(state, collect)
    return out


def counts(state) -> list[torch.Tensor]:
    found = []

    def visit(s):
        if isinstance(s, tuple) and hasattr(s, "_fields"):
            for f in s._fields:
                v = getattr(s, f)
                if f == "count":
                    found.append(v)
                elif not _is_slot(v):
                    visit(v)
        elif isinstance(s, (tuple, dict)):
            for x in (s.values() if isinstance(s, dict) else s):
                visit(x)

    visit(state)
    return found


_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16,
             torch.float16: torch.int16, torch.uint8: torch.uint8, torch.int32: torch.int32,
             torch.int64: torch.int64}


def bits_of(x: torch.Tensor) -> torch.Tensor:
    return x.view(_INT_VIEW[x.dtype])


def bit_equal(a: torch.Tensor, b: torch.Tensor, where: torch.Tensor | None = None) -> bool:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    a, b = bits_of(a), bits_of(b)
    if where is None:
        return torch.equal(a, b)
    return torch.equal(a[where], b[where])


def bit_changed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return bits_of(a) != bits_of(b)


def tree_bit_equal(a, b) -> bool:
    fa, sa = optree.tree_flatten(a, namespace="ftopt")
    fb, sb = optree.tree_flatten(b, namespace="ftopt")
    assert sa == sb, (sa, sb)
    return all(bit_equal(x, y) for x, y in zip(fa, fb))


def clone_tree(tree):
    return optree.tree_map(torch.clone, tree, namespace="ftopt")


def dequantized(name: str, leaf) -> torch.Tensor:
    if isinstance(leaf, QuantizedSlot):
        return dequantize_blockwise(leaf.codes, leaf.absmax, QMAP[name not in UNSIGNED_SLOTS],
                                    BLOCK)
    return leaf


def dequantize_state(state):
    return map_slots(state, lambda path, name, key, leaf: dequantized(name, leaf))


def blocks_of(mask: torch.Tensor) -> torch.Tensor:
    """(num_blocks, BLOCK) int8 view of a flattened bool mask; the padding of a partial
    last block is -1, so it counts for neither ``block_all`` nor ``block_any``."""
    flat = mask.reshape(-1)
    n = flat.numel()
    nb = -(-n // BLOCK)
    out = torch.full((nb * BLOCK,), -1, dtype=torch.int8)
    out[:n] = flat.to(torch.int8)
    return out.view(nb, BLOCK)


def block_all(mask: torch.Tensor) -> torch.Tensor:
    b = blocks_of(mask)
    return ((b == 1) | (b == -1)).all(dim=1)


def block_any(mask: torch.Tensor) -> torch.Tensor:
    return (blocks_of(mask) == 1).any(dim=1)


def per_element(block_flags: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return block_flags.repeat_interleave(BLOCK)[: like.numel()].view(like.shape)


# --------------------------------------------------------------------------------------------
# Data and stepping
# --------------------------------------------------------------------------------------------


def make_params(dtype: torch.dtype, gen: torch.Generator) -> dict:
    return {k: torch.randn(s, generator=gen).to(dtype) for k, s in SHAPES.items()}


def dense_grads(params: dict, gen: torch.Generator) -> dict:
    return {k: torch.randn(p.shape, generator=gen).to(p.dtype) for k, p in params.items()}


def steady_sign_grads(params: dict, gen: torch.Generator) -> dict:
    """Random magnitudes (>= 0.1), each element's sign the same at every step (+ at even
    flat indices, − at odd ones)."""
    out = {}
    for k, p in params.items():
        sign = 1.0 - 2.0 * (torch.arange(p.numel()) % 2).reshape(p.shape)
        out[k] = (sign * (0.1 + torch.rand(p.shape, generator=gen))).to(p.dtype)
    return out


def zero_grads(params: dict, gen: torch.Generator, nan_leaves: tuple,
               dense: Callable = dense_grads) -> dict:
    """Random grads with exact zeros of both signs: scattered, whole rows, a whole block."""
    g = dense(params, gen)
    for k, x in g.items():
        flat = x.view(-1)
        scatter = torch.rand(flat.shape, generator=gen) < 0.3
        if k in QUANTIZED:
            scatter[:2560 if k == "w" else 1024] = False  # leave some blocks zero-free
        sign = torch.rand(flat.shape, generator=gen) < 0.5
        zero = torch.where(sign, torch.tensor(-0.0), torch.tensor(0.0)).to(x.dtype)
        flat[scatter] = zero[scatter]
    g["w"][10:12] = 0.0  # whole rows (a partially skipped block 3)
    g["w"].view(-1)[4 * BLOCK:5 * BLOCK] = -0.0  # all of block 4
    g["v"][5] = -0.0
    g["v"].view(-1)[16 * BLOCK:] = 0.0  # the partial last block, all zero
    g["s"][2] = -0.0
    g["b"][:3] = torch.tensor([0.0, -0.0, 0.0])
    for k in nan_leaves:
        g[k].view(-1)[NAN_AT[k]] = float("nan")
    return g


def run_step(tx, params, grads, state, entry: str):
    before = (clone_tree(params), clone_tree(grads), clone_tree(state))
    if entry == "update":
        updates, new_state = tx.update(grads, state, params)
        new_params = ftopt.apply_updates(params, updates)
    else:
        new_params, new_state = ftopt.step(tx, params, grads, state, backend="eager")
        updates = None
    # Pure: nothing passed in was modified.
    assert tree_bit_equal(before[0], params)
    assert tree_bit_equal(before[1], grads)
    assert tree_bit_equal(before[2], state)
    for k, p in new_params.items():
        assert p.dtype == params[k].dtype
    return new_params, new_state, updates


def oracle_step(case: Case, params, grads, state, mask):
    """SPEC §3 from the parts: each part without skip_zeros, then zero the update and
    restore every per-element state at the zero-grad elements. A part that is itself a
    chain (MARS's correction, clip and Adam) is stepped stage by stage the same way, as
    skip_zeros masks between every stage of a chain."""
    parts = case.parts()
    assert isinstance(state, tuple) and len(state) == len(parts)
    u, new_states = grads, []
    for part, s in zip(parts, state):
        u, s_new = _oracle_part(part, u, s, params, mask)
        new_states.append(s_new)
    new_params = ftopt.apply_updates(params, u)
    new_params = {k: torch.where(mask[k], params[k], p) for k, p in new_params.items()}
    return new_params, tuple(new_states)


def _oracle_part(part, u, s, params, mask):
    obj = owner(part)
    if isinstance(obj, Chain) and obj.names is None:
        inner = []
        for t, s_t in zip(obj.transforms, s, strict=True):
            u, s_t = _oracle_part(t, u, s_t, params, mask)
            inner.append(s_t)
        return u, tuple(inner)
    u, s_new = part.update(u, s, params)
    u = {k: torch.where(mask[k], torch.zeros((), dtype=x.dtype), x) for k, x in u.items()}
    old = slot_leaves(s)

    def restore(path, name, key, leaf):  # (8-bit slots: the update is what is read)
        if isinstance(leaf, QuantizedSlot):
            return leaf
        return torch.where(mask[key], old[(path, key)][1], leaf)

    return u, map_slots(s_new, restore)


def assert_near_reference(tree, ref, old=None) -> None:
    """Each float leaf of ``tree`` within rounding of the float64 ``ref``: the leaf dtype's
    eps relative to the value, plus 1e-5 of the step (``old``: the values before it) or of
    the value (states computed in fp32 from sums over every element); ints equal."""
    leaves, spec = optree.tree_flatten(tree, namespace="ftopt")
    ref_leaves, ref_spec = optree.tree_flatten(ref, namespace="ftopt")
    assert spec == ref_spec, (spec, ref_spec)
    old_leaves = optree.tree_leaves(old, namespace="ftopt") if old is not None else \
        [None] * len(leaves)
    for i, (x, r, o) in enumerate(zip(leaves, ref_leaves, old_leaves)):
        if not x.is_floating_point():
            assert torch.equal(x, r.to(x.dtype)), i
            continue
        r = r.double()
        scale = (r - o.double()).abs() if o is not None else r.abs()
        bound = torch.finfo(x.dtype).eps * r.abs() + 1e-5 * scale + 1e-30
        err = (x.double() - r).abs()
        assert bool((err <= bound).all()), (i, float((err - bound).max()))


def expected_8bit(state_8bit, state_fp32_new, mask, skip: bool):
    """SPEC §5: each quantized slot re-encoded from the new fp32 state (the 32-bit chain run
    from the dequantized state); with skip_zeros, an all-zero-grad block keeps its bytes."""
    old = slot_leaves(state_8bit)

    def encode(path, name, key, new):
        prev = old[(path, key)][1]
        if not isinstance(prev, QuantizedSlot):
            return new
        codes, absmax = quantize_blockwise(new, QMAP[name not in UNSIGNED_SLOTS], BLOCK)
        if skip:
            full = block_all(mask[key])
            absmax = torch.where(full, prev.absmax, absmax)
            codes = torch.where(per_element(full, codes), prev.codes, codes)
        return QuantizedSlot(codes, absmax)

    return map_slots(state_fp32_new, encode)


def code_step_bound(old: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """One code step at ``old / absmax`` (the gap between the two codes around it), times
    ``absmax``: how far re-encoding ``old`` with the block absmax ``absmax`` may move it."""
    q = QMAP[signed]
    v = torch.where(absmax > 0, old / torch.where(absmax > 0, absmax, 1.0), 0.0)
    hi = torch.searchsorted(q, v.contiguous()).clamp(1, q.numel() - 1)
    step = q[hi] - q[hi - 1]
    return step * absmax * (1 + 1e-5) + 1e-30


# --------------------------------------------------------------------------------------------
# The test
# --------------------------------------------------------------------------------------------

pytestmark = pytest.mark.usefixtures("one_thread")


# Every alias of the test registry (each needs a Case above: its §2 parts for the oracle),
# then the other cases (other options of an alias, the bitsandbytes chains, norms, masks).
# Matrix-stage aliases (``mixes``) are checked in tests/test_matrix_optimizers.py.
ALIASES = names(by_trait(kind="alias", mixes=False))
COMPOSITES = [n for n in CASES if n not in BY_NAME]
assert set(CASES) <= set(ALIASES) | set(COMPOSITES), "a Case for a registry non-alias"


def _case(name: str) -> Case:
    return require(CASES, name, "skip_zeros Case (its §2 parts, norm and changes)",
                   "CASES in tests/test_skip_zeros.py")


PARAMS = []
for _name in [*ALIASES, *COMPOSITES]:
    _alias_modes = _name in ALIASES or CASES[_name].alias
    for _mode in (("alias", "chain", "wrap") if _alias_modes else ("chain", "wrap")):
        PARAMS.append(pytest.param(_name, _mode, id=f"{_name}-{_mode}"))

# Each dtype once, each entry point with a 32- and a 16-bit dtype (the file's time budget).
DTYPE_ENTRY = [
    pytest.param(torch.float32, "update", id="fp32-update"),
    pytest.param(torch.bfloat16, "step", id="bf16-step"),
    pytest.param(torch.float16, "update", id="fp16-update"),
]


@pytest.mark.parametrize("dtype,entry", DTYPE_ENTRY)
@pytest.mark.parametrize("bits", [32, 8])
@pytest.mark.parametrize("name,mode", PARAMS)
def test_skip_zeros(name, mode, bits, dtype, entry):
    case = _case(name)
    seed = zlib.crc32(f"{name}-{mode}-{bits}-{dtype}-{entry}".encode())
    gen = torch.Generator().manual_seed(seed)
    tx_skip, to_skip, from_skip = build(case, bits, mode)
    tx_plain, _, _ = build(case, bits, None)

    params = make_params(dtype, gen)
    state = tx_plain.init(params)
    skip_state = tx_skip.init(params)
    assert tree_bit_equal(from_skip(skip_state), state)
    if bits == 8:
        for (_, key), (slot, leaf) in slot_leaves(state).items():
            eight = key in QUANTIZED and slot not in FULL_WIDTH_SLOTS
            assert isinstance(leaf, QuantizedSlot) == eight, key

    # Warm-up with dense grads: skip_zeros changes nothing, bit for bit.
    p_skip = params
    for _ in range(WARMUP):
        g = (case.warm_grads or dense_grads)(params, gen)
        params, state, _ = run_step(tx_plain, params, g, state, entry)
        p_skip, skip_state, _ = run_step(tx_skip, p_skip, g, skip_state, entry)
        assert tree_bit_equal(p_skip, params)
        assert tree_bit_equal(from_skip(skip_state), state)

    nan_leaves = {None: ("w", "s"), "leaf": ("s",)}.get(case.norm, ())
    grads = zero_grads(params, gen, nan_leaves, case.step_grads or dense_grads)
    mask = {k: g == 0 for k, g in grads.items()}
    # Params of exactly ±0.0 at zero grads must keep their sign bit too.
    params = {k: p.clone() for k, p in params.items()}
    params["w"][10, :4] = -0.0
    params["w"][11, :4] = 0.0
    params["s"][2, :2] = torch.tensor([-0.0, 0.0])
    nan = {k: torch.isnan(g) for k, g in grads.items()}
    assert all(m.any() for m in mask.values())

    new_p, new_s, updates = run_step(tx_skip, params, grads, to_skip(state), entry)
    new_s = from_skip(new_s)
    ctl_p, ctl_s, _ = run_step(tx_plain, params, grads, state, entry)

    # Step counts advance, with and without skipping.
    old_counts = counts(state)
    assert len(counts(new_s)) == len(old_counts)
    for c_old, c_new, c_ctl in zip(old_counts, counts(new_s), counts(ctl_s)):
        assert int(c_new) == int(c_old) + 1 == int(c_ctl)

    # Skipped params are bit-identical (the update there is ±0); NaN grads are not skipped.
    for k in SHAPES:
        assert bit_equal(new_p[k], params[k], mask[k]), k
        # A NaN grad is not skipped: the param moves as in the plain run (to NaN, except for
        # Lion, whose sign(NaN) is 0 in torch as in bitsandbytes).
        assert bit_equal(new_p[k], ctl_p[k], nan[k]), k
        if updates is not None:
            assert bool((updates[k][mask[k]] == 0).all()), k

    # Off the zero-grad elements the result equals the plain chain's, unless a norm saw
    # the zero-grad elements' non-zero updates in the plain run.
    if case.norm in (None, "first"):
        for k in SHAPES:
            assert bit_equal(new_p[k], ctl_p[k], ~mask[k]), k
    else:  # ... and there the norm did see the skipped elements as 0, not as the plain run's
        assert not bit_equal(new_p["w"], ctl_p["w"], ~mask["w"])

    if bits == 32:
        _check_32bit(case, params, grads, state, mask, nan, new_p, new_s, ctl_p, ctl_s)
    else:
        _check_8bit(case, mode, params, grads, state, mask, nan, new_p, new_s, ctl_p, ctl_s,
                    entry)


def _check_32bit(case, params, grads, state, mask, nan, new_p, new_s, ctl_p, ctl_s):
    old, new, ctl = slot_leaves(state), slot_leaves(new_s), slot_leaves(ctl_s)
    assert old.keys() == new.keys() == ctl.keys()
    for where, (slot, before) in old.items():
        key = where[1]
        after, control = new[where][1], ctl[where][1]
        # Per-element state keeps its pre-step value at zero-grad elements ...
        assert bit_equal(after, before, mask[key]), where
        # ... and is NaN where the grad is (not skipped) ...
        if slot not in case.nan_free:
            assert bool(torch.isnan(after[nan[key]]).all()), where
        # ... and equals the plain run elsewhere, where no norm saw different values.
        if case.norm in (None, "first"):
            assert bit_equal(after, control, ~mask[key]), where
        # Control: the plain chain moves the zero-grad elements' state iff its math says so.
        moved = bit_changed(control, before)[mask[key]]
        if slot in case.changes:  # a decay (or adding (wd·p)²) moves non-zero values
            nonzero = (before != 0)[mask[key]]
            assert nonzero.float().mean() > 0.9
            assert moved[nonzero].float().mean() > 0.9, (where, "control: state should change")
        else:
            assert slot in case.may_change or not bool(moved.any()), (
                where, "control: state should not change")

    if case.reference is not None:  # a norm of the kept state: the float64 reference's
        ref_p, ref_s = case.reference(params, grads, state, mask)
        assert_near_reference(new_p, ref_p, params)
        assert_near_reference(new_s, ref_s)
    else:  # The whole result is the oracle's (norms see the skipped elements as 0).
        or_p, or_s = oracle_step(case, params, grads, state, mask)
        assert tree_bit_equal(new_p, or_p)
        assert tree_bit_equal(new_s, or_s)

    _check_param_control(case, params, ctl_p, mask)


def _check_param_control(case, params, ctl_p, mask):
    moved = {k: bit_changed(ctl_p[k], params[k])[mask[k]] for k in SHAPES}
    if "params" not in case.changes:  # (a ±0.0 param may flip its sign bit without skip)
        for k in SHAPES:
            nonzero = (params[k] != 0)[mask[k]]
            assert not bool(moved[k][nonzero].any()), (k, "control: params should not change")
    elif params["w"].dtype == torch.float32:
        for k in SHAPES:
            assert moved[k].float().mean() > 0.9, (k, moved[k].float().mean())
    else:  # a small update rounds away in 16 bits for many elements, not for all
        total = torch.cat(list(moved.values()))
        assert total.float().mean() > 0.02, ("control: params should change", total.float().mean())


def _check_8bit(case, mode, params, grads, state, mask, nan, new_p, new_s, ctl_p, ctl_s, entry):
    old, new, ctl = slot_leaves(state), slot_leaves(new_s), slot_leaves(ctl_s)
    assert old.keys() == new.keys() == ctl.keys()
    for where, (slot, before) in old.items():
        key = where[1]
        after, control = new[where][1], ctl[where][1]
        if not isinstance(before, QuantizedSlot):  # a small leaf: fp32 state, as in 32-bit
            assert key not in QUANTIZED or slot in FULL_WIDTH_SLOTS
            assert after.dtype == torch.float32
            assert bit_equal(after, before, mask[key]), where
            if slot not in case.nan_free:
                assert bool(torch.isnan(after[nan[key]]).all()), where
            continue
        assert isinstance(after, QuantizedSlot) and isinstance(control, QuantizedSlot)
        signed = slot not in UNSIGNED_SLOTS
        full = block_all(mask[key])
        clean = ~block_any(mask[key])
        partial = ~full & ~clean & ~block_any(nan[key])
        assert full.any() and clean.any() and partial.any()
        full_el = per_element(full, before.codes)
        # A block whose grads are all zero keeps codes and absmax byte-identical.
        assert bit_equal(after.absmax, before.absmax, full), where
        assert bit_equal(after.codes, before.codes, full_el), where
        # A skipped element of a partially skipped block is re-encoded from its old
        # dequantized value: it moves by at most one code step of the block's new absmax.
        q = QMAP[signed]
        old_deq = dequantize_blockwise(before.codes, before.absmax, q, BLOCK)
        new_deq = dequantize_blockwise(after.codes, after.absmax, q, BLOCK)
        sel = per_element(partial, before.codes) & mask[key]
        assert sel.any()
        new_absmax = per_element(after.absmax, before.codes)
        bound = code_step_bound(old_deq, new_absmax, signed)
        assert bool(((new_deq - old_deq).abs() <= bound)[sel].all()), where
        # The new absmax bounds the kept values: |old| <= absmax of the block.
        assert bool((old_deq.abs() <= new_absmax)[sel].all()), where
        # Blocks with no zero grad equal the plain run's bytes (when no norm differs).
        if case.norm in (None, "first"):
            assert bit_equal(after.absmax, control.absmax, clean), where
            assert bit_equal(after.codes, control.codes, per_element(clean, before.codes)), where
        # Control: without skip_zeros an all-zero-grad block's bytes change iff the math
        # moves that state at zero grads.
        moved = bit_changed(control.absmax, before.absmax)
        codes_moved = blocks_of(bit_changed(control.codes, before.codes)) == 1
        moved = moved | codes_moved.any(dim=1)
        if slot in case.changes:
            assert bool(moved[full].all()), (where, "control: block should change")
        elif slot not in case.may_change:
            # the block is re-encoded from its unchanged values (SPEC §5): the same
            # bytes, except that the signed map has no -1, so a block whose largest
            # magnitude is negative shrinks its absmax (MADGRAD's s and x0)
            codes, absmax = quantize_blockwise(old_deq, q, BLOCK)
            assert bit_equal(control.absmax, absmax, full), (where, "control: block moved")
            assert bit_equal(control.codes, codes, full_el), (where, "control: block moved")

    # SPEC §5 exactly: the 8-bit step is the 32-bit chain run from the dequantized state,
    # re-encoded per block (all-zero-grad blocks keep their bytes with skip_zeros).
    deq = dequantize_state(state)
    tx32_skip, to_skip32, from_skip32 = build(case, 32, mode)
    tx32_plain, _, _ = build(case, 32, None)
    sh_p, sh_s, _ = run_step(tx32_skip, params, grads, to_skip32(deq), entry)
    assert tree_bit_equal(new_p, sh_p)
    assert tree_bit_equal(new_s, expected_8bit(state, from_skip32(sh_s), mask, skip=True))
    pl_p, pl_s, _ = run_step(tx32_plain, params, grads, deq, entry)
    assert tree_bit_equal(ctl_p, pl_p)
    assert tree_bit_equal(ctl_s, expected_8bit(state, pl_s, mask, skip=False))

    _check_param_control(case, params, ctl_p, mask)


# --------------------------------------------------------------------------------------------
# Smaller properties
# --------------------------------------------------------------------------------------------

# Hand-picked hyperparameters for registry entries (by registry name; the others run with
# their registry defaults).
SINGLE_HP = {
    "scale_by_adam": {"b1": 0.8, "b2": 0.95},
    "scale_by_ademamix": {"b1": 0.8, "b2": 0.95, "b3": 0.99, "alpha": 3.0},
    "scale_by_lion": {"b1": 0.8, "b2": 0.95},
    "trace": {"decay": 0.8},
    "scale_by_rms": {"decay": 0.8, "initial_scale": 0.3},
    "scale_by_rss": {"initial_accumulator_value": 0.1},
    "add_decayed_weights": {"weight_decay": WD},
    "clip_by_global_norm": {"max_norm": 1.0},
    "clip_by_param_norm_ratio": {"max_ratio": 0.01},
    "scale_by_trust_ratio": {"trust_coefficient": 0.1},
}


def _single(e):
    hp = {**e.defaults(), **SINGLE_HP.get(e.name, {})}
    if e.kind == "combinator":
        hp["inner"] = [BY_NAME[n].make(**BY_NAME[n].defaults()) for n in e.inner]
    return lambda: e.make(**hp)


# Every registry transform and combinator (with its registry inner transforms).
SINGLE = {e.name: _single(e) for e in TRANSFORMS
          if e.kind in ("transform", "combinator") and not e.mixes}


@pytest.mark.parametrize("bits", [32, 8])
@pytest.mark.parametrize("name", list(SINGLE))
def test_skip_zeros_wraps_a_single_transform(name, bits):
    """``skip_zeros(t)`` on one §2 transform (or combinator): zero update and kept state at
    zero grads; the raw grads' norms are unchanged by the masking, so the rest equals ``t``
    alone (a transform whose norm reads its own stateful stage's output, MARS's clip: the
    rest equals its stages run one by one with the zeros masked between them)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}-{bits}".encode()))

    def quantized(tx):
        return tx if bits == 32 else ftopt.quantize_states(tx, bits=8)

    plain = quantized(SINGLE[name]())
    skip = ftopt.skip_zeros(quantized(SINGLE[name]()))
    params = make_params(torch.float32, gen)
    state = plain.init(params)
    for _ in range(2):
        _, state = plain.update(dense_grads(params, gen), state, params)
    grads = zero_grads(params, gen, ())
    mask = {k: g == 0 for k, g in grads.items()}
    u_skip, s_skip = skip.update(grads, (state, EmptyState()), params)
    u_plain, s_plain = plain.update(grads, state, params)
    s_skip = s_skip[0]
    if BY_NAME[name].norm_after_state:  # the norm sees the stateful stage's 0s: the oracle
        u_plain, _ = _oracle_part(plain, grads, state, params, mask)
    for k in SHAPES:
        assert bool((u_skip[k][mask[k]] == 0).all()), k
        assert bit_equal(u_skip[k], u_plain[k], ~mask[k]), k
    advance = BY_NAME[name].steps_after(3) - BY_NAME[name].steps_after(2)
    for c_old, c_new in zip(counts(state), counts(s_skip)):
        assert int(c_new) == int(c_old) + advance
    old = slot_leaves(state)
    for where, (_, leaf) in slot_leaves(s_skip).items():
        before = old[where][1]
        if isinstance(leaf, QuantizedSlot):
            full = block_all(mask[where[1]])
            assert bit_equal(leaf.absmax, before.absmax, full), where
            assert bit_equal(leaf.codes, before.codes, per_element(full, leaf.codes)), where
        else:
            assert bit_equal(leaf, before, mask[where[1]]), where


@pytest.mark.parametrize("bits", [32, 8])
def test_marker_position_and_all_zero_step(bits):
    """skip_zeros() anywhere in a chain has the same effect; a step whose grads are all
    zero leaves params and (8-bit: every block's bytes) state bit-identical, counts advance."""
    gen = torch.Generator().manual_seed(7 + bits)
    parts = lambda: [T.add_decayed_weights(WD), T.scale_by_adam(0.8, 0.95),  # noqa: E731
                     T.clip_by_global_norm(0.5), T.scale_by_learning_rate(1e-2)]
    txs = [ftopt.quantize_states(ftopt.chain(*p), bits=bits) for p in (
        [ftopt.skip_zeros(), *parts()],
        [*parts()[:2], ftopt.skip_zeros(), *parts()[2:]],
        [*parts(), ftopt.skip_zeros()],
    )]
    params = make_params(torch.float32, gen)
    states = [tx.init(params) for tx in txs]
    for i in range(3):
        g = dense_grads(params, gen) if i < 2 else zero_grads(params, gen, ("w",))
        results = [ftopt.step(tx, params, g, s, backend="eager") for tx, s in zip(txs, states)]
        drop = [lambda s: s[1:], lambda s: s[:2] + s[3:], lambda s: s[:-1]]
        for (p, s), d in zip(results[1:], drop[1:]):
            assert tree_bit_equal(p, results[0][0])
            assert tree_bit_equal(d(s), drop[0](results[0][1]))
        params, _ = results[0]
        states = [s for _, s in results]

    zeros = {k: torch.where(torch.rand(p.shape, generator=gen) < 0.5, 0.0, -0.0)
             for k, p in params.items()}
    new_p, new_s = ftopt.step(txs[2], params, zeros, states[2], backend="eager")
    assert tree_bit_equal(new_p, params)
    assert tree_bit_equal(counts(new_s), [c + 1 for c in counts(states[2])])
    assert tree_bit_equal(slot_leaves_tree(new_s), slot_leaves_tree(states[2]))


def slot_leaves_tree(state) -> list:
    return [leaf for _, leaf in slot_leaves(state).values()]


@pytest.mark.parametrize("bits", [32, 8])
def test_none_grad_leaf(bits):
    """A ``None`` grad leaf in a skip-aware chain: its param and state are left untouched;
    the other leaves follow §3."""
    gen = torch.Generator().manual_seed(11 + bits)
    tx = ftopt.adamw(1e-2, weight_decay=WD, skip_zeros=True, state_bits=bits)
    params = make_params(torch.float32, gen)
    state = tx.init(params)
    for _ in range(2):
        params, state = ftopt.step(tx, params, dense_grads(params, gen), state, backend="eager")
    grads = zero_grads(params, gen, ())
    grads["v"] = None
    grads["b"] = None
    mask = {k: g == 0 for k, g in grads.items() if g is not None}
    new_p, new_s = ftopt.step(tx, params, grads, state, backend="eager")
    for k in ("v", "b"):
        assert bit_equal(new_p[k], params[k])
    old = slot_leaves(state)
    for where, (_, leaf) in slot_leaves(new_s).items():
        key = where[1]
        before = old[where][1]
        if key in ("v", "b"):
            assert tree_bit_equal(leaf, before), where
        elif not isinstance(leaf, QuantizedSlot):
            assert bit_equal(leaf, before, mask[key]), where
        else:
            full = block_all(mask[key])
            assert bit_equal(leaf.absmax, before.absmax, full), where
    for k in ("w", "s"):
        assert bit_equal(new_p[k], params[k], mask[k]), k
        assert not bit_equal(new_p[k], params[k], ~mask[k]), k


def _on_device(tree: dict) -> dict:
    """The fused tests run on the GPU where there is one (the interpreter otherwise)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return {k: v.to(device) for k, v in tree.items()}


@pytest.mark.parametrize("bits", [32, 8])
@pytest.mark.parametrize("name", ["adamw", "lion", "clip_then_adamw", "bnb_lars", "prodigy"])
def test_skip_zeros_fused_backend(name, bits):
    """§3 is exact on every backend: the same checks on ``step(backend="fused")`` (the
    Triton kernels, through the interpreter on CPU), skip-aware against plain fused."""
    case = CASES[name]
    gen = torch.Generator().manual_seed(zlib.crc32(f"fused-{name}-{bits}".encode()))
    tx_skip, to_skip, from_skip = build(case, bits, "chain")
    tx_plain, _, _ = build(case, bits, None)
    params = _on_device(make_params(torch.float32, gen))
    state = tx_plain.init(params)
    for _ in range(2):
        g = _on_device(dense_grads(params, gen))
        p_skip, s_skip = ftopt.step(tx_skip, params, g, to_skip(state), backend="fused")
        params, state = ftopt.step(tx_plain, params, g, state, backend="fused")
        assert tree_bit_equal(p_skip, params)
        assert tree_bit_equal(from_skip(s_skip), state)
    grads = _on_device(zero_grads(params, gen, ("w",) if case.norm is None else ()))
    mask = {k: g == 0 for k, g in grads.items()}
    params["w"][10, :4] = -0.0
    new_p, new_s = ftopt.step(tx_skip, params, grads, to_skip(state), backend="fused")
    new_s = from_skip(new_s)
    ctl_p, ctl_s = ftopt.step(tx_plain, params, grads, state, backend="fused")
    for c_old, c_new in zip(counts(state), counts(new_s)):
        assert int(c_new) == int(c_old) + 1
    for k in SHAPES:
        assert bit_equal(new_p[k], params[k], mask[k]), k
        if case.norm in (None, "first"):
            assert bit_equal(new_p[k], ctl_p[k], ~mask[k]), k
    old, new, ctl = slot_leaves(state), slot_leaves(new_s), slot_leaves(ctl_s)
    for where, (_, before) in old.items():
        key, after = where[1], new[where][1]
        if isinstance(before, QuantizedSlot):
            full = block_all(mask[key])
            assert bit_equal(after.absmax, before.absmax, full), where
            assert bit_equal(after.codes, before.codes, per_element(full, after.codes)), where
            if case.norm in (None, "first"):
                clean = ~block_any(mask[key])
                assert bit_equal(after.absmax, ctl[where][1].absmax, clean), where
        else:
            assert bit_equal(after, before, mask[key]), where
            if case.norm in (None, "first"):
                assert bit_equal(after, ctl[where][1], ~mask[key]), where


MASKED_CHAINS = {
    "masked_trace": lambda: ftopt.chain(
        ftopt.masked(ftopt.trace(0.9, nesterov=True), {"w": True, "b": False}),
        ftopt.skip_zeros()),
    "adamw_decay_mask": lambda: ftopt.adamw(1e-2, weight_decay=0.1,
                                            mask={"w": True, "b": False}, skip_zeros=True),
    "decay_mask_alone": lambda: ftopt.skip_zeros(
        ftopt.add_decayed_weights(0.1, mask={"w": False, "b": True})),
}


@pytest.mark.parametrize("backend", ["eager", "fused", "update"])
@pytest.mark.parametrize("name", list(MASKED_CHAINS))
def test_leaves_a_mask_passes_through_keep_negative_zero_params(name, backend):
    """A leaf a mask leaves out passes its gradient through: where that gradient is
    zero the update must be -0.0, not +0.0, or a -0.0 param would turn into +0.0 (found by
    the fuzzed contract)."""
    tx = MASKED_CHAINS[name]()
    gen = torch.Generator().manual_seed(21)
    params = _on_device({"w": torch.randn(6, 5, generator=gen),
                         "b": torch.randn(37, generator=gen)})
    grads = {k: torch.randn(v.shape, generator=gen).to(v.device) for k, v in params.items()}
    for k in params:
        params[k].view(-1)[::3] = -0.0
        grads[k].view(-1)[::3] = 0.0  # +0.0 gradients at -0.0 params
    zero = {k: grads[k] == 0 for k in grads}
    before = {k: v.clone() for k, v in params.items()}
    state = tx.init(params)
    if backend == "update":
        updates, _ = tx.update(grads, state, params, backend="eager")
        new = ftopt.apply_updates(params, updates)
        fused_updates, _ = tx.update(grads, state, params, backend="auto")
        for k in updates:
            assert updates[k].dtype == fused_updates[k].dtype, k
    else:
        new, _ = ftopt.step(tx, params, grads, state, backend=backend)
    for k in params:
        got = new[k][zero[k]].view(torch.int32)
        assert torch.equal(got, before[k][zero[k]].view(torch.int32)), k
