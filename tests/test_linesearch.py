"""The line searches (optax's ``scale_by_backtracking_linesearch``,
``scale_by_zoom_linesearch``) and ``value_and_grad_from_state``: optax's docstring
examples, the conditions each search promises (Armijo; strong Wolfe) checked at the step it
returns, steps derived by hand on quadratics (interval search, quadratic interpolation, the
step cap), failure into a NaN region, errors naming what ``update`` needs, skip_zeros
(honoured by the backtracking search without a stored gradient, refused with one), purity
and a checkpoint round trip."""

from __future__ import annotations

import io
import math

import pytest
import torch

import ftopt

F64 = torch.float64


def _l2(params, x, y):
    return 0.5 * (x.dot(params) - y) ** 2


def _sq(x):
    return (x ** 2).sum()


def _fmt(x) -> str:
    return f"{float(x):.2E}"


@pytest.mark.parametrize("make,want", [
    (lambda: ftopt.scale_by_backtracking_linesearch(max_backtracking_steps=15),
     ["3.86E+01", "2.50E+01", "1.34E+01", "5.87E+00", "5.81E+00"]),
    (lambda: ftopt.scale_by_zoom_linesearch(max_linesearch_steps=15),
     ["2.56E-13", "2.84E-14", "0.00E+00", "0.00E+00", "0.00E+00"]),
], ids=["backtracking", "zoom"])
def test_optax_docstring_examples_with_data(make, want):
    """optax's examples: ``value_fn`` takes data as keywords of ``update``."""
    solver = ftopt.chain(ftopt.sgd(learning_rate=1.0), make())
    params = torch.tensor([1.0, 2.0, 3.0])
    state = solver.init(params)
    x, y = torch.tensor([3.0, 2.0, 1.0]), torch.tensor(0.0)
    assert _fmt(_l2(params, x, y)) == "5.00E+01"
    printed = []
    for _ in range(5):
        p = params.clone().requires_grad_(True)
        value = _l2(p, x, y)
        (grad,) = torch.autograd.grad(value, p)
        updates, state = solver.update(grad, state, params, value=value.detach(), grad=grad,
                                       value_fn=_l2, x=x, y=y)
        params = ftopt.apply_updates(params, updates)
        printed.append(_fmt(_l2(params, x, y)))
    assert printed == want


@pytest.mark.parametrize("make,want", [
    (lambda: ftopt.scale_by_backtracking_linesearch(max_backtracking_steps=15,
                                                    store_grad=True),
     ["5.04E+00", "1.81E+00", "6.53E-01", "2.35E-01", "8.47E-02"]),
    (lambda: ftopt.scale_by_zoom_linesearch(max_linesearch_steps=15), ["0.00E+00"] * 5),
], ids=["backtracking", "zoom"])
def test_optax_docstring_examples_reusing_the_state(make, want):
    solver = ftopt.chain(ftopt.sgd(learning_rate=1.0), make())
    params = torch.tensor([1.0, 2.0, 3.0])
    state = solver.init(params)
    value_and_grad = ftopt.value_and_grad_from_state(_sq)
    printed = []
    for _ in range(5):
        value, grad = value_and_grad(params, state=state)
        updates, state = solver.update(grad, state, params, value=value, grad=grad,
                                       value_fn=_sq)
        params = ftopt.apply_updates(params, updates)
        printed.append(_fmt(_sq(params)))
    assert printed == want


def _rosen(t):
    x = torch.cat([t["a"].reshape(-1), t["b"]])
    return (100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2).sum()


def _problem(seed):
    """A tree point, the objective's value and gradient there, a descent direction (the
    negative gradient, or a random one turned downhill)."""
    gen = torch.Generator().manual_seed(seed)
    p = {"a": torch.randn(2, 2, generator=gen, dtype=F64),
         "b": torch.randn(3, generator=gen, dtype=F64)}
    value, grad = ftopt.linesearch.value_and_grad(_rosen, p)
    d = {k: torch.randn(v.shape, generator=gen, dtype=F64) for k, v in p.items()}
    if seed % 2 == 0:
        d = {k: -grad[k] for k in p}
    elif sum(float((d[k] * grad[k]).sum()) for k in p) > 0:
        d = {k: -v for k, v in d.items()}
    return p, value, grad, d


def _slope(grad, d):
    return sum(float((grad[k] * d[k]).sum()) for k in d)


