"""``sam`` (optax.contrib's SAM): trajectories against float64 math transcribed from optax
(transparent and opaque mode, with and without ``reset_state``), the counter decided on the
device after a checkpoint (bit-identical to the host's choice), ``sync_period=1``,
skip_zeros with its control, purity, errors, ``ftopt.step``, and training sanity.

(Its opaque mode takes ``grad_fn=`` and its outer step moves params where the gradient is
zero: ``tests/registry.py::PARAMS_WRAPPERS`` sends it here.)"""

from __future__ import annotations

import io

import pytest
import torch

import ftopt

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = {"w": (4, 3), "b": (5,)}
F64 = torch.float64
LR, B1, B2, EPS, WD = 0.05, 0.9, 0.99, 1e-8, 0.1
RHO, MOM = 0.05, 0.5


def _tree(gen, scale=1.0):
    return {n: (scale * torch.randn(s, generator=gen)).to(DEVICE) for n, s in SHAPES.items()}


def _f64(tree):
    return {n: v.to(F64).cpu() for n, v in tree.items()}


def _outer():
    return ftopt.adamw(LR, B1, B2, EPS, weight_decay=WD)


def _adv():
    return ftopt.chain(ftopt.normalize_by_update_norm(eps=0.0), ftopt.sgd(RHO, momentum=MOM))


# ---- float64 references (optax's formulas)

def _adamw_init(p):
    return {"t": 0, "mu": {n: torch.zeros_like(v) for n, v in p.items()},
            "nu": {n: torch.zeros_like(v) for n, v in p.items()}}


def _adamw(g, st, p):
    t = st["t"] + 1
    mu = {n: B1 * st["mu"][n] + (1 - B1) * g[n] for n in g}
    nu = {n: B2 * st["nu"][n] + (1 - B2) * g[n] ** 2 for n in g}
    u = {n: -LR * ((mu[n] / (1 - B1 ** t)) / ((nu[n] / (1 - B2 ** t)).sqrt() + EPS)
                   + WD * p[n]) for n in g}
    return u, {"t": t, "mu": mu, "nu": nu}


def _adv_init(p):
    return {n: torch.zeros_like(v) for n, v in p.items()}


def _adv_step(g, tr, p):
    del p
    norm = sum(float((v ** 2).sum()) for v in g.values()) ** 0.5
    tr = {n: g[n] / norm + MOM * tr[n] for n in g}
    return {n: -RHO * tr[n] for n in g}, tr


def _ref_transparent(st, g, p, period, reset):
    """optax's transparent_update_fn, in float64."""
    since = st["since"]
    first, last = since == 0, since == period - 1
    adv_u, adv_state = _adv_step(g, st["adv"], p)
    adv_u = {n: -v for n, v in adv_u.items()}
    opt_u, opt_state = _adamw(g, st["opt"], st["cache"])
    opt_u = {n: st["cache"][n] - p[n] + opt_u[n] for n in g}
    cache = p if first else st["cache"]
    u = opt_u if last else adv_u
    if last:
        adv_state = _adv_init(p) if reset else st["adv"]
    opt_state = opt_state if last else st["opt"]
    return u, {"since": (since + 1) % period, "opt": opt_state, "adv": adv_state,
               "cache": cache}


def _close(a, b, what):
    for n in SHAPES:
        torch.testing.assert_close(a[n].to(F64).cpu(), b[n], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=n: f"{what} at {n}: {m}")


