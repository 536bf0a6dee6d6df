"""Hyperparameter domains (checked at construction) and schedule argument checks.

For every argument with a domain: a value just outside raises, with a message naming the
owner, the argument, the range and the value; a value on each closed end is accepted and
still trains (one step, finite params); a CPU 0-d tensor is checked like a float; a tensor
off the CPU is not read.
"""

from __future__ import annotations

import math

import pytest
import torch

import ftopt
from ftopt import schedules as S

SEED = 99

# (owner named in the message, factory(value), argument, range, values outside, values on
# a closed end). Transform factories get a learning rate in ``_trainable``.
A = ftopt
CASES = [
    ("scale_by_adam", lambda v: A.scale_by_adam(b1=v), "b1", "[0, 1)", [1.0, -0.1], [0.0]),
    ("scale_by_adam", lambda v: A.scale_by_adam(b2=v), "b2", "[0, 1)", [1.0, -0.1], [0.0]),
    ("scale_by_adam", lambda v: A.scale_by_adam(eps=v), "eps", ">= 0", [-1e-8], [0.0]),
    ("scale_by_adam", lambda v: A.scale_by_adam(eps_root=v), "eps_root", ">= 0", [-1e-8],
     [0.0]),
    ("scale_by_ademamix", lambda v: A.scale_by_ademamix(b1=v), "b1", "[0, 1)", [1.0, -0.1],
     [0.0]),
    ("scale_by_ademamix", lambda v: A.scale_by_ademamix(b2=v), "b2", "[0, 1)", [1.0, -0.1],
     [0.0]),
    ("scale_by_ademamix", lambda v: A.scale_by_ademamix(b3=v), "b3", "[0, 1]", [1.01, -0.1],
     [0.0, 1.0]),
    ("scale_by_ademamix", lambda v: A.scale_by_ademamix(alpha=v), "alpha", ">= 0", [-0.1],
     [0.0]),
    ("scale_by_ademamix", lambda v: A.scale_by_ademamix(eps=v), "eps", ">= 0", [-1.0], [0.0]),
    ("scale_by_ademamix", lambda v: A.scale_by_ademamix(eps_root=v), "eps_root", ">= 0",
     [-1.0], [0.0]),
    ("scale_by_lion", lambda v: A.scale_by_lion(b1=v), "b1", "[0, 1]", [1.1, -0.1],
     [0.0, 1.0]),
    ("scale_by_lion", lambda v: A.scale_by_lion(b2=v), "b2", "[0, 1]", [1.1, -0.1],
     [0.0, 1.0]),
    ("trace", lambda v: A.trace(v), "decay", ">= 0", [-0.1], [0.0]),
    ("scale_by_rms", lambda v: A.scale_by_rms(decay=v), "decay", "[0, 1]", [1.1, -0.1],
     [0.0, 1.0]),
    ("scale_by_rms", lambda v: A.scale_by_rms(eps=v), "eps", ">= 0", [-1e-8], [0.0]),
    ("scale_by_rms", lambda v: A.scale_by_rms(initial_scale=v), "initial_scale", ">= 0",
     [-0.5], [0.0]),
    ("scale_by_rss", lambda v: A.scale_by_rss(initial_accumulator_value=v),
     "initial_accumulator_value", ">= 0", [-0.1], [0.0]),
    ("scale_by_rss", lambda v: A.scale_by_rss(eps=v), "eps", ">= 0", [-1e-7], [0.0]),
    ("scale_by_learning_rate", lambda v: A.scale_by_learning_rate(v), "learning_rate", ">= 0",
     [-1e-3], [0.0]),
    ("add_decayed_weights", lambda v: A.add_decayed_weights(v), "weight_decay", ">= 0",
     [-1e-4], [0.0]),
    ("clip_by_global_norm", lambda v: A.clip_by_global_norm(v), "max_norm", "> 0",
     [0.0, -1.0], []),
    ("clip_by_param_norm_ratio", lambda v: A.clip_by_param_norm_ratio(v), "max_ratio", "> 0",
     [0.0, -1.0], []),
    ("scale_by_trust_ratio", lambda v: A.scale_by_trust_ratio(min_norm=v), "min_norm", ">= 0",
     [-0.1], [0.0]),
    ("scale_by_trust_ratio", lambda v: A.scale_by_trust_ratio(trust_coefficient=v),
     "trust_coefficient", ">= 0", [-0.1], [0.0]),
    ("scale_by_trust_ratio", lambda v: A.scale_by_trust_ratio(eps=v), "eps", ">= 0", [-0.1],
     [0.0]),
    ("scale_by_adamax", lambda v: A.scale_by_adamax(b1=v), "b1", "[0, 1)", [1.0, -0.1],
     [0.0]),
    ("scale_by_adamax", lambda v: A.scale_by_adamax(b2=v), "b2", "[0, 1)", [1.0], [0.0]),
    ("scale_by_adamax", lambda v: A.scale_by_adamax(eps=v), "eps", ">= 0", [-1e-8], [0.0]),
    ("scale_by_amsgrad", lambda v: A.scale_by_amsgrad(b2=v), "b2", "[0, 1)", [1.0], [0.0]),
    ("scale_by_amsgrad", lambda v: A.scale_by_amsgrad(eps_root=v), "eps_root", ">= 0",
     [-1e-8], [0.0]),
    ("scale_by_radam", lambda v: A.scale_by_radam(b2=v), "b2", "[0, 1)", [1.0], [0.0]),
    ("scale_by_radam", lambda v: A.scale_by_radam(threshold=v), "threshold", ">= 4",
     [3.9, -1.0], [4.0]),
    ("scale_by_belief", lambda v: A.scale_by_belief(b1=v), "b1", "[0, 1)", [1.0], [0.0]),
    ("scale_by_belief", lambda v: A.scale_by_belief(eps_root=v), "eps_root", ">= 0", [-1e-16],
     [0.0]),
    ("scale_by_yogi", lambda v: A.scale_by_yogi(b2=v), "b2", "[0, 1)", [1.0], [0.0]),
    ("scale_by_yogi", lambda v: A.scale_by_yogi(initial_accumulator_value=v),
     "initial_accumulator_value", ">= 0", [-1e-6], [0.0]),
    ("scale_by_adadelta", lambda v: A.scale_by_adadelta(rho=v), "rho", "[0, 1]", [1.1, -0.1],
     [0.0, 1.0]),
    ("scale_by_adadelta", lambda v: A.scale_by_adadelta(eps=v), "eps", "> 0", [0.0, -1e-6],
     []),
    ("ema", lambda v: A.ema(v), "decay", "[0, 1)", [1.0, -0.1], [0.0]),
    ("ema", lambda v: A.ema(v, debias=False), "decay", "[0, 1]", [1.1], [0.0, 1.0]),
    ("scale_by_adopt", lambda v: A.scale_by_adopt(b2=v), "b2", "[0, 1)", [1.0], [0.0]),
    ("scale_by_adopt", lambda v: A.scale_by_adopt(eps=v), "eps", "> 0", [0.0, -1e-6], []),
    ("scale_by_simplified_ademamix", lambda v: A.scale_by_simplified_ademamix(b1=v), "b1",
     "[0, 1)", [1.0], [0.0]),
    ("scale_by_simplified_ademamix", lambda v: A.scale_by_simplified_ademamix(alpha=v),
     "alpha", ">= 0", [-0.1], [0.0]),
    # aliases: pass-through arguments name the inner transform, alias-only ones the alias
    ("scale_by_adam", lambda v: A.adam(1e-3, b1=v), "b1", "[0, 1)", [1.0], [0.0]),
    ("scale_by_adam", lambda v: A.adamw(1e-3, b2=v), "b2", "[0, 1)", [1.0], [0.0]),
    ("add_decayed_weights", lambda v: A.adamw(1e-3, weight_decay=v), "weight_decay", ">= 0",
     [-0.1], [0.0]),
    ("scale_by_adam", lambda v: A.lamb(1e-3, b2=v), "b2", "[0, 1)", [1.0], [0.0]),
    ("scale_by_ademamix", lambda v: A.ademamix(1e-3, b3=v), "b3", "[0, 1]", [1.5], [1.0]),
    ("scale_by_lion", lambda v: A.lion(1e-3, b2=v), "b2", "[0, 1]", [-0.1], [1.0]),
    ("scale_by_rms", lambda v: A.rmsprop(1e-3, decay=v), "decay", "[0, 1]", [1.1], [1.0]),
    ("scale_by_rss", lambda v: A.adagrad(1e-3, eps=v), "eps", ">= 0", [-1.0], [0.0]),
    ("scale_by_trust_ratio", lambda v: A.lars(1e-3, trust_coefficient=v), "trust_coefficient",
     ">= 0", [-1.0], [0.0]),
    ("scale_by_learning_rate", lambda v: A.sgd(v), "learning_rate", ">= 0", [-0.1], [0.0]),
    ("sgd", lambda v: A.sgd(1e-3, momentum=v), "momentum", ">= 0", [-0.1], [0.0]),
    ("rmsprop", lambda v: A.rmsprop(1e-3, momentum=v), "momentum", ">= 0", [-0.1], [0.0]),
    ("lars", lambda v: A.lars(1e-3, momentum=v), "momentum", ">= 0", [-0.1], [0.0]),
    ("scale_by_radam", lambda v: A.radam(1e-3, threshold=v), "threshold", ">= 4", [2.0],
     [4.0]),
    ("scale_by_adadelta", lambda v: A.adadelta(rho=v), "rho", "[0, 1]", [1.5], [1.0]),
    ("add_decayed_weights", lambda v: A.adadelta(weight_decay=v), "weight_decay", ">= 0",
     [-0.1], [0.0]),
    ("signum", lambda v: A.signum(1e-3, beta=v), "beta", "[0, 1]", [1.5], [1.0]),
    ("scale_by_adopt", lambda v: A.adopt(1e-3, eps=v), "eps", "> 0", [0.0], []),
    ("scale_by_learning_rate", lambda v: A.sign_sgd(v), "learning_rate", ">= 0", [-0.1],
     [0.0]),
]
IDS = [f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(CASES)]
# Arguments taken as a host float (an initial state value): a tensor is converted, not kept.
HOST_FLOAT = {"initial_scale", "initial_accumulator_value"}


