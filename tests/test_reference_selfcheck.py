"""Checks of tests/reference.py that do not involve ftopt.

* Against torch.optim in float64, wherever torch implements the same math (20+ steps, random
  params and grads, relative error <= 1e-10).
* Hand-computed first (and second) steps for the optimizers torch.optim does not have in the
  same form: Lion, AdEMAMix, LAMB, LARS, Adam with optax's Nesterov formula, RMSprop with
  initial_scale and eps inside the sqrt, optax Adagrad, and the bitsandbytes LAMB/LARS rows.
"""

from __future__ import annotations

import math

import pytest
import reference as R
import torch

F64 = torch.float64
SHAPES = {"w": (7, 5), "b": (33,), "s": (), "t": (4, 3, 2)}
STEPS = 25
# Params are ~N(0, 1); both sides run in float64, so the rounding noise is ~1e-15 of the
# parameter scale.  The floor keeps elements that happen to sit near 0 from turning that
# absolute noise into a large relative number (1e-10 * 1e-2 = 1e-12 absolute).
FLOOR = 1e-2
RTOL = 1e-10


def _rand(gen, scale=1.0, zero_frac=0.0):
    out = {}
    for k, s in SHAPES.items():
        x = scale * torch.randn(s, generator=gen, dtype=F64)
        if zero_frac:
            x = torch.where(torch.rand(s, generator=gen, dtype=F64) < zero_frac, 0.0, x)
        out[k] = x
    return out


def _run_against_torch(make_torch, ref, zero_frac=0.1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = _rand(gen)
    tparams = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = make_torch(list(tparams.values()))
    rparams = params
    moved = 0.0
    for step in range(STEPS):
        grads = _rand(gen, scale=0.3, zero_frac=zero_frac)
        for k, p in tparams.items():
            p.grad = grads[k].clone()
        opt.step()
        rparams = ref.step(rparams, grads)
        got = {k: p.detach() for k, p in tparams.items()}
        err = R.max_rel_err(got, rparams, FLOOR)
        assert err <= RTOL, f"step {step + 1}: rel err {err:.3e}"
        moved = max(moved, R.max_rel_err(rparams, params, FLOOR))
    assert moved > 1e-3  # the run really moved the params (no vacuous comparison)


TORCH_CASES = {
    "adam": (
        lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.95), eps=1e-3),
        lambda: R.RefAdam(0.01, b1=0.8, b2=0.95, eps=1e-3),
    ),
    "adamw": (  # torch decays p by lr*wd before the update = optax adamw order
        lambda ps: torch.optim.AdamW(ps, lr=0.01, betas=(0.85, 0.99), eps=1e-4, weight_decay=0.2),
        lambda: R.RefAdamW(0.01, b1=0.85, b2=0.99, eps=1e-4, weight_decay=0.2),
    ),
    "sgd": (
        lambda ps: torch.optim.SGD(ps, lr=0.05),
        lambda: R.RefSGD(0.05),
    ),
    "sgd_momentum": (
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8),
        lambda: R.RefSGD(0.05, momentum=0.8),
    ),
    "sgd_nesterov": (
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, nesterov=True),
        lambda: R.RefSGD(0.05, momentum=0.8, nesterov=True),
    ),
    "bnb_sgd_wd": (
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.7, weight_decay=0.05),
        lambda: R.RefBnbSGD(0.05, momentum=0.7, weight_decay=0.05),
    ),
    "bnb_sgd_wd_nesterov": (
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.7, weight_decay=0.05, nesterov=True),
        lambda: R.RefBnbSGD(0.05, momentum=0.7, weight_decay=0.05, nesterov=True),
    ),
    "rmsprop_eps_outside": (
        lambda ps: torch.optim.RMSprop(ps, lr=0.01, alpha=0.9, eps=1e-3),
        lambda: R.RefRMSprop(0.01, decay=0.9, eps=1e-3, eps_in_sqrt=False),
    ),
    "rmsprop_momentum": (
        lambda ps: torch.optim.RMSprop(ps, lr=0.01, alpha=0.95, eps=1e-3, momentum=0.6),
        lambda: R.RefRMSprop(0.01, decay=0.95, eps=1e-3, eps_in_sqrt=False, momentum=0.6),
    ),
    "bnb_rmsprop_wd": (
        lambda ps: torch.optim.RMSprop(ps, lr=0.01, alpha=0.9, eps=1e-3, weight_decay=0.1),
        lambda: R.RefBnbRMSprop(0.01, alpha=0.9, eps=1e-3, weight_decay=0.1),
    ),
    "adagrad_eps_outside": (
        lambda ps: torch.optim.Adagrad(ps, lr=0.1, initial_accumulator_value=0.2, eps=1e-3),
        lambda: R.RefBnbAdagrad(0.1, eps=1e-3, initial_accumulator_value=0.2),
    ),
    "bnb_adagrad_wd": (
        lambda ps: torch.optim.Adagrad(ps, lr=0.1, weight_decay=0.1, eps=1e-3),
        lambda: R.RefBnbAdagrad(0.1, eps=1e-3, weight_decay=0.1),
    ),
}

