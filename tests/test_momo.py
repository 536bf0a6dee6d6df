"""MoMo and MoMo-Adam (optax.contrib's ``momo``, ``momo_adam``): each step against float64
math transcribed from optax, from the same state; optax's docstring examples; skip_zeros
exact with its control; the loss' adapted lower bound; bad input; a checkpoint round trip.
(They read the loss as ``value=``, which the registry suites do not pass:
``tests/registry.py::PARAMS_WRAPPERS`` sends them here.)"""

from __future__ import annotations

import io
import math

import pytest
import torch

import ftopt

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = {"w": (6, 5), "b": (5,), "s": ()}
F64 = torch.float64


def _ref_step(kind, state, params, grads, value, lr, b1, b2=0.999, eps=1e-8, lb0=0.0,
              wd=0.0, adapt=False):
    """optax.contrib's update in float64 from ``state``: (updates, new state fields)."""
    k = list(params)
    p = {n: params[n].to(F64) for n in k}
    g = {n: grads[n].to(F64) for n in k}
    count = int(state.count)
    if kind == "momo":
        bt = 0.0 if count == 0 else b1
        bc1 = 1.0
    else:
        bt, bc1 = b1, 1 - b1 ** (count + 1)
    dot = lambda a, b: sum(float((a[n] * b[n]).sum()) for n in k)  # noqa: E731
    barf = bt * float(state.barf) + (1 - bt) * value
    m = {n: bt * state.exp_avg[n].to(F64) + (1 - bt) * g[n] for n in k}
    if kind == "momo":
        d = {n: torch.ones((), dtype=F64) for n in k}
        v = None
    else:
        bc2 = 1 - b2 ** (count + 1)
        v = {n: b2 * state.exp_avg_sq[n].to(F64) + (1 - b2) * g[n] ** 2 for n in k}
        d = {n: eps + (v[n] / bc2).sqrt() for n in k}
    norm = dot(m, {n: m[n] / d[n] for n in k})
    gamma = bt * float(state.gamma) + (1 - bt) * dot(g, p)
    iprod = dot(m, p)
    rho = 1 + lr * wd
    lb = float(state.lb)
    if adapt:
        cap = rho * (barf - gamma) + iprod
        if cap < rho * bc1 * lb:
            lb = max(cap / (2 * bc1 * rho), lb0)
    t1 = max(rho * (barf - bc1 * lb - gamma) + iprod, 0.0) / norm if norm > 2.2e-16 else 0.0
    tau = min(lr / bc1, t1)
    u = {n: -(lr * wd) / rho * p[n] - tau * m[n] / d[n] for n in k}
    new_lb = max(((barf + iprod - gamma) - 0.5 * tau * norm) / bc1, lb0) if adapt \
        else float(state.lb)
    return u, {"exp_avg": m, "exp_avg_sq": v, "barf": barf, "gamma": gamma, "lb": new_lb,
               "tau": tau}


def _draw(seed, steps=6):
    gen = torch.Generator().manual_seed(seed)
    p = {n: torch.randn(s, generator=gen).to(DEVICE) for n, s in SHAPES.items()}
    gs = [{n: torch.randn(s, generator=gen).to(DEVICE) for n, s in SHAPES.items()}
          for _ in range(steps)]
    return p, gs


