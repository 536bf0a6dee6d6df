"""``mechanize`` (optax.contrib's Mechanic): each step against float64 math transcribed from
optax from the same state, optax's own test reproduced, x0 taken at the first step, the
first-step choice made on the device for a counter the host does not know, skip_zeros
(refused outside, held by the base optimizer's states inside, with its control), ``None``
gradients, purity, errors, a checkpoint round trip, and training sanity.

(Its params move where the gradient is zero, so §3's suites cannot drive it:
``tests/registry.py::PARAMS_WRAPPERS`` sends it here.)"""

from __future__ import annotations

import io
import math

import pytest
import torch

import ftopt

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = {"w": (5, 4), "b": (4,), "s": ()}
F64 = torch.float64


def _tree(gen, scale=1.0, dtype=torch.float32):
    return {n: (scale * torch.randn(s, generator=gen, dtype=F64)).to(DEVICE, dtype)
            for n, s in SHAPES.items()}


def _f64(tree):
    return {n: v.to(F64).cpu() for n, v in tree.items()}


def _sgd_momentum(g, base_state, count):
    """ftopt.sgd(0.1, momentum=0.9) in float64 from its state."""
    del count
    tr = {n: g[n] + 0.9 * base_state[0].trace[n].to(F64).cpu() for n in g}
    return {n: -0.1 * tr[n] for n in g}


def _adam(g, base_state, count, lr=0.01):
    """ftopt.adam(lr) in float64 from its state."""
    t = count + 1
    mu = {n: 0.9 * base_state[0].mu[n].to(F64).cpu() + 0.1 * g[n] for n in g}
    nu = {n: 0.999 * base_state[0].nu[n].to(F64).cpu() + 0.001 * g[n] ** 2 for n in g}
    return {n: -lr * (mu[n] / (1 - 0.9 ** t)) / ((nu[n] / (1 - 0.999 ** t)).sqrt() + 1e-8)
            for n in g}


def _ref_step(state, p, g, base_u, wd, eps, s_init, num_betas):
    """optax.contrib's mechanize update in float64 from ``state``."""
    dot = lambda a, b: sum(float((a[n] * b[n]).sum()) for n in a)  # noqa: E731
    x0 = p if int(state.count) == 0 else _f64(state.x0)
    m, v, r, s = (getattr(state, k).to(F64).cpu() for k in "mvrs")
    s_sum = float(s.sum())
    decay = wd * s_sum * math.sqrt(dot(g, g)) / (math.sqrt(dot(p, p)) + eps)
    gh = {n: g[n] + decay * p[n] for n in g}
    delta_prev = {n: (x0[n] - p[n]) / (s_sum + eps) for n in g}
    delta = {n: delta_prev[n] - base_u[n] for n in g}
    h = dot(gh, delta_prev)
    clipped = torch.clamp(torch.full_like(m, h), -m, m)
    betas = torch.tensor([1.0 - 0.1 ** i for i in range(1, num_betas + 1)], dtype=F64)
    new_m = torch.maximum(betas * m, torch.full_like(m, abs(h) + eps))
    new_v = betas ** 2 * v + h ** 2
    new_r = betas * r + clipped * s
    new_s = ((s_init / num_betas) * new_m + new_r.clamp(min=0.0)) / (new_v.sqrt() + eps)
    u = {n: x0[n] - float(new_s.sum()) * delta[n] - p[n] for n in g}
    return u, {"m": new_m, "v": new_v, "r": new_r, "s": new_s, "x0": x0, "h": h}