# With eps = 0, "eps inside the sqrt" and "eps outside" coincide, so the optax-style
# variants can be checked against torch too (no exact-zero grads: 0/0 would be NaN on both).
TORCH_CASES_EPS0 = {
    "optax_adagrad_eps0": (
        lambda ps: torch.optim.Adagrad(ps, lr=0.1, initial_accumulator_value=0.2, eps=0.0),
        lambda: R.RefAdagrad(0.1, initial_accumulator_value=0.2, eps=0.0),
    ),
    "rmsprop_eps_in_sqrt_eps0": (
        lambda ps: torch.optim.RMSprop(ps, lr=0.01, alpha=0.9, eps=0.0),
        lambda: R.RefRMSprop(0.01, decay=0.9, eps=0.0, eps_in_sqrt=True),
    ),
}


@pytest.mark.parametrize("name", sorted(TORCH_CASES))
def test_reference_matches_torch_optim(name):
    make_torch, make_ref = TORCH_CASES[name]
    _run_against_torch(make_torch, make_ref())


@pytest.mark.parametrize("name", sorted(TORCH_CASES_EPS0))
def test_reference_matches_torch_optim_eps0(name):
    make_torch, make_ref = TORCH_CASES_EPS0[name]
    _run_against_torch(make_torch, make_ref(), zero_frac=0.0)


def test_comparison_helper_can_fail():
    a = {"x": torch.tensor([1.0, 2.0], dtype=F64)}
    assert R.max_rel_err(a, a, 1e-2) == 0.0
    b = {"x": torch.tensor([1.0, 2.0 + 1e-6], dtype=F64)}
    assert R.max_rel_err(b, a, 1e-2) > 1e-7
    nan = {"x": torch.tensor([1.0, float("nan")], dtype=F64)}
    assert R.max_rel_err(nan, a, 1e-2) == math.inf


# --------------------------------------------------------------------------- hand-computed steps

P = [1.0, -2.0, 0.5]
G1 = [0.3, 0.0, -0.4]
G2 = [-0.1, 0.2, 0.0]


def _t(xs):
    return torch.tensor(xs, dtype=F64)


def _sign(x):
    return (x > 0) - (x < 0)


def _l2(xs):
    return math.sqrt(sum(x * x for x in xs))


def _check(got, expected, tol=1e-14):
    got = got.tolist() if isinstance(got, torch.Tensor) else got
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert abs(a - b) <= tol * max(1.0, abs(b)), (got, expected)


def test_lion_two_steps_by_hand():
    lr, b1, b2, wd = 0.1, 0.9, 0.99, 0.1
    ref = R.RefLion(lr, b1=b1, b2=b2, weight_decay=wd)
    p1 = ref.step({"x": _t(P)}, {"x": _t(G1)})["x"]
    # mu0 = 0 -> c = (1-b1) g -> sign(g); sign(0) = 0 leaves only the decay term.
    exp1 = [1.0 - 0.1 * (1 + 0.1 * 1.0), -2.0 - 0.1 * (0 + 0.1 * -2.0), 0.5 - 0.1 * (-1 + 0.05)]
    _check(p1, exp1)
    _check(p1, [0.89, -1.98, 0.595])
    p2 = ref.step({"x": p1}, {"x": _t(G2)})["x"]
    mu1 = [(1 - b2) * g for g in G1]  # [0.003, 0, -0.004]
    c = [b1 * m + (1 - b1) * g for m, g in zip(mu1, G2)]  # [-0.0073, 0.02, -0.0036]
    assert [_sign(x) for x in c] == [-1, 1, -1]
    exp2 = [p - lr * (_sign(ci) + wd * p) for p, ci in zip(exp1, c)]
    _check(p2, exp2)
    _check(p2, [0.9811, -2.0602, 0.68905])