CASES = {
    "momo": ("momo", dict(lr=1.0, b1=0.9), lambda: ftopt.momo(1.0, 0.9)),
    "momo_wd_adapt": ("momo", dict(lr=0.5, b1=0.8, wd=0.1, adapt=True, lb0=-5.0),
                      lambda: ftopt.momo(0.5, 0.8, lower_bound=-5.0, weight_decay=0.1,
                                         adapt_lower_bound=True)),
    "momo_adam": ("momo_adam", dict(lr=0.05, b1=0.9), lambda: ftopt.momo_adam(0.05)),
    "momo_adam_wd_adapt": ("momo_adam", dict(lr=0.05, b1=0.8, b2=0.99, eps=1e-6, wd=0.1,
                                             adapt=True, lb0=-5.0),
                           lambda: ftopt.momo_adam(0.05, 0.8, 0.99, 1e-6, lower_bound=-5.0,
                                                   weight_decay=0.1, adapt_lower_bound=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_step_matches_float64_from_the_same_state(case):
    kind, kw, make = CASES[case]
    tx = make()
    p, gs = _draw(1)
    state = tx.init(p)
    taus, lbs = [], []
    for t, g in enumerate(gs):
        value = 3.0 - 0.4 * t  # a falling loss: the lower bound's two branches
        want_u, want = _ref_step(kind, state, p, g, value, **kw)
        u, state = tx.update(g, state, p, value=value)
        scale = max(float(want_u[n].abs().max()) for n in SHAPES)
        for n in SHAPES:
            torch.testing.assert_close(u[n].to(F64), want_u[n], rtol=1e-5, atol=1e-6 * scale)
            torch.testing.assert_close(state.exp_avg[n].to(F64), want["exp_avg"][n],
                                       rtol=1e-6, atol=1e-7)
        for name in ("barf", "gamma", "lb"):
            assert math.isclose(float(getattr(state, name)), want[name], rel_tol=1e-5,
                                abs_tol=1e-5), (name, t)
        assert int(state.count) == t + 1
        taus.append(want["tau"])
        lbs.append(float(state.lb))
        p = ftopt.apply_updates(p, u)
    assert max(taus) > 0
    if kw.get("adapt"):  # the bound moved
        assert len(set(lbs)) > 1, lbs


def test_optax_docstring_examples():
    """optax's examples assign the update to the params (``params, opt_state =
    solver.update(...)``); the same loop here prints the same values. (MoMo-Adam's
    0.00029999594 is 1.4e-5 below the exact 0.000299999998: optax rounds 1 − b2ᵗ to fp32,
    1 − fp32(0.999) = 0.00099998713; here it is float64, and the value within 1e-6.)"""
    f = lambda x: float((x**2).sum())  # noqa: E731
    for tx, want in ((ftopt.momo(), [3.5, 0.0, 0.0, 0.0, 0.0]),
                     (ftopt.momo_adam(), [0.00029999594, 0.0, 0.0, 0.0, 0.0])):
        params = torch.tensor([1.0, 2.0, 3.0], device=DEVICE)
        state = tx.init(params)
        got = []
        for _ in range(5):
            params, state = tx.update(2 * params, state, params, value=f(params))
            got.append(f(params))
        assert all(math.isclose(a, b, rel_tol=2e-5, abs_tol=1e-12) for a, b in zip(got, want))
    exact = sum((0.01 * g / (g + 1e-8)) ** 2 for g in (2.0, 4.0, 6.0))
    assert math.isclose(got[0], exact, rel_tol=1e-6)


@pytest.mark.parametrize("name", ["momo", "momo_adam"])
def test_skip_zeros_keeps_params_and_momenta(name):
    p, gs = _draw(2)
    gs[1]["w"][2] = 0.0
    gs[1]["b"][1] = 0.0
    runs = {}
    for skip in (True, False):
        make = getattr(ftopt, name)
        tx = ftopt.chain(make(weight_decay=0.1), ftopt.skip_zeros()) if skip \
            else make(weight_decay=0.1)
        u, s = tx.update(gs[0], tx.init(p), p, value=2.0)
        before = (ftopt.apply_updates(p, u), s)
        u, s = tx.update(gs[1], before[1], before[0], value=1.5)
        runs[skip] = (before, (ftopt.apply_updates(before[0], u), s))
    zero = gs[1]["w"] == 0
    (q0, s0), (q1, s1) = runs[True]
    inner0, inner1 = s0[0], s1[0]
    assert torch.equal(q1["w"][zero], q0["w"][zero])
    assert torch.equal(inner1.exp_avg["w"][zero], inner0.exp_avg["w"][zero])
    if name == "momo_adam":
        assert torch.equal(inner1.exp_avg_sq["w"][zero], inner0.exp_avg_sq["w"][zero])
    assert not torch.equal(q1["w"][~zero], q0["w"][~zero])
    (c0, t0), (c1, t1) = runs[False]  # the control: momentum and decay move them
    assert not torch.equal(c1["w"][zero], c0["w"][zero])
    assert not torch.equal(t1.exp_avg["w"][zero], t0.exp_avg["w"][zero])


def test_bad_input_and_checkpoint():
    p, gs = _draw(3)
    tx = ftopt.momo_adam(0.05)
    state = tx.init(p)
    with pytest.raises(TypeError, match="needs the loss as value="):
        tx.update(gs[0], state, p)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(gs[0], state, value=1.0)
    bad = {**p, "w": torch.zeros(5, 6, device=DEVICE)}
    with pytest.raises(ValueError, match=r"state exp_avg at \['w'\]"):
        tx.update(gs[0], tx.init(bad), p, value=1.0)
    for kw in ({"b1": 1.0}, {"eps": -1.0}, {"weight_decay": -0.1}):
        with pytest.raises(ValueError, match="momo_adam"):
            ftopt.momo_adam(**kw)
    p0 = {n: v.clone() for n, v in p.items()}
    _, state = tx.update(gs[0], state, p, value=1.0)
    assert all(torch.equal(p[n], p0[n]) for n in SHAPES)  # inputs untouched
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    a, _ = tx.update(gs[1], state, p, value=0.5)
    b, _ = tx.update(gs[1], loaded, p, value=0.5)
    assert all(torch.equal(a[n], b[n]) for n in SHAPES)