CASES = {
    "sgd_momentum_defaults": (lambda: ftopt.sgd(0.1, momentum=0.9), _sgd_momentum,
                              dict(wd=1e-2, eps=1e-8, s_init=1e-6, num_betas=6)),
    "adam_wide": (lambda: ftopt.adam(0.01), _adam,
                  dict(wd=0.1, eps=1e-6, s_init=1e-2, num_betas=3)),
}


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_each_step_matches_float64_from_the_same_state(case, dtype):
    """float64 params: the update itself, tightly. float32 params: the update is new − p,
    a difference of two params (optax's form), so it is exact to p's rounding only: the
    new params are compared (and the scalars, whose sums round in fp32)."""
    make_base, base_ref, kw = CASES[case]
    tx = ftopt.mechanize(make_base(), weight_decay=kw["wd"], eps=kw["eps"],
                         s_init=kw["s_init"], num_betas=kw["num_betas"])
    gen = torch.Generator().manual_seed(11)
    p = _tree(gen, dtype=dtype)
    state = tx.init(p)
    assert state.s.dtype == (F64 if dtype == F64 else torch.float32)
    drift = _tree(gen, dtype=dtype)  # a steady direction: progress, so the wealth grows
    hs = []
    for t in range(8):
        g = {n: v + 0.5 * drift[n] for n, v in _tree(gen, dtype=dtype).items()}
        base_u = base_ref(_f64(g), state.base_optimizer_state, int(state.count))
        want_u, want = _ref_step(state, _f64(p), _f64(g), base_u, **kw)
        u, state = tx.update(g, state, p)
        scale = max(float(want_u[n].abs().max()) for n in SHAPES)
        for n in SHAPES:
            if dtype == F64:
                torch.testing.assert_close(u[n].cpu(), want_u[n], rtol=1e-9,
                                           atol=1e-12 * scale)
            else:
                torch.testing.assert_close((p[n] + u[n]).to(F64).cpu(),
                                           p[n].to(F64).cpu() + want_u[n], rtol=1e-6,
                                           atol=1e-6)
            torch.testing.assert_close(state.x0[n].to(F64).cpu(), want["x0"][n])
        rtol = 1e-9 if dtype == F64 else 1e-4
        for k in "mvrs":
            torch.testing.assert_close(getattr(state, k).to(F64).cpu(), want[k], rtol=rtol,
                                       atol=1e-15, msg=lambda m, k=k, t=t: f"{k} {t}: {m}")
        assert int(state.count) == t + 1
        hs.append(want["h"])
        p = ftopt.apply_updates(p, u)
    assert any(h != 0 for h in hs) and float(state.r.max()) > 0  # the wealth grew


def _test_optimizer(step_size):
    """optax's test inner optimizer: step_size·u, summing the updates in its state."""
    def init(params):
        return (ftopt.tree.zeros_like(params),)

    def update(updates, state, params=None, **extra):
        assert ftopt.tree.structure(updates) == ftopt.tree.structure(params)
        total = ftopt.tree.map(lambda a, b: a + b, state[0], updates)
        return ftopt.tree.map(lambda u: step_size * u, updates), (total,)

    return ftopt.GradientTransformation(init, update)


def test_optax_test_mechanized():
    """optax's ``test_mechanized``: after one step m = 1e-10, v = 0, s = 1.6666667e-09 for
    each of 6 betas, and the params are (almost) where they were."""
    params = {"x": torch.tensor(3.0, device=DEVICE), "y": torch.tensor(-3.0, device=DEVICE)}
    grads = {"x": torch.tensor(2.0, device=DEVICE), "y": torch.tensor(-2.0, device=DEVICE)}
    tx = ftopt.mechanize(_test_optimizer(-0.1), weight_decay=1e-2, eps=1e-10, s_init=1e-8,
                         num_betas=6)
    state = tx.init(params)
    u, state = tx.update(grads, state, params)
    final = ftopt.apply_updates(params, u)
    torch.testing.assert_close(state.m.cpu(), torch.full((6,), 1.0e-10))
    torch.testing.assert_close(state.v.cpu(), torch.zeros(6))
    torch.testing.assert_close(state.s.cpu(), torch.full((6,), 1.6666667e-09))
    for n in params:
        torch.testing.assert_close(final[n], params[n])
    assert all(bool(torch.isfinite(t).all()) for t in ftopt.tree.leaves((final, state)))