@pytest.mark.parametrize("seed", range(6))
def test_backtracking_step_is_the_first_with_sufficient_decrease(seed):
    p, value, grad, d = _problem(seed)
    c, delta = 1e-4, 0.5
    tx = ftopt.scale_by_backtracking_linesearch(30, slope_rtol=c, decrease_factor=delta,
                                                max_learning_rate=4.0)
    u, state = tx.update(d, tx.init(p), p, value=value, grad=grad, value_fn=_rosen)
    eta = float(state.learning_rate)
    k = round(math.log(eta / 1.5) / math.log(delta))  # η₀ = min(1.5·1, 4) = 1.5
    assert eta == pytest.approx(1.5 * delta ** k, rel=1e-12) and 0 <= k <= 30
    f = lambda e: float(_rosen({n: p[n] + e * d[n] for n in p}))  # noqa: E731
    slope = _slope(grad, d)
    assert f(eta) <= float(value) + eta * c * slope  # Armijo
    if k > 0:  # the trial before failed it
        assert f(eta / delta) > float(value) + eta / delta * c * slope
    assert int(state.info.num_linesearch_steps) == k + 1
    assert float(state.info.decrease_error) == 0.0
    assert float(state.value) == pytest.approx(f(eta), rel=1e-12)
    for n in p:
        torch.testing.assert_close(u[n], eta * d[n], rtol=1e-15, atol=0)
    # the next search starts from min(increase_factor·η, max_learning_rate)
    _, state2 = tx.update(d, state, p, value=value, grad=grad, value_fn=_rosen)
    eta2 = float(state2.learning_rate)
    k2 = round(math.log(eta2 / min(1.5 * eta, 4.0)) / math.log(delta))
    assert eta2 == pytest.approx(min(1.5 * eta, 4.0) * delta ** k2, rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_zoom_step_satisfies_the_strong_wolfe_conditions(seed):
    p, value, grad, d = _problem(seed)
    c1, c2 = 1e-4, 0.9
    tx = ftopt.scale_by_zoom_linesearch(30, slope_rtol=c1, curv_rtol=c2,
                                        approx_dec_rtol=None, initial_guess_strategy="one")
    u, state = tx.update(d, tx.init(p), p, value=value, grad=grad, value_fn=_rosen)
    eta = float(state.learning_rate)
    q = {n: p[n] + eta * d[n] for n in p}
    v_new, g_new = ftopt.linesearch.value_and_grad(_rosen, q)
    slope0 = _slope(grad, d)
    assert eta > 0
    assert float(v_new) <= float(value) + c1 * eta * slope0
    assert abs(_slope(g_new, d)) <= c2 * abs(slope0)
    assert float(state.info.decrease_error) == 0.0 and float(state.info.curvature_error) == 0
    assert float(state.value) == pytest.approx(float(v_new), rel=1e-12)
    for n in p:  # the state keeps f and ∇f at the new params
        torch.testing.assert_close(state.grad[n], g_new[n], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(u[n], eta * d[n], rtol=1e-15, atol=0)


def _quadratic_line(eta_star):
    """f(w) = ½‖w − w*‖² from w = 0 along u = w*/η*: φ(η) = ½‖w*‖²(1 − η/η*)², whose
    slope is φ'(0)·(1 − η/η*)."""
    w_star = torch.tensor([1.0, -2.0, 0.5], dtype=F64)
    p = torch.zeros(3, dtype=F64)
    fn = lambda w: 0.5 * ((w - w_star) ** 2).sum()  # noqa: E731
    value, grad = ftopt.linesearch.value_and_grad(fn, p)
    return p, value, grad, w_star / eta_star, fn


@pytest.mark.parametrize("eta_star,max_lr,want,steps,curv_ok", [
    (0.3, None, 0.3, 2, True),  # 1 overshoots: high = 1; the quadratic's minimum exactly
    (3.0, None, 1.0, 1, True),  # |φ'(1)| = (2/3)|φ'(0)| <= 0.9|φ'(0)|: done at once
    (30.0, None, 4.0, 3, True),  # 1, 2 too flat (|φ'| > 0.9|φ'(0)|), 4 is not
    (30.0, 2.0, 2.0, 2, False),  # capped at 2 with no interval: take it, curvature unmet
])
def test_zoom_steps_derived_by_hand(eta_star, max_lr, want, steps, curv_ok):
    p, value, grad, d, fn = _quadratic_line(eta_star)
    tx = ftopt.scale_by_zoom_linesearch(15, max_learning_rate=max_lr,
                                        initial_guess_strategy="one")
    _, state = tx.update(d, tx.init(p), p, value=value, grad=grad, value_fn=fn)
    assert float(state.learning_rate) == pytest.approx(want, rel=1e-12)
    assert int(state.info.num_linesearch_steps) == steps
    assert (float(state.info.curvature_error) == 0.0) == curv_ok


def test_zoom_keep_strategy_and_cubic_zoom():
    """``"keep"`` starts from the last step; on a quartic the zoom interpolates (the
    steps it takes are strictly inside the interval, not the bisection's midpoint)."""
    fn = lambda w: (w ** 4).sum() + (w ** 2).sum()  # noqa: E731
    p = torch.tensor([1.0, -0.5], dtype=F64)
    value, grad = ftopt.linesearch.value_and_grad(fn, p)
    d = -grad
    tx = ftopt.scale_by_zoom_linesearch(20, curv_rtol=0.1)
    _, s1 = tx.update(d, tx.init(p), p, value=value, grad=grad, value_fn=fn)
    eta = float(s1.learning_rate)
    assert 0 < eta < 1 and int(s1.info.num_linesearch_steps) >= 2
    assert eta not in (0.5, 0.25, 0.75)
    phi1 = lambda e: float(ftopt.linesearch.dot(  # noqa: E731
        [ftopt.linesearch.value_and_grad(fn, p + e * d)[1]], [d]))
    assert abs(phi1(eta)) <= 0.1 * abs(float((grad * d).sum()))
    seen = []
    tx_keep = ftopt.scale_by_zoom_linesearch(1, initial_guess_strategy="keep")
    state = tx_keep.init(p)._replace(learning_rate=torch.tensor(0.125, dtype=F64))
    _, s2 = tx_keep.update(d, state, p, value=value, grad=grad,
                           value_fn=lambda w: seen.append(float(w[0])) or fn(w))
    assert seen[0] == pytest.approx(float(p[0] + 0.125 * d[0]), rel=1e-14)


@pytest.mark.parametrize("kind", ["backtracking", "zoom"])
def test_no_step_into_nan(kind):
    """Every trial gives NaN: the step is 0 and the update zero."""
    p = torch.tensor([1.0, 2.0])
    fn = lambda w: torch.where((w - p).abs().sum() > 0, torch.nan, _sq(w))  # noqa: E731
    tx = (ftopt.scale_by_backtracking_linesearch(5) if kind == "backtracking"
          else ftopt.scale_by_zoom_linesearch(5))
    u, state = tx.update(-2 * p, tx.init(p), p, value=_sq(p), grad=2 * p, value_fn=fn)
    assert float(state.learning_rate) == 0.0
    assert torch.equal(u, torch.zeros(2))
    assert math.isinf(float(state.info.decrease_error))


@pytest.mark.parametrize("make", [
    lambda: ftopt.scale_by_backtracking_linesearch(5),
    lambda: ftopt.scale_by_zoom_linesearch(5)], ids=["backtracking", "zoom"])
def test_errors_name_what_update_needs(make):
    tx = make()
    p = {"w": torch.ones(3)}
    s = tx.init(p)
    fn = lambda t: _sq(t["w"])  # noqa: E731
    with pytest.raises(TypeError, match=r"needs value=.*grad=.*value_fn=.*missing: value, "
                       r"grad, value_fn"):
        tx.update(p, s, p)
    with pytest.raises(TypeError, match="missing: value_fn"):
        tx.update(p, s, p, value=3.0, grad=p)
    with pytest.raises(TypeError, match=r"not consumed by `value_fn`: \['batch'\]"):
        tx.update(p, s, p, value=3.0, grad=p, value_fn=fn, batch=1)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(p, s, value=3.0, grad=p, value_fn=fn)
    with pytest.raises(ValueError, match=r"grad does not match the params tree"):
        tx.update(p, s, p, value=3.0, grad={"v": torch.ones(3)}, value_fn=fn)
    with pytest.raises(TypeError, match="must return a scalar"):
        tx.update({"w": -p["w"]}, s, p, value=3.0, grad=p, value_fn=lambda t: t["w"])


def test_hyperparameter_errors():
    with pytest.raises(ValueError, match="initial_guess_strategy"):
        ftopt.scale_by_zoom_linesearch(5, initial_guess_strategy="two")
    with pytest.raises(ValueError, match="max_linesearch_steps"):
        ftopt.scale_by_zoom_linesearch(-1)
    with pytest.raises(TypeError, match="max_backtracking_steps"):
        ftopt.scale_by_backtracking_linesearch(2.5)
    with pytest.raises(ValueError, match="decrease_factor"):
        ftopt.scale_by_backtracking_linesearch(5, decrease_factor=-0.5)


def test_skip_zeros():
    """Without a stored gradient the backtracking search keeps only scalars and honours
    skip_zeros; a stored gradient (``store_grad``, the zoom search) is refused."""
    p = {"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(5))}
    fn = lambda t: _sq(t["w"] - 1.0)  # noqa: E731
    value, grad = ftopt.linesearch.value_and_grad(fn, p)
    grad["w"][1] = 0.0
    runs = {}
    for skip in (True, False):
        parts = [ftopt.sgd(1.0, momentum=0.9),
                 ftopt.scale_by_backtracking_linesearch(10)]
        tx = ftopt.chain(*parts, ftopt.skip_zeros()) if skip else ftopt.chain(*parts)
        state = tx.init(p)
        u, state = tx.update({"w": torch.ones(4, 3)}, state, p, value=fn(p),
                             grad={"w": torch.ones(4, 3)}, value_fn=fn)
        q = ftopt.apply_updates(p, u)
        u, state2 = tx.update(grad, state, q, value=fn(q), grad=grad, value_fn=fn)
        runs[skip] = (q, ftopt.apply_updates(q, u), state, state2)
    q, q2, s, s2 = runs[True]
    assert torch.equal(q2["w"][1], q["w"][1])
    assert torch.equal(s2[0][0].trace["w"][1], s[0][0].trace["w"][1])
    assert not torch.equal(q2["w"][0], q["w"][0])
    q, q2, _, _ = runs[False]  # the control: momentum moves them
    assert not torch.equal(q2["w"][1], q["w"][1])
    for ls in (ftopt.scale_by_backtracking_linesearch(10, store_grad=True),
               ftopt.scale_by_zoom_linesearch(10)):
        tx = ftopt.chain(ftopt.sgd(1.0), ls, ftopt.skip_zeros())
        with pytest.raises(ValueError, match="cannot honour skip_zeros"):
            tx.update(grad, tx.init(p), p, value=value, grad=grad, value_fn=fn)


def test_value_and_grad_from_state():
    fn = lambda t, scale=1.0: scale * _sq(t["w"])  # noqa: E731
    vg = ftopt.value_and_grad_from_state(fn)
    p = {"w": torch.tensor([1.0, -2.0])}
    tx = ftopt.chain(ftopt.sgd(0.1), ftopt.scale_by_zoom_linesearch(10))
    state = tx.init(p)
    value, grad = vg(p, state=state, scale=2.0)  # the stored value is inf: computed
    assert float(value) == 10.0 and torch.equal(grad["w"], torch.tensor([4.0, -8.0]))
    _, state = tx.update(grad, state, p, value=value, grad=grad, value_fn=fn, scale=2.0)
    value2, grad2 = vg(p, state=state)  # now read from the state
    assert value2 is state[1].value and grad2 is state[1].grad
    with pytest.raises(ValueError, match="not found in the state"):
        vg(p, state=ftopt.scale_by_backtracking_linesearch(3).init(p))
    with pytest.raises(KeyError, match="found 2 'value'"):
        vg(p, state=(state, state))


@pytest.mark.parametrize("make", [
    lambda: ftopt.scale_by_backtracking_linesearch(8, store_grad=True),
    lambda: ftopt.scale_by_zoom_linesearch(8)], ids=["backtracking", "zoom"])
def test_purity_and_checkpoint(make):
    tx = make()
    p, value, grad, d = _problem(7)
    state = tx.init(p)
    snap = [t.clone() for t in ftopt.tree.leaves((p, grad, d, state))]
    u, state1 = tx.update(d, state, p, value=value, grad=grad, value_fn=_rosen)
    assert all(torch.equal(a, b) for a, b in zip(snap, ftopt.tree.leaves((p, grad, d, state))))
    buf = io.BytesIO()
    torch.save(state1, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    a, sa = tx.update(d, state1, p, value=value, grad=grad, value_fn=_rosen)
    b, sb = tx.update(d, loaded, p, value=value, grad=grad, value_fn=_rosen)
    assert all(torch.equal(x, y) for x, y in zip(ftopt.tree.leaves((a, sa)),
                                                 ftopt.tree.leaves((b, sb))))
