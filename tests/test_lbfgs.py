"""L-BFGS (optax's ``scale_by_lbfgs`` and ``lbfgs``): each direction against a float64
dense-matrix BFGS reference (the recursion of optax's docstring over the last
``memory_size`` pairs), optax's docstring example, optax's convergence tests (Rosenbrock,
Himmelblau, Matyas, Zakharov, a steep objective) at its tolerance, torch.optim.LBFGS where
its math is the same, skip_zeros refused, bad input, purity, a checkpoint round trip.
(``update`` takes ``value=``/``grad=``/``value_fn=`` for the line search:
``tests/registry.py::PARAMS_WRAPPERS`` sends these here.)"""

from __future__ import annotations

import io

import pytest
import torch

import ftopt

F64 = torch.float64
SHAPES = {"w": (3, 2), "b": (4,), "s": ()}


def _flat(tree) -> torch.Tensor:
    return torch.cat([tree[n].reshape(-1).to(F64) for n in SHAPES])


def _dense_direction(u, pairs, gamma):
    """P·u with P built as optax's docstring writes it: P ← γI, then for each pair from
    the oldest, P ← VᵀPV + ρ·δw·δwᵀ, V = I − ρ·δu·δwᵀ (dense float64 matrices)."""
    n = u.numel()
    P = gamma * torch.eye(n, dtype=F64)
    for dw, du in pairs:
        inner = float(du @ dw)
        rho = 0.0 if inner == 0 else 1.0 / inner
        V = torch.eye(n, dtype=F64) - rho * torch.outer(du, dw)
        P = V.T @ P @ V + rho * torch.outer(dw, dw)
    return P @ u


def _draw(seed, steps, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    ps = [{n: torch.randn(s, generator=gen, dtype=dtype) for n, s in SHAPES.items()}
          for _ in range(steps)]
    gs = [{n: torch.randn(s, generator=gen, dtype=dtype) for n, s in SHAPES.items()}
          for _ in range(steps)]
    return ps, gs


@pytest.mark.parametrize("scale_init", [True, False])
@pytest.mark.parametrize("dtype,tol", [(F64, 1e-10), (torch.float32, 2e-4)])
def test_each_direction_matches_dense_bfgs(scale_init, dtype, tol):
    """Random params and gradients (not an optimisation: every pair is arbitrary), memory
    3 over 8 steps, so the ring buffer wraps around twice."""
    m = 3
    tx = ftopt.scale_by_lbfgs(memory_size=m, scale_init_precond=scale_init)
    ps, gs = _draw(0, 8, dtype)
    state = tx.init(ps[0])
    hist = []
    for k, (p, g) in enumerate(zip(ps, gs)):
        u, state = tx.update(g, state, p)
        w, v = _flat(p), _flat(g)
        if k == 0:
            gamma = min(1.0, 1.0 / float(v.norm())) if scale_init else 1.0
            pairs = []
        else:
            hist.append((w - _flat(ps[k - 1]), v - _flat(gs[k - 1])))
            pairs = hist[-m:]
            dw, du = pairs[-1]
            gamma = float(dw @ du) / float(du @ du) if scale_init else 1.0
        want = _dense_direction(v, pairs, gamma)
        got = _flat(u)
        assert torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max())), k
        assert all(u[n].dtype == dtype for n in SHAPES)
        assert int(state.count) == k + 1
    assert state.diff_params_memory["w"].shape == (m, 3, 2)
    assert state.weights_memory.shape == (m,)


def test_optax_docstring_example():
    def f(x):
        return (x ** 2).sum()

    solver = ftopt.lbfgs()
    params = torch.tensor([1.0, 2.0, 3.0])
    state = solver.init(params)
    value_and_grad = ftopt.value_and_grad_from_state(f)
    printed = []
    for _ in range(2):
        value, grad = value_and_grad(params, state=state)
        updates, state = solver.update(grad, state, params, value=value, grad=grad,
                                       value_fn=f)
        params = ftopt.apply_updates(params, updates)
        printed.append(f"{float(f(params)):.2E}")
    assert printed == ["7.52E+00", "7.46E-14"]


def _rosenbrock(x):
    return (100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2).sum()