def _trainable(tx):
    """``tx`` with a learning rate if it is a bare transform (aliases have one)."""
    obj = tx.update.__self__
    if type(obj).__name__ == "Chain":
        return tx
    return A.chain(tx, A.scale_by_learning_rate(1e-2))


def _one_step(tx):
    gen = torch.Generator().manual_seed(SEED)
    params = {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen)}
    grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
    tx = _trainable(tx)
    new, _ = A.step(tx, params, grads, tx.init(params))
    assert all(torch.isfinite(p).all() for p in A.tree.leaves(new))
    return params, new


@pytest.mark.parametrize("owner,make,arg,rng,bad,ok", CASES, ids=IDS)
def test_out_of_domain_raises(owner, make, arg, rng, bad, ok):
    for v in bad:
        for value, note in ((v, ""), (torch.tensor(v), " (a 0-d tensor)")):
            with pytest.raises(ValueError) as info:
                make(value)
            msg = str(info.value)
            assert msg.startswith(f"{owner}: {arg}") and f" {rng}, got" in msg, msg
            assert f"got {float(value)}" in msg, msg
            if arg not in HOST_FLOAT:
                assert msg.endswith(note), msg


@pytest.mark.parametrize("owner,make,arg,rng,bad,ok", CASES, ids=IDS)
def test_closed_ends_are_accepted_and_train(owner, make, arg, rng, bad, ok):
    for v in ok:
        _one_step(make(v))
        _one_step(make(torch.tensor(v)))