def test_x0_is_the_first_steps_params_and_a_checkpoint_decides_on_the_device():
    """x0 is taken at the first update (a model loaded after init counts, as optax); a
    state loaded from a checkpoint (its count unknown to the host) picks x0 on the device,
    bit-identical to the host's choice, at the first step and later."""
    gen = torch.Generator().manual_seed(12)
    tx = ftopt.mechanize(ftopt.adam(1.0))
    p_init, p = _tree(gen), _tree(gen)
    fresh = tx.init(p_init)
    for steps in (0, 3):
        state, q = fresh, p
        for _ in range(steps):
            u, state = tx.update(_tree(gen), state, q)
            q = ftopt.apply_updates(q, u)
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=True)
        assert isinstance(loaded, ftopt.MechanicState)
        r = q
        for _ in range(3):
            g = _tree(gen)
            a, state = tx.update(g, state, q)
            b, loaded = tx.update(g, loaded, r)
            assert all(torch.equal(x, y) for x, y in zip(ftopt.tree.leaves((a, state)),
                                                        ftopt.tree.leaves((b, loaded))))
            q, r = ftopt.apply_updates(q, a), ftopt.apply_updates(r, b)
        if steps == 0:
            assert all(torch.equal(state.x0[n], p[n]) for n in SHAPES)
            assert not any(torch.equal(state.x0[n], p_init[n]) for n in ("w", "b"))


def test_inputs_untouched_none_leaves_and_step():
    gen = torch.Generator().manual_seed(13)
    tx = ftopt.mechanize(ftopt.sgd(1.0, momentum=0.9))
    p = _tree(gen)
    state = tx.init(p)
    for _ in range(3):
        g = _tree(gen)
        g["b"] = None  # no gradient: left out of the sums, does not move
        before = [t.clone() for t in ftopt.tree.leaves((p, g, state))]
        u, new_state = tx.update(g, state, p)
        after = ftopt.tree.leaves((p, g, state))
        assert all(torch.equal(x, y) for x, y in zip(before, after))
        assert u["b"] is None
        q, stepped = ftopt.step(tx, p, g, state)
        assert all(torch.equal(x, y) for x, y in zip(
            ftopt.tree.leaves((q, stepped)),
            ftopt.tree.leaves((ftopt.apply_updates(p, u), new_state))))
        assert torch.equal(q["b"], p["b"])
        p, state = q, new_state
    assert not torch.equal(state.x0["w"], p["w"])
    assert state.x0["w"] is not p["w"]


def test_skip_zeros():
    """An outer skip_zeros cannot hold (the scale moves every param along x0 − p): refused.
    A base optimizer with skip_zeros keeps its states' bits where the gradient is zero
    (control: without it they move); the param there moves by the learned scale, as the
    float64 reference says, except while it sits at x0."""
    gen = torch.Generator().manual_seed(14)
    p = _tree(gen, dtype=F64)
    with pytest.raises(ValueError, match="skip_zeros"):
        tx = ftopt.chain(ftopt.mechanize(ftopt.adam(1.0)), ftopt.skip_zeros())
        tx.update(_tree(gen, dtype=F64), tx.init(p), p)
    grads = [_tree(gen, dtype=F64) for _ in range(4)]
    for g in grads:
        g["w"][0] = 0.0  # zero at every step: stays at x0
    grads[3]["w"][1] = 0.0  # zero at the last step only
    for skip in (True, False):
        tx = ftopt.mechanize(ftopt.adam(1.0, skip_zeros=skip))
        state, q = tx.init(p), p
        for g in grads[:3]:
            u, state = tx.update(g, state, q)
            q = ftopt.apply_updates(q, u)
        base_u = _adam(_f64(grads[3]), state.base_optimizer_state, int(state.count), 1.0)
        u, new = tx.update(grads[3], state, q)
        zero = grads[3]["w"] == 0
        mu, nu = state.base_optimizer_state[0].mu["w"], state.base_optimizer_state[0].nu["w"]
        new_mu = new.base_optimizer_state[0].mu["w"]
        new_nu = new.base_optimizer_state[0].nu["w"]
        kept = [torch.equal(new_mu[zero], mu[zero]), torch.equal(new_nu[zero], nu[zero])]
        if skip:
            assert all(kept)
            masked = {**base_u, "w": torch.where(zero.cpu(), 0.0, base_u["w"])}
            want_u, _ = _ref_step(state, _f64(q), _f64(grads[3]), masked, wd=1e-2, eps=1e-8,
                                  s_init=1e-6, num_betas=6)
            torch.testing.assert_close(u["w"].cpu(), want_u["w"], rtol=1e-9, atol=1e-15)
            assert float(u["w"][1].abs().max()) > 0  # moved with the scale
            assert torch.equal(ftopt.apply_updates(q, u)["w"][0], p["w"][0])  # at x0
        else:
            assert not any(kept)