def _himmelblau(p):
    x, y = p[0], p[1]
    return (x ** 2 + y - 11.0) ** 2 + (x + y ** 2 - 7.0) ** 2


def _matyas(p):
    x, y = p[0], p[1]
    return 0.26 * (x ** 2 + y ** 2) - 0.48 * x * y


def _zakharov(x):
    ii = torch.arange(1, len(x) + 1, dtype=x.dtype)
    s2 = (0.5 * ii * x).sum()
    return (x ** 2).sum() + s2 ** 2 + s2 ** 4


def _steep(x):
    return ((1e4 * torch.eye(2, dtype=x.dtype) @ x) ** 2).mean()


def _run(tx, fn, params, maxiter=500, tol=1e-5):
    """optax's ``_run_opt``: steps until the gradient (at the params before the last
    step) has a norm below ``tol``."""
    state = tx.init(params)
    for _ in range(maxiter):
        value, grad = ftopt.value_and_grad_from_state(fn)(params, state=state)
        updates, state = tx.update(grad, state, params, value=value, grad=grad, value_fn=fn)
        params = ftopt.apply_updates(params, updates)
        if float(ftopt.global_norm(grad)) < tol:
            break
    return params


@pytest.mark.parametrize("fn,init,minimizer", [
    (_rosenbrock, [0.0, 0.0], [1.0, 1.0]),
    (_himmelblau, [1.0, 1.0], [3.0, 2.0]),
    (_matyas, [6.0, 6.0], [0.0, 0.0]),
    (_zakharov, [600.0, 700.0, 200.0, 100.0, 90.0, 1e3], [0.0] * 6),
    (_steep, [1.0, 1.0], [0.0, 0.0]),
    (_himmelblau, [92.0, 0.001], None),  # optax's "bad initialization": a minimum
], ids=["rosenbrock", "himmelblau", "matyas", "zakharov", "steep", "bad_init"])
def test_converges_as_optax_tests_ask(fn, init, minimizer):
    """optax's ``lbfgs_test.py`` (float32, ``lbfgs()`` defaults, tol 1e-5)."""
    sol = _run(ftopt.lbfgs(), fn, torch.tensor(init))
    if minimizer is not None:
        torch.testing.assert_close(sol, torch.tensor(minimizer), atol=1e-5, rtol=1e-5)
    assert abs(float(fn(sol))) <= 1e-5


def test_trees_and_arrays_take_the_same_steps():
    """optax's ``test_handling_pytrees``: the tree's inner products are global."""
    def fn_arr(x):
        return _rosenbrock(x)

    def fn_tree(t):
        return _rosenbrock(torch.cat([t["a"], t["b"]]))

    x0 = torch.tensor([0.3, -0.2, 0.7, 0.1], dtype=F64)
    arr = _run(ftopt.lbfgs(), fn_arr, x0, maxiter=3, tol=0.0)
    tree = _run(ftopt.lbfgs(), fn_tree, {"a": x0[:1].clone(), "b": x0[1:].clone()},
                maxiter=3, tol=0.0)
    torch.testing.assert_close(torch.cat([tree["a"], tree["b"]]), arr, rtol=1e-12, atol=1e-12)
    assert not torch.equal(arr, x0)