def test_typical_values_move_the_params():
    for tx in (A.adam(1e-2, b1=0.0), A.lion(1e-2, b1=0.0, b2=1.0), A.sgd(1e-2, momentum=0.0),
               A.rmsprop(1e-2, decay=1.0, eps=0.0, initial_scale=1.0),
               A.chain(A.clip_by_global_norm(1e-3), A.scale(-1.0))):
        old, new = _one_step(tx)
        assert not torch.equal(old["w"], new["w"])


def test_off_cpu_tensor_is_not_read():
    # A tensor off the CPU is not read at construction (reading would synchronise with
    # the device); the meta device stands in for an accelerator (reading it raises).
    above, below = torch.tensor(1.5, device="meta"), torch.tensor(-1.0, device="meta")
    for make in (lambda: A.scale_by_adam(b1=above), lambda: A.clip_by_global_norm(below),
                 lambda: A.sgd(below), lambda: A.sgd(1e-3, momentum=below)):
        make()


def test_scale_takes_any_finite_value():
    for v in (-3.0, 0.0, 2.5, torch.tensor(-1.0)):
        A.scale(v)
    for v in (math.nan, math.inf, torch.tensor(-math.inf)):
        with pytest.raises(ValueError, match="scale: hyperparameter step_size must be finite"):
            A.scale(v)


@pytest.mark.parametrize("value,err", [(True, TypeError), ("0.9", TypeError),
                                       (torch.tensor(True), ValueError),
                                       (torch.tensor([0.9]), ValueError)])