def test_errors_name_the_argument():
    gen = torch.Generator().manual_seed(15)
    p = _tree(gen)
    for kw, name in (({"weight_decay": -1.0}, "weight_decay"), ({"eps": -1e-8}, "eps"),
                     ({"s_init": 0.0}, "s_init"), ({"num_betas": 0}, "num_betas"),
                     ({"weight_decay": float("nan")}, "weight_decay")):
        with pytest.raises(ValueError, match=name):
            ftopt.mechanize(ftopt.sgd(1.0), **kw)
    with pytest.raises(TypeError, match="num_betas"):
        ftopt.mechanize(ftopt.sgd(1.0), num_betas=2.0)
    with pytest.raises(TypeError, match="base_optimizer"):
        ftopt.mechanize(ftopt.sgd)
    tx = ftopt.mechanize(ftopt.sgd(1.0))
    state = tx.init(p)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(p, state)
    with pytest.raises(TypeError, match="expects a MechanicState"):
        tx.update(p, state.base_optimizer_state, p)
    with pytest.raises(ValueError, match=r"state.s must be a tensor of shape \(6,\)"):
        tx.update(p, state._replace(s=torch.ones(3)), p)
    with pytest.raises(ValueError, match=r"state x0 at \['w'\]"):
        tx.update(p, state._replace(x0={**state.x0, "w": torch.zeros(4, 5)}), p)
    with pytest.raises(ValueError, match=r"update at \['b'\]"):
        tx.update({**p, "b": torch.zeros(3, device=DEVICE)}, state, p)


def _regression(gen):
    x = torch.randn(64, 6, generator=gen).to(DEVICE)
    y = x @ torch.randn(6, generator=gen).to(DEVICE) + 0.1 * torch.randn(64, generator=gen).to(
        DEVICE)

    def loss(p):
        return ((x @ p["w"] + p["b"] - y) ** 2).mean()

    def grad(p):
        q = {n: v.detach().requires_grad_() for n, v in p.items()}
        return dict(zip(q, torch.autograd.grad(loss(q), list(q.values()))))

    return loss, grad


@pytest.mark.parametrize("base", ["sgd", "adam"])
def test_mechanic_learns_the_scale_of_a_regression(base):
    """With the base learning rate left at 1, Mechanic's scale grows from s_init = 1e-6 to
    a step that fits a linear regression."""
    loss, grad = _regression(torch.Generator().manual_seed(9))
    tx = ftopt.mechanize(getattr(ftopt, base)(1.0))
    p = {"w": torch.zeros(6, device=DEVICE), "b": torch.zeros((), device=DEVICE)}
    state = tx.init(p)
    start = float(loss(p))
    for _ in range(300):
        u, state = tx.update(grad(p), state, p)
        p = ftopt.apply_updates(p, u)
    assert float(loss(p)) < 0.01 * start
    assert float(state.s.sum()) > 1e3 * 6e-6