@pytest.mark.parametrize("period,reset", [(2, True), (3, True), (3, False)])
def test_transparent_mode_matches_float64_optax(period, reset):
    gen = torch.Generator().manual_seed(10 + period)
    tx = ftopt.sam(_outer(), _adv(), sync_period=period, reset_state=reset)
    p = _tree(gen)
    state = tx.init(p)
    ref_p = _f64(p)
    ref = {"since": 0, "opt": _adamw_init(ref_p), "adv": _adv_init(ref_p), "cache": ref_p}
    for i in range(4 * period + 1):
        g = _tree(gen)
        want_u, ref = _ref_transparent(ref, _f64(g), ref_p, period, reset)
        u, state = tx.update(g, state, p)
        _close(u, want_u, f"update {i}")
        p = ftopt.apply_updates(p, u)
        ref_p = {n: ref_p[n] + want_u[n] for n in SHAPES}
        _close(p, ref_p, f"params {i}")
        _close(state.cache, ref["cache"], f"cache {i}")
        _close(state.opt_state[0].mu, ref["opt"]["mu"], f"outer mu {i}")
        _close(state.adv_state[1][0].trace, ref["adv"], f"adversarial trace {i}")
        assert int(state.steps_since_sync) == ref["since"] == (i + 1) % period
        assert int(state.opt_state[0].count) == ref["opt"]["t"]


@pytest.mark.parametrize("period,reset", [(2, True), (3, False)])
def test_opaque_mode_matches_float64_optax(period, reset):
    """optax's opaque_update_fn: the adversarial steps and grad_fn's calls inside update."""
    gen = torch.Generator().manual_seed(20 + period)
    target = _tree(gen)
    calls = []

    def grad_fn(q, i):  # the gradient of Σ (q − target)³/3 + q²: not linear in q
        calls.append(i)
        return {n: (q[n] - target[n]) ** 2 + 2 * q[n] for n in SHAPES}

    def ref_grad(q):
        return {n: (q[n] - target[n].to(F64).cpu()) ** 2 + 2 * q[n] for n in SHAPES}

    tx = ftopt.sam(_outer(), _adv(), sync_period=period, reset_state=reset, opaque_mode=True)
    p = _tree(gen)
    state = tx.init(p)
    assert state.cache is None
    ref_p = _f64(p)
    opt, adv = _adamw_init(ref_p), _adv_init(ref_p)
    for step in range(5):
        calls.clear()
        g = grad_fn(p, -1)
        calls.clear()
        adv_p, adv_g = ref_p, ref_grad(ref_p)
        for _ in range(period - 1):
            u, adv = _adv_step(adv_g, adv, adv_p)
            adv_p = {n: adv_p[n] - u[n] for n in SHAPES}
            adv_g = ref_grad(adv_p)
        if reset:
            adv = _adv_init(ref_p)
        want_u, opt = _adamw(adv_g, opt, ref_p)
        u, state = tx.update(g, state, p, grad_fn=grad_fn)
        assert calls == list(range(period - 1))
        _close(u, want_u, f"update {step}")
        _close(state.adv_state[1][0].trace, adv, f"adversarial trace {step}")
        assert int(state.steps_since_sync) == 0
        p = ftopt.apply_updates(p, u)
        ref_p = {n: ref_p[n] + want_u[n] for n in SHAPES}


def test_optax_docstring_example_and_paper_sam():
    """optax's example ``sam(sgd(0.01), chain(normalize(), sgd(0.1)), sync_period=2)``
    (``normalize()`` is ``normalize_by_update_norm(eps=0.0)``): the adversarial step is
    p + 0.1·g/‖g‖, the outer one c − 0.01·g(adversarial point)."""
    gen = torch.Generator().manual_seed(3)
    tx = ftopt.sam(ftopt.sgd(0.01), ftopt.chain(ftopt.normalize_by_update_norm(eps=0.0),
                                                ftopt.sgd(0.1)), sync_period=2)
    p = _tree(gen)
    state = tx.init(p)
    g1, g2 = _tree(gen), _tree(gen)
    u, state = tx.update(g1, state, p)
    norm = sum(float((v.double() ** 2).sum()) for v in g1.values()) ** 0.5
    q = ftopt.apply_updates(p, u)
    _close(q, {n: p[n].double().cpu() + 0.1 * g1[n].double().cpu() / norm for n in SHAPES},
           "adversarial point")
    u, state = tx.update(g2, state, q)
    r = ftopt.apply_updates(q, u)
    _close(r, {n: p[n].double().cpu() - 0.01 * g2[n].double().cpu() for n in SHAPES},
           "outer step")