def test_non_float_types(value, err):
    with pytest.raises(err, match="scale_by_adam: hyperparameter b1"):
        A.scale_by_adam(b1=value)


@pytest.mark.parametrize("make,err,match", [
    (lambda: A.quantize_states(A.adam(1e-3), bits=16), ValueError, "bits must be 8 or 32"),
    (lambda: A.quantize_states(A.adam(1e-3), bits=8.0), TypeError, "bits must be an int"),
    (lambda: A.quantize_states(A.adam(1e-3), block_size=0), ValueError,
     "block_size must be a positive int, got 0"),
    (lambda: A.quantize_states(A.adam(1e-3), block_size=256.0), TypeError,
     "block_size must be a positive int"),
    (lambda: A.quantize_states(A.adam(1e-3), block_size=True), TypeError, "block_size"),
    (lambda: A.quantize_states(A.adam(1e-3), min_size=-1), ValueError,
     "min_size must be an int >= 0, got -1"),
    (lambda: A.quantize_states(A.adam(1e-3), min_size=4096.0), TypeError, "min_size"),
    (lambda: A.adam(1e-3, state_bits=16), ValueError, "adam: state_bits must be 8 or 32"),
    (lambda: A.lars(1e-3, state_bits=8.0), TypeError, "lars: state_bits must be 8 or 32"),
    (lambda: A.sgd(1e-3, state_bits=True), TypeError, "sgd: state_bits"),
])
def test_quantization_arguments(make, err, match):
    with pytest.raises(err, match=match):
        make()


def test_quantization_boundaries_are_accepted():
    tx = A.quantize_states(A.adam(1e-2), bits=8, block_size=1, min_size=0)
    _one_step(tx)
    _one_step(A.adam(1e-2, state_bits=8))


# ------------------------------------------------------------------------- schedules

NAN, INF = math.nan, math.inf
SCHEDULE_ERRORS = [
    (lambda: S.constant_schedule(NAN), ValueError, "constant_schedule: value must be finite"),
    (lambda: S.linear_schedule(1e-3, NAN, 10), ValueError,
     "linear_schedule: end_value must be finite, got nan"),
    (lambda: S.linear_schedule(INF, 0.0, 10), ValueError, "linear_schedule: init_value"),
    (lambda: S.linear_schedule(1.0, 0.0, 10, 1.5), TypeError, "transition_begin"),
    (lambda: S.linear_schedule(1.0, 0.0, 10.5), TypeError,
     "linear_schedule: transition_steps must be an int"),
    (lambda: S.cosine_decay_schedule(1.0, 10.5), TypeError, "decay_steps"),
    (lambda: S.warmup_constant_schedule(0.0, 1.0, 4.5), TypeError, "warmup_constant_schedule"),
    (lambda: S.ademamix_b3_warmup(0.9, 0.999, 1.5), TypeError, "warmup_steps"),
    (lambda: S.polynomial_schedule(1.0, 0.0, -1.0, 10), ValueError,
     "polynomial_schedule: power must be >= 0, got -1.0"),
    (lambda: S.polynomial_schedule(1.0, 0.0, NAN, 10), ValueError, "power must be finite"),
    (lambda: S.exponential_decay(1.0, 10, -0.5), ValueError,
     "exponential_decay: decay_rate must be >= 0, got -0.5"),
    (lambda: S.exponential_decay(1.0, 10, NAN), ValueError, "decay_rate must be finite"),
    (lambda: S.exponential_decay(1.0, 10, 0.5, end_value=NAN), ValueError, "end_value"),
    (lambda: S.exponential_decay(1.0, 2.5, 0.5), TypeError, "transition_steps"),
    (lambda: S.cosine_decay_schedule(1.0, 0), ValueError,
     "cosine_decay_schedule: decay_steps must be a positive int, got 0"),
    (lambda: S.cosine_decay_schedule(1.0, 10, alpha=NAN), ValueError, "alpha must be finite"),
    (lambda: S.cosine_decay_schedule(1.0, 10, exponent=-1.0), ValueError,
     "exponent must be >= 0"),
    (lambda: S.warmup_cosine_decay_schedule(0.0, 1.0, -1, 10), ValueError,
     "warmup_cosine_decay_schedule: warmup_steps must be an int >= 0, got -1"),
    (lambda: S.warmup_cosine_decay_schedule(0.0, NAN, 1, 10), ValueError, "peak_value"),
    (lambda: S.warmup_cosine_decay_schedule(0.0, 1.0, 1, 10, end_value=INF), ValueError,
     "end_value"),
    (lambda: S.warmup_cosine_decay_schedule(0.0, 1.0, 5, 5), ValueError, "decay_steps"),
    (lambda: S.warmup_cosine_decay_schedule(0.0, 1.0, 1, 10, exponent=-2.0), ValueError,
     "exponent must be >= 0"),
    (lambda: S.warmup_constant_schedule(0.0, NAN, 4), ValueError,
     "warmup_constant_schedule: end_value"),
    (lambda: S.piecewise_constant_schedule(NAN, {2: 0.5}), ValueError, "init_value"),
    (lambda: S.piecewise_constant_schedule(1.0, {2: NAN}), ValueError,
     "scale at boundary 2 must be finite"),
    (lambda: S.piecewise_constant_schedule(1.0, {2: -0.5}), ValueError,
     "scale at boundary 2 must be >= 0"),
    (lambda: S.piecewise_constant_schedule(1.0, {2.5: 0.5}), TypeError, "boundary"),
    (lambda: S.piecewise_constant_schedule(1.0, [(2, 0.5)]), TypeError, "mapping"),
    (lambda: S.join_schedules([S.constant_schedule(1.0)] * 2, [2.5]), TypeError,
     r"join_schedules: boundaries\[0\] must be an int"),
    (lambda: S.join_schedules([S.constant_schedule(1.0), 0.5], [2]), TypeError,
     r"schedules\[1\] must be callable"),
    (lambda: S.join_schedules([S.constant_schedule(1.0)] * 2, [1, 2]), ValueError,
     "boundaries"),
    (lambda: S.ademamix_alpha_warmup(-0.5, 10), ValueError,
     "ademamix_alpha_warmup: alpha must be >= 0, got -0.5"),
    (lambda: S.ademamix_alpha_warmup(NAN, 10), ValueError, "alpha must be finite"),
    (lambda: S.ademamix_alpha_warmup(5.0, 2.5), TypeError, "warmup_steps"),
    (lambda: S.ademamix_b3_warmup(0.0, 0.999, 10), ValueError,
     r"ademamix_b3_warmup: b1 must be in \(0, 1\), got 0.0"),
    (lambda: S.ademamix_b3_warmup(0.9, 1.0, 10), ValueError, r"b3 must be in \(0, 1\)"),
    (lambda: S.ademamix_b3_warmup(0.9, NAN, 10), ValueError, "b3 must be finite"),
]