def test_ademamix_first_step_by_hand():
    lr, b1, b2, b3, alpha, eps, wd = 0.1, 0.9, 0.999, 0.99, 2.0, 1e-3, 0.1
    ref = R.RefAdEMAMix(lr, b1=b1, b2=b2, b3=b3, alpha=alpha, eps=eps, weight_decay=wd)
    p1 = ref.step({"x": _t(P)}, {"x": _t(G1)})["x"]
    # m1_hat = g, m2 = (1-b3) g (not bias-corrected), nu_hat = g^2.
    exp = [p - lr * ((g + alpha * 0.01 * g) / (abs(g) + eps) + wd * p) for p, g in zip(P, G1)]
    _check(p1, exp)
    assert abs(p1[1].item() - (-2.0 - 0.1 * 0.1 * -2.0)) < 1e-15  # g = 0: only the decay
    # second step: m2 keeps no bias correction, m1/nu are corrected with t = 2
    p2 = ref.step({"x": p1}, {"x": _t(G2)})["x"]
    exp2 = []
    for p, ga, gb in zip(p1.tolist(), G1, G2):
        m1 = b1 * (1 - b1) * ga + (1 - b1) * gb
        m2 = b3 * (1 - b3) * ga + (1 - b3) * gb
        nu = b2 * (1 - b2) * ga * ga + (1 - b2) * gb * gb
        u = (m1 / (1 - b1**2) + alpha * m2) / (math.sqrt(nu / (1 - b2**2)) + eps)
        exp2.append(p - lr * (u + wd * p))
    _check(p2, exp2, tol=1e-13)


def test_adam_nesterov_two_steps_by_hand():
    lr, b1, b2, eps = 0.1, 0.9, 0.99, 1e-3
    ref = R.RefAdam(lr, b1=b1, b2=b2, eps=eps, nesterov=True)
    p1 = ref.step({"x": _t([1.0])}, {"x": _t([0.5])})["x"]
    m_hat = 0.9 * 0.05 / (1 - 0.9**2) + 0.1 * 0.5 / (1 - 0.9)
    v_hat = 0.0025 / (1 - 0.99)
    exp1 = 1.0 - lr * m_hat / (math.sqrt(v_hat) + eps)
    _check(p1, [exp1])
    p2 = ref.step({"x": p1}, {"x": _t([-0.2])})["x"]
    mu, nu = 0.9 * 0.05 + 0.1 * -0.2, 0.99 * 0.0025 + 0.01 * 0.04
    m_hat = 0.9 * mu / (1 - 0.9**3) + 0.1 * -0.2 / (1 - 0.9**2)
    v_hat = nu / (1 - 0.99**2)
    _check(p2, [exp1 - lr * m_hat / (math.sqrt(v_hat) + eps)])


def test_lamb_first_step_by_hand():
    lr, eps, wd = 0.1, 1e-3, 0.1
    ref = R.RefLamb(lr, b1=0.9, b2=0.999, eps=eps, weight_decay=wd)
    z_g = [0.5, -1.0]
    out = ref.step({"x": _t(P), "z": _t([0.0, 0.0])}, {"x": _t(G1), "z": _t(z_g)})
    u = [g / (abs(g) + eps) + wd * p for p, g in zip(P, G1)]  # m_hat = g, v_hat = g^2
    ratio = _l2(P) / _l2(u)
    _check(out["x"], [p - lr * ratio * ui for p, ui in zip(P, u)])
    # |p| = 0 -> trust ratio 1
    _check(out["z"], [-lr * g / (abs(g) + eps) for g in z_g])


@pytest.mark.parametrize("nesterov", [False, True])
def test_lars_two_steps_by_hand(nesterov):
    lr, wd, tc, eps, m = 0.5, 0.1, 0.02, 0.01, 0.9
    ref = R.RefLars(lr, weight_decay=wd, trust_coefficient=tc, eps=eps, momentum=m,
                    nesterov=nesterov)
    z_g = [0.5, -1.0]
    out = ref.step({"x": _t(P), "z": _t([0.0, 0.0])}, {"x": _t(G1), "z": _t(z_g)})
    u1 = [g + wd * p for p, g in zip(P, G1)]
    r1 = tc * _l2(P) / (_l2(u1) + eps)
    d1 = [-lr * r1 * x for x in u1]  # tr1 = d1
    k = (1 + m) if nesterov else 1.0
    exp1 = [p + k * d for p, d in zip(P, d1)]
    _check(out["x"], exp1)
    _check(out["z"], [-lr * g * k for g in z_g])  # |p| = 0 -> ratio 1 (not tc)
    p1 = out["x"]
    p2 = ref.step({"x": p1, "z": out["z"]}, {"x": _t(G2), "z": _t(z_g)})["x"]
    u2 = [g + wd * p for p, g in zip(exp1, G2)]
    r2 = tc * _l2(exp1) / (_l2(u2) + eps)
    d2 = [-lr * r2 * x for x in u2]
    tr2 = [a + m * b for a, b in zip(d2, d1)]
    upd = [a + m * b for a, b in zip(d2, tr2)] if nesterov else tr2
    _check(p2, [p + d for p, d in zip(exp1, upd)])