def test_sync_period_one_is_the_outer_optimizer():
    """(optax's transparent mode reads its cache before refreshing it: with
    ``sync_period=1`` it steps from the previous call's params. ftopt reads the refreshed
    cache: the outer optimizer alone.)"""
    gen = torch.Generator().manual_seed(4)
    tx, plain = ftopt.sam(_outer(), _adv(), sync_period=1), _outer()
    p = _tree(gen)
    s, t = tx.init(p), plain.init(p)
    q = p
    for _ in range(4):
        g = _tree(gen)
        u, s = tx.update(g, s, p)
        v, t = plain.update(g, t, q)
        p, q = ftopt.apply_updates(p, u), ftopt.apply_updates(q, v)
        assert all(torch.equal(p[n], q[n]) for n in SHAPES)


def _bits(tree):
    return [t.clone() for t in ftopt.tree.leaves(tree)]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("period,reset", [(2, True), (3, False)])
def test_counter_unknown_to_the_host_is_decided_on_the_device(period, reset):
    """A checkpoint's counter (torch.load: unknown to the host mirror) runs both inner
    optimizers and selects on the device: bit-identical to the host's choice, step after
    step, and the state round-trips through torch.save."""
    gen = torch.Generator().manual_seed(30 + period)
    tx = ftopt.sam(_outer(), _adv(), sync_period=period, reset_state=reset)
    p = _tree(gen)
    state = tx.init(p)
    for _ in range(period + 1):  # into the middle of a cycle
        u, state = tx.update(_tree(gen), state, p)
        p = ftopt.apply_updates(p, u)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert isinstance(loaded, ftopt.SAMState)
    q = p
    for i in range(2 * period + 1):
        g = _tree(gen)
        u, state = tx.update(g, state, p)
        v, loaded = tx.update(g, loaded, q)
        assert _same(_bits(u), _bits(v)), i
        assert _same(_bits(state), _bits(loaded)), i
        p, q = ftopt.apply_updates(p, u), ftopt.apply_updates(q, v)


def test_inputs_are_not_mutated_and_step_agrees():
    gen = torch.Generator().manual_seed(5)
    for opaque in (False, True):
        tx = ftopt.sam(_outer(), _adv(), sync_period=2, opaque_mode=opaque)
        kw = {"grad_fn": lambda q, i: {n: 2 * q[n] for n in SHAPES}} if opaque else {}
        p = _tree(gen)
        state = tx.init(p)
        for _ in range(3):
            g = _tree(gen)
            before = (_bits(p), _bits(g), _bits(state))
            # (backend="eager", passed on to the inner optimizers: ftopt.step runs an eager
            # wrapper's inner updates eagerly; on a GPU a plain update fuses them)
            u, new_state = tx.update(g, state, p, backend="eager", **kw)
            assert _same(before[0], _bits(p))
            assert _same(before[1], _bits(g)) and _same(before[2], _bits(state))
            if not opaque:  # ftopt.step: the same update, applied (eagerly)
                q, stepped = ftopt.step(tx, p, g, state)
                assert _same(_bits(q), _bits(ftopt.apply_updates(p, u)))
                assert _same(_bits(stepped), _bits(new_state))
            p, state = ftopt.apply_updates(p, u), new_state
        if not opaque:  # the cache is a copy: donating the params leaves it alone
            cache = _bits(state.cache)
            p, state = ftopt.step(tx, p, _tree(gen), state, donate=True)
            p, state = ftopt.step(tx, p, _tree(gen), state, donate=True)
            assert not _same(cache, _bits(state.cache))  # a new cycle cached new params