@pytest.mark.parametrize("make,err,match", SCHEDULE_ERRORS,
                         ids=[str(i) for i in range(len(SCHEDULE_ERRORS))])
def test_schedule_arguments(make, err, match):
    with pytest.raises(err, match=match):
        make()


def test_schedule_boundaries_are_accepted_and_train():
    accepted = [
        S.polynomial_schedule(1e-2, 0.0, 0.0, 10),  # power 0: constant
        S.linear_schedule(1e-2, 0.0, 0),  # no transition: constant (optax)
        S.linear_schedule(1e-2, 0.0, 5, -3),  # negative begin counts as 0 (optax)
        S.exponential_decay(1e-2, 10, 0.0),  # rate 0: constant (optax)
        S.cosine_decay_schedule(1e-2, 1, exponent=0.0),
        S.warmup_cosine_decay_schedule(0.0, 1e-2, 0, 1),
        S.piecewise_constant_schedule(1e-2, {3: 0.0}),
        S.ademamix_alpha_warmup(0.0, 10),
        S.join_schedules([S.constant_schedule(1e-2)], []),
    ]
    for sched in accepted:
        for count in (0, 1, 7, torch.tensor(5)):
            assert math.isfinite(float(sched(count)))
        _one_step(A.adam(sched))
    _one_step(A.ademamix(1e-2, b3=S.ademamix_b3_warmup(0.5, 0.999, 3),
                         alpha=S.ademamix_alpha_warmup(5.0, 3)))


def test_schedule_step_counts_may_be_integral_floats():
    """optax takes ``transition_steps=1e4``: a float of integer value is that int."""
    for as_float, as_int in [(S.linear_schedule(1.0, 0.0, 1e2), S.linear_schedule(1.0, 0.0, 100)),
                             (S.cosine_decay_schedule(1.0, 10.0), S.cosine_decay_schedule(1.0, 10)),
                             (S.warmup_constant_schedule(0.0, 1.0, 4.0),
                              S.warmup_constant_schedule(0.0, 1.0, 4))]:
        for count in (0, 3, 50, 150):
            assert float(as_float(count)) == float(as_int(count))