@pytest.mark.parametrize("momentum", [None, 0.7])
def test_rmsprop_initial_scale_eps_in_sqrt_by_hand(momentum):
    lr, decay, eps, s0 = 0.1, 0.9, 1e-2, 1.0
    ref = R.RefRMSprop(lr, decay=decay, eps=eps, initial_scale=s0, eps_in_sqrt=True,
                       momentum=momentum, nesterov=True)
    p1 = ref.step({"x": _t(P)}, {"x": _t(G1)})["x"]
    k = 1.0 if momentum is None else 1 + momentum  # nesterov, tr1 = u1
    _check(p1, [p - k * lr * g / math.sqrt(decay * s0 + (1 - decay) * g * g + eps)
                for p, g in zip(P, G1)])


@pytest.mark.parametrize("iav", [0.0, 0.5])
def test_optax_adagrad_first_step_by_hand(iav):
    lr, eps = 0.1, 1e-2
    ref = R.RefAdagrad(lr, initial_accumulator_value=iav, eps=eps)
    p1 = ref.step({"x": _t(P)}, {"x": _t(G1)})["x"]
    exp = []
    for p, g in zip(P, G1):
        s = iav + g * g
        exp.append(p - lr * (g / math.sqrt(s + eps) if s > 0 else 0.0))
    _check(p1, exp)
    assert bool(torch.isfinite(p1).all())


@pytest.mark.parametrize("max_unorm", [0.1, 100.0])
def test_bnb_lamb_first_step_by_hand(max_unorm):
    lr, eps, wd = 0.1, 1e-3, 0.1
    ref = R.RefBnbLamb(lr, b1=0.9, b2=0.999, eps=eps, weight_decay=wd, max_unorm=max_unorm)
    p1 = ref.step({"x": _t(P)}, {"x": _t(G1)})["x"]
    d = [g / (abs(g) + eps) for g in G1]
    limit = max_unorm * _l2(P)
    clipped = _l2(d) > limit
    assert clipped == (max_unorm == 0.1)
    if clipped:
        d = [x * limit / _l2(d) for x in d]
    _check(p1, [p - lr * (x + wd * p) for p, x in zip(P, d)])


@pytest.mark.parametrize("max_unorm", [0.02, 100.0])
def test_bnb_lars_two_steps_by_hand(max_unorm):
    lr, m, wd = 0.5, 0.9, 0.1
    ref = R.RefBnbLars(lr, momentum=m, weight_decay=wd, max_unorm=max_unorm)
    p1 = ref.step({"x": _t(P)}, {"x": _t(G1)})["x"]

    def clip(u, p):
        lim = max_unorm * _l2(p)
        return [x * lim / _l2(u) for x in u] if _l2(u) > lim else u

    tr1 = [g + wd * p for p, g in zip(P, G1)]
    assert (_l2(tr1) > max_unorm * _l2(P)) == (max_unorm == 0.02)
    exp1 = [p - lr * x for p, x in zip(P, clip(tr1, P))]
    _check(p1, exp1)
    p2 = ref.step({"x": p1}, {"x": _t(G2)})["x"]
    tr2 = [g + wd * p + m * t for p, g, t in zip(exp1, G2, tr1)]  # trace keeps the unclipped tr
    _check(p2, [p - lr * x for p, x in zip(exp1, clip(tr2, exp1))])


def test_trust_ratio_and_clip_edge_cases():
    z, x = _t([0.0, 0.0]), _t([3.0, 4.0])
    assert R.trust_ratio(x, z) == 1.0 and R.trust_ratio(z, x) == 1.0
    assert R.trust_ratio(x, x, trust_coefficient=0.5) == 0.5
    assert R.trust_ratio(_t([0.3, 0.4]), x, min_norm=1.0) == 5.0  # |u| clamped up to 1
    assert R.trust_ratio(x, _t([0.0, 0.1]), min_norm=1.0, eps=1.0) == 1.0 / 6.0
    _check(R.clip_by_param_norm_ratio(x, _t([1.0, 0.0]), 2.0), [1.2, 1.6])
    _check(R.clip_by_param_norm_ratio(x, _t([10.0, 0.0]), 2.0), [3.0, 4.0])