def test_errors_name_the_argument():
    p = _tree(torch.Generator().manual_seed(6))
    with pytest.raises(ValueError, match="sync_period"):
        ftopt.sam(_outer(), _adv(), sync_period=0)
    with pytest.raises(TypeError, match="sync_period"):
        ftopt.sam(_outer(), _adv(), sync_period=2.5)
    with pytest.raises(ValueError, match="batch_axis_name"):
        ftopt.sam(_outer(), _adv(), batch_axis_name="batch")
    with pytest.raises(TypeError, match="reset_state"):
        ftopt.sam(_outer(), _adv(), reset_state=1)
    with pytest.raises(TypeError, match="opaque_mode"):
        ftopt.sam(_outer(), _adv(), opaque_mode="yes")
    with pytest.raises(TypeError, match="argument optimizer"):
        ftopt.sam(ftopt.adam, _adv())
    with pytest.raises(TypeError, match="argument adv_optimizer"):
        ftopt.sam(_outer(), None)
    opaque = ftopt.sam(_outer(), _adv(), opaque_mode=True)
    with pytest.raises(ValueError, match="grad_fn="):
        opaque.update(p, opaque.init(p), p)
    with pytest.raises(TypeError, match="grad_fn must be a function"):
        opaque.update(p, opaque.init(p), p, grad_fn=3)
    with pytest.raises(ValueError, match=r"grad_fn's gradients \(call 0\)"):
        opaque.update(p, opaque.init(p), p, grad_fn=lambda q, i: {"w": q["w"]})
    tx = ftopt.sam(_outer(), _adv())
    state = tx.init(p)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(p, state)
    with pytest.raises(TypeError, match="expects a SAMState"):
        tx.update(p, state.opt_state, p)
    with pytest.raises(ValueError, match="opaque_mode=False"):
        tx.update(p, opaque.init(p), p)
    bad = state._replace(cache={**state.cache, "b": torch.zeros(4, device=DEVICE)})
    with pytest.raises(ValueError, match=r"state cache at \['b'\]"):
        tx.update(p, bad, p)
    with pytest.raises(ValueError, match=r"update at \['w'\]"):
        tx.update({**p, "w": torch.zeros(3, 4, device=DEVICE)}, state, p)


def _sam_run(tx, p, grads, **kw):
    state = tx.init(p)
    out = []
    for g in grads:
        u, state = tx.update(g, state, p, **kw)
        p = ftopt.apply_updates(p, u)
        out.append((p, state))
    return out


@pytest.mark.parametrize("where", ["outer", "inner"])
def test_skip_zeros(where):
    """An element whose gradient is zero on every call of a cycle keeps its bits (param,
    cache, both optimizers' states); one zero only at the outer call returns to the cache.
    Control: without skip_zeros the same elements move (decay, momentum, the normalized
    adversarial step)."""
    gen = torch.Generator().manual_seed(7)
    p = _tree(gen)
    grads = [_tree(gen) for _ in range(4)]  # two cycles of sync_period=2
    for g in grads[2:]:  # the whole second cycle
        g["w"][1] = 0.0
    grads[3]["b"][:2] = 0.0  # the second cycle's outer call only

    def make(skip):
        if where == "inner":
            return ftopt.sam(ftopt.adamw(LR, B1, B2, EPS, weight_decay=WD, skip_zeros=skip),
                             ftopt.chain(ftopt.normalize_by_update_norm(eps=0.0),
                                         ftopt.sgd(RHO, momentum=MOM),
                                         *([ftopt.skip_zeros()] if skip else [])),
                             reset_state=False)
        tx = ftopt.sam(_outer(), _adv(), reset_state=False)
        return ftopt.chain(tx, ftopt.skip_zeros()) if skip else tx

    def inner(state):  # a chain's state is a plain tuple, SAMState a NamedTuple
        return state[0] if type(state) is tuple else state

    for skip in (True, False):
        runs = _sam_run(make(skip), p, grads)
        (p2, s2), (p4, s4) = runs[1], runs[3]
        s2, s4 = inner(s2), inner(s4)
        zero = grads[2]["w"] == 0
        same = [torch.equal(p4["w"][zero], p2["w"][zero]),
                torch.equal(s4.opt_state[0].mu["w"][zero], s2.opt_state[0].mu["w"][zero]),
                torch.equal(s4.opt_state[0].nu["w"][zero], s2.opt_state[0].nu["w"][zero]),
                torch.equal(s4.adv_state[1][0].trace["w"][zero],
                            s2.adv_state[1][0].trace["w"][zero])]
        if skip:
            assert all(same), same
            assert not torch.equal(p4["w"][~zero], p2["w"][~zero])
            # Zero at the outer call only: back to the cache (the adversarial step moved it).
            q3 = runs[2][0]
            assert not torch.equal(q3["b"][:2], p2["b"][:2])
            torch.testing.assert_close(p4["b"][:2], p2["b"][:2], rtol=0, atol=1e-6)
        else:
            assert not any(same), same