def test_matches_torch_lbfgs_where_the_math_is_the_same():
    """torch.optim.LBFGS (lr 1, no line search) takes x ← x + H·(−g) with H L-BFGS'
    two-loop from γ = ⟨s, y⟩/‖y‖²; its first step is scaled by min(1, 1/‖g‖₁) where
    optax's is min(1, 1/‖g‖₂): from a point with ‖g‖₁ <= 1 both are 1, and on a convex
    quadratic torch's pair filter (⟨s, y⟩ > 1e-10) drops nothing: the same iterates."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(6, 6, generator=gen, dtype=F64)
    A = q @ q.T / 6 + 0.5 * torch.eye(6, dtype=F64)
    b = torch.randn(6, generator=gen, dtype=F64)
    x_star = torch.linalg.solve(A, b)
    fn = lambda x: 0.5 * x @ A @ x - b @ x  # noqa: E731
    x0 = x_star + 0.02 * torch.randn(6, generator=gen, dtype=F64)
    assert float((A @ x0 - b).abs().sum()) <= 1.0
    tx = ftopt.lbfgs(learning_rate=1.0, memory_size=3, linesearch=None)
    x, state = x0.clone(), tx.init(x0)
    ref = x0.clone().requires_grad_(True)
    opt = torch.optim.LBFGS([ref], lr=1, max_iter=1, history_size=3, tolerance_grad=0.0,
                            tolerance_change=0.0)

    def closure():
        opt.zero_grad()
        loss = fn(ref)
        loss.backward()
        return loss

    for k in range(5):
        g = A @ x - b
        u, state = tx.update(g, state, x)
        x = ftopt.apply_updates(x, u)
        opt.step(closure)
        torch.testing.assert_close(x, ref.detach(), rtol=1e-10, atol=1e-12, msg=str(k))


def test_no_host_read(monkeypatch):
    tx = ftopt.scale_by_lbfgs(memory_size=2)
    ps, gs = _draw(1, 3)
    state = tx.init(ps[0])

    def forbid(*_args, **_kwargs):
        raise AssertionError("a branch on a tensor's value")

    monkeypatch.setattr(torch.Tensor, "__bool__", forbid)
    for p, g in zip(ps, gs):
        _, state = tx.update(g, state, p)
    monkeypatch.undo()
    assert int(state.count) == 3


def test_skip_zeros_is_refused():
    p, gs = _draw(2, 1)
    g = {**gs[0], "b": torch.zeros(4, dtype=F64)}
    fn = lambda t: sum((t[n] ** 2).sum() for n in SHAPES)  # noqa: E731
    for tx in (ftopt.chain(ftopt.lbfgs(), ftopt.skip_zeros()),
               ftopt.skip_zeros(ftopt.scale_by_lbfgs())):
        with pytest.raises(ValueError, match="cannot honour skip_zeros"):
            tx.update(g, tx.init(p[0]), p[0], value=fn(p[0]), grad=g, value_fn=fn)


def test_bad_input_purity_and_checkpoint():
    ps, gs = _draw(3, 3)
    fn = lambda t: sum((t[n] ** 2).sum() for n in SHAPES)  # noqa: E731
    tx = ftopt.lbfgs(memory_size=4)
    state = tx.init(ps[0])
    with pytest.raises(TypeError, match="missing: value, value_fn"):
        tx.update(gs[0], state, ps[0], grad=gs[0])
    with pytest.raises(ValueError, match="needs params"):
        ftopt.scale_by_lbfgs().update(gs[0], ftopt.scale_by_lbfgs().init(ps[0]))
    with pytest.raises(ValueError, match="memory_size"):
        ftopt.scale_by_lbfgs(memory_size=0)
    other = ftopt.scale_by_lbfgs(memory_size=4)
    bad = other.init({**ps[0], "w": torch.zeros(2, 3, dtype=F64)})
    with pytest.raises(ValueError, match=r"state params at \['w'\]"):
        other.update(gs[0], bad, ps[0])
    with pytest.raises(ValueError, match=r"weights_memory.*memory_size=3"):
        ftopt.scale_by_lbfgs(memory_size=3).update(gs[0], other.init(ps[0]), ps[0])
    for k in range(2):
        p, g, before = ps[k], gs[k], state
        snap = [t.clone() for t in ftopt.tree.leaves((p, g, before))]
        u, state = tx.update(g, state, p, value=fn(p), grad=g, value_fn=fn)
        assert all(torch.equal(a, b) for a, b in zip(snap, ftopt.tree.leaves((p, g, before))))
    kept = state[0].params["w"].clone()
    ps[1]["w"].add_(1.0)  # the state keeps its own copies of the params and gradients
    gs[1]["w"].add_(1.0)
    assert torch.equal(state[0].params["w"], kept)
    p, g = ps[2], gs[2]
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    a, sa = tx.update(g, state, p, value=fn(p), grad=g, value_fn=fn)
    b, sb = tx.update(g, loaded, p, value=fn(p), grad=g, value_fn=fn)
    assert all(torch.equal(a[n], b[n]) for n in SHAPES)
    assert all(torch.equal(x, y) for x, y in zip(ftopt.tree.leaves(sa), ftopt.tree.leaves(sb)))