def test_skip_zeros_in_opaque_mode_keeps_everything():
    """Opaque mode: the mask of the gradient passed to update reaches every inner call."""
    gen = torch.Generator().manual_seed(8)
    p = _tree(gen)
    grads = [_tree(gen) for _ in range(3)]
    grads[2]["w"][0] = 0.0

    def grad_fn(q, i):  # nonzero everywhere
        return {n: q[n] + 1.0 for n in SHAPES}

    for skip in (True, False):
        tx = ftopt.sam(_outer(), _adv(), opaque_mode=True, reset_state=False)
        tx = ftopt.chain(tx, ftopt.skip_zeros()) if skip else tx
        runs = _sam_run(tx, p, grads, grad_fn=grad_fn)
        (p2, s2), (p3, s3) = runs[1], runs[2]
        s2, s3 = (s2[0], s3[0]) if skip else (s2, s3)
        zero = grads[2]["w"] == 0
        same = [torch.equal(p3["w"][zero], p2["w"][zero]),
                torch.equal(s3.opt_state[0].mu["w"][zero], s2.opt_state[0].mu["w"][zero]),
                torch.equal(s3.adv_state[1][0].trace["w"][zero],
                            s2.adv_state[1][0].trace["w"][zero])]
        assert all(same) if skip else not any(same), (skip, same)


def _regression(gen):
    x = torch.randn(64, 6, generator=gen).to(DEVICE)
    y = x @ torch.randn(6, generator=gen).to(DEVICE) + 0.1 * torch.randn(64, generator=gen).to(
        DEVICE)

    def loss(p):
        return ((x @ p["w"] + p["b"] - y) ** 2).mean()

    def grad(p, i=0):
        q = {n: v.detach().requires_grad_() for n, v in p.items()}
        return dict(zip(q, torch.autograd.grad(loss(q), list(q.values()))))

    return loss, grad


@pytest.mark.parametrize("opaque", [False, True])
def test_sam_trains_a_regression(opaque):
    """The paper's SAM (normalized-gradient ascent, then SGD) fits a linear regression;
    (optax's test: a parabola reaches its minimum)."""
    gen = torch.Generator().manual_seed(9)
    loss, grad = _regression(gen)
    tx = ftopt.sam(ftopt.sgd(0.05), ftopt.chain(ftopt.normalize_by_update_norm(eps=0.0),
                                                ftopt.sgd(0.01)), opaque_mode=opaque)
    p = {"w": torch.zeros(6, device=DEVICE), "b": torch.zeros((), device=DEVICE)}
    state = tx.init(p)
    start = float(loss(p))
    kw = {"grad_fn": grad} if opaque else {}
    for _ in range(300):
        u, state = tx.update(grad(p), state, p, **kw)
        p = ftopt.apply_updates(p, u)
    assert float(loss(p)) < 0.05 * start
    target = torch.tensor([1.0, -1.0, 1.0], device=DEVICE)  # optax's parabola
    q = {"x": torch.tensor([-1.0, 10.0, 1.0], device=DEVICE)}
    tx = ftopt.sam(ftopt.sgd(0.1), ftopt.chain(ftopt.normalize_by_update_norm(eps=0.0),
                                               ftopt.adam(1e-4)), opaque_mode=opaque)
    state = tx.init(q)
    kw = {"grad_fn": lambda r, i: {"x": 2 * (r["x"] - target)}} if opaque else {}
    for _ in range(200):
        u, state = tx.update({"x": 2 * (q["x"] - target)}, state, q, **kw)
        q = ftopt.apply_updates(q, u)
    torch.testing.assert_close(q["x"], target, rtol=3e-2, atol=3e-2)
