"""GaLore (optax.contrib's ``galore``, ``scale_by_galore``): runs against float64 math
transcribed from optax (projected and unprojected leaves, 3-D leaves as matrices, the
projector refreshed every ``update_proj_gap`` steps); optax's docstring example; batching;
skip_zeros with its control; state options; errors naming the argument or path; purity; a
checkpoint round trip; a small training problem."""

from __future__ import annotations

import io
import math

import pytest
import torch

import ftopt
from ftopt import GaLoreDimensionNumbers as Dims

F64 = torch.float64
SHAPES = {"a": (6, 4), "b": (5,), "c": (6, 4), "v": (3, 7), "x": (2, 3, 4)}


def _draw(seed, steps, dtype=F64, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    p = {n: torch.randn(s, generator=gen, dtype=F64).to(dtype) for n, s in shapes.items()}
    gs = [{n: torch.randn(s, generator=gen, dtype=F64).to(dtype) for n, s in shapes.items()}
          for _ in range(steps)]
    return p, gs


def _as_matrix(x, dims):
    red = (dims.reduction_axis,) if isinstance(dims.reduction_axis, int) else \
        tuple(dims.reduction_axis)
    out = (dims.output_axis,) if isinstance(dims.output_axis, int) else tuple(dims.output_axis)
    red = tuple(a % x.ndim for a in red)
    out = tuple(a % x.ndim for a in out)
    perm = red + out
    m = math.prod(x.shape[a] for a in red)
    moved = x.permute(perm)
    back = lambda y: y.reshape(moved.shape).permute(  # noqa: E731
        sorted(range(x.ndim), key=lambda i: perm[i]))
    return moved.reshape(m, -1), back


def _reference(p, gs, dims, *, lr, rank, gap, scale=1.0, b1=0.9, b2=0.999, eps=1e-8, wd=0.0):
    """optax.contrib.galore (base scale_by_adam) in float64: the params after each step.
    The SVD runs in fp32 for fp32 gradients, as optax's (a singular vector's sign is the
    SVD's choice, and the base state carried across a refresh sees it)."""
    svd_dtype = torch.float32 if p[next(iter(p))].dtype == torch.float32 else F64
    p = {n: v.to(F64) for n, v in p.items()}
    proj, mu, nu, out = {}, {}, {}, []
    for t, g in enumerate(gs):
        new = {}
        for n in p:
            gn = g[n].to(F64)
            d = dims.get(n)
            if d is not None:
                g2, back = _as_matrix(gn, d)
                m, k = g2.shape
                left, r = m >= k, min(rank, m, k)
                if t % gap == 0:
                    u, _, vh = torch.linalg.svd(g2.to(svd_dtype), full_matrices=False)
                    proj[n] = (u[:, :r] if left else vh[:r, :].T).to(F64)
                low = proj[n].T @ g2 if left else g2 @ proj[n]
            else:
                low = gn
            mu[n] = b1 * mu.get(n, 0) + (1 - b1) * low
            nu[n] = b2 * nu.get(n, 0) + (1 - b2) * low**2
            step = (mu[n] / (1 - b1 ** (t + 1))) / ((nu[n] / (1 - b2 ** (t + 1))).sqrt() + eps)
            if d is not None:
                step = scale * back(proj[n] @ step if left else step @ proj[n].T)
            new[n] = p[n] - lr * (step + wd * p[n])
        p = new
        out.append(p)
    return out, proj


X_DIMS = Dims(reduction_axis=(0, 2), output_axis=1)
T_DIMS = Dims(reduction_axis=1, output_axis=0)
CASES = {
    # the default: the 2-D leaves projected ((6, 4) left, (3, 7) right), the rest as they are
    "default": (dict(lr=0.05, rank=2, gap=2), {n: Dims() for n in ("a", "c", "v")},
                lambda: ftopt.galore(0.05, rank=2, update_proj_gap=2)),
    "scale_wd_gap1": (dict(lr=0.02, rank=3, gap=1, scale=0.5, wd=0.1),
                      {n: Dims() for n in ("a", "c", "v")},
                      lambda: ftopt.galore(0.02, rank=3, update_proj_gap=1, scale=0.5,
                                           weight_decay=0.1)),
    # one spec for every leaf with >= 2 dims (here transposed matrices), rank > m
    "one_spec": (dict(lr=0.05, rank=5, gap=3), {"a": T_DIMS, "c": T_DIMS, "v": T_DIMS},
                 lambda: ftopt.galore(0.05, rank=5, update_proj_gap=3,
                                      weight_dimension_numbers=T_DIMS)),
    # the 3-D leaf as a (2*4) x 3 matrix
    "three_d": (dict(lr=0.05, rank=2, gap=2), {"x": X_DIMS},
                lambda: ftopt.galore(0.05, rank=2, update_proj_gap=2, weight_dimension_numbers={
                    "a": None, "b": None, "c": None, "v": None, "x": X_DIMS})),
    # a tree of specs (None: not projected) and a callable making one
    "tree": (dict(lr=0.05, rank=2, gap=2), {"a": Dims(1, 0), "x": Dims(-1, (0, 1))},
             lambda: ftopt.galore(0.05, rank=2, update_proj_gap=2, weight_dimension_numbers={
                 "a": Dims(1, 0), "b": None, "c": None, "v": None, "x": Dims(-1, (0, 1))})),
    "callable": (dict(lr=0.05, rank=2, gap=2), {"x": Dims(-1, (0, 1))},
                 lambda: ftopt.galore(0.05, rank=2, update_proj_gap=2,
                                      weight_dimension_numbers=lambda t: {
                                          n: Dims(-1, (0, 1)) if v.ndim == 3 else None
                                          for n, v in t.items()})),
}


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_steps_match_float64_reference(case, dtype):
    kw, dims, make = CASES[case]
    tx = make()
    shapes = {n: v for n, v in SHAPES.items() if case != "one_spec" or n != "x"}
    p, gs = _draw(1, 7, dtype, shapes)
    want, proj = _reference(p, gs, dims, **kw)
    state = tx.init(p)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == F64 else dict(rtol=1e-4, atol=1e-5)
    for t, g in enumerate(gs):
        u, state = tx.update(g, state, p)
        p = ftopt.apply_updates(p, u)
        for n in shapes:
            torch.testing.assert_close(p[n].to(F64), want[t][n], **tol, msg=f"{n} step {t}")
    inner = state[0]
    assert int(inner.count) == len(gs)
    for n in shapes:
        got = inner.projector[n]
        if n in dims:
            torch.testing.assert_close(got.to(F64), proj[n], rtol=1e-5, atol=1e-6)
        else:
            assert got.shape == (0, 0)
    # the base optimizer's state has the projected shapes
    mu = inner.base_optimizer_state.mu
    for n in shapes:
        if n in dims:
            g2, _ = _as_matrix(gs[0][n], dims[n])
            m, k = g2.shape
            r = min(kw["rank"], m, k)
            assert tuple(mu[n].shape) == ((r, k) if m >= k else (m, r))
        else:
            assert mu[n].shape == gs[0][n].shape


def test_optax_docstring_example():
    f = lambda x: float((x["w"] ** 2).sum())  # noqa: E731
    tx = ftopt.galore(learning_rate=0.01, rank=16)
    params = {"w": torch.ones(100, 100), "b": torch.ones(100)}
    assert f(params) == 10000.0
    state = tx.init(params)
    got = []
    for _ in range(5):
        grad = {"w": 2 * params["w"], "b": torch.zeros(100)}  # jax.grad(f)
        updates, state = tx.update(grad, state, params)
        params = ftopt.apply_updates(params, updates)
        got.append(f"{f(params):.2E}")
    assert got == ["9.98E+03", "9.96E+03", "9.94E+03", "9.92E+03", "9.90E+03"]
    assert torch.equal(params["b"], torch.ones(100))
    # the other examples build
    ftopt.galore(learning_rate=0.01, rank=16, weight_decay=0.01)
    ftopt.galore(learning_rate=0.01, rank=16, base_optimizer=ftopt.scale_by_adam(b1=0.9, b2=0.99))
    ftopt.galore(0.01, rank=16, weight_dimension_numbers={"attn": Dims(0, (1, 2))})


def test_equal_shapes_batched_as_alone():
    """Two (6, 4) leaves stepped together equal each stepped alone."""
    p, gs = _draw(2, 4, torch.float32, {"a": (6, 4), "c": (6, 4)})
    tx = ftopt.galore(0.05, rank=2, update_proj_gap=2)
    s_both = tx.init(p)
    alone = {n: (tx.init({n: p[n]}), {n: p[n]}) for n in p}
    both = p
    for g in gs:
        u, s_both = tx.update(g, s_both, both)
        both = ftopt.apply_updates(both, u)
        for n in p:
            s, q = alone[n]
            u1, s = tx.update({n: g[n]}, s, q)
            alone[n] = (s, ftopt.apply_updates(q, u1))
    for n in p:
        torch.testing.assert_close(both[n], alone[n][1][n], rtol=1e-6, atol=1e-7)


def test_base_optimizer_and_unprojected_leaves():
    """A vector leaf gets the base optimizer's update as it is (no ``scale``), any base."""
    p, gs = _draw(3, 3, torch.float32, {"b": (5,), "a": (6, 4)})
    tx = ftopt.scale_by_galore(rank=2, scale=3.0, base_optimizer=ftopt.scale_by_lion())
    lion = ftopt.scale_by_lion()
    s, ls = tx.init(p), lion.init({"b": p["b"]})
    for g in gs:
        u, s = tx.update(g, s, p)
        lu, ls = lion.update({"b": g["b"]}, ls)
        assert torch.equal(u["b"], lu["b"])
        assert set(u["a"].abs().unique().tolist()) != {3.0}  # projected back, not signs


def test_skip_zeros_keeps_params_and_unprojected_states():
    p, gs = _draw(4, 2, torch.float32)
    for n in ("a", "v", "x"):
        gs[1][n].reshape(-1)[::3] = 0.0
    gs[1]["b"][1] = -0.0
    runs = {}
    for skip in (True, False):
        tx = ftopt.galore(0.05, rank=2, update_proj_gap=1, weight_decay=0.1,
                          skip_zeros=skip)
        u, s = tx.update(gs[0], tx.init(p), p)
        before = (ftopt.apply_updates(p, u), s)
        u, s = tx.update(gs[1], before[1], before[0])
        runs[skip] = (before, (ftopt.apply_updates(before[0], u), s))
    (q0, s0), (q1, s1) = runs[True]
    (c0, t0), (c1, t1) = runs[False]
    for n in SHAPES:
        zero = gs[1][n] == 0
        if not zero.any():
            continue
        assert torch.equal(q1[n][zero], q0[n][zero]), n
        assert not torch.equal(c1[n][zero], c0[n][zero]), n  # the control
        assert torch.equal(q1[n][~zero], c1[n][~zero]), n  # the rest as without the flag
    base1, base0 = s1[0].base_optimizer_state, s0[0].base_optimizer_state
    cbase1, cbase0 = t1[0].base_optimizer_state, t0[0].base_optimizer_state
    zero = gs[1]["b"] == 0  # an unprojected leaf: the base's per-element states keep bits
    for slot in ("mu", "nu"):
        assert torch.equal(getattr(base1, slot)["b"][zero], getattr(base0, slot)["b"][zero])
        assert not torch.equal(getattr(cbase1, slot)["b"][zero],
                               getattr(cbase0, slot)["b"][zero])
    # a projected leaf's low-rank states mix its elements: they advance as without the flag
    assert torch.equal(base1.mu["a"], cbase1.mu["a"])
    assert torch.equal(s1[0].projector["a"], t1[0].projector["a"])


def test_a_gradient_with_a_nan_gets_nan_projectors_not_an_error():
    """LAPACK's ``svd`` refuses a matrix with a NaN or an infinity: such a leaf gets NaN
    projectors and NaN updates, as a NaN makes any other state; the other leaf of its
    batch (same shape) keeps its projector and update (the control: as without the NaN
    beside it)."""
    p, gs = _draw(6, 1, torch.float32, {"a": (16, 12), "b": (16, 12)})
    bad = {**gs[0], "b": gs[0]["b"].clone()}
    bad["b"][2, 3] = float("inf")
    tx = ftopt.galore(0.05, rank=4)
    u, s = tx.update(bad, tx.init(p), p)
    want, clean = tx.update(gs[0], tx.init(p), p)
    assert bool(s[0].projector["b"].isnan().all()) and bool(u["b"].isnan().all())
    assert torch.equal(s[0].projector["a"], clean[0].projector["a"])
    assert torch.equal(u["a"], want["a"]) and bool(u["a"].isfinite().all())


def test_state_options_reach_the_base_optimizer():
    p, gs = _draw(5, 2, torch.float32, {"a": (64, 64), "b": (5,)})
    tx = ftopt.galore(0.01, rank=64, state_dtype=torch.bfloat16)
    s = tx.init(p)
    _, s = tx.update(gs[0], s, p)
    assert s[0].base_optimizer_state.mu["a"].dtype == torch.bfloat16
    assert s[0].projector["a"].dtype == torch.float32
    tx8 = ftopt.galore(0.01, rank=64, state_bits=8)
    s8 = tx8.init(p)
    u8, s8 = tx8.update(gs[0], s8, p)
    kinds = {type(x).__name__ for x in ftopt.tree.leaves(s8[0].base_optimizer_state)
             if isinstance(x, torch.Tensor) and x.dtype == torch.uint8}
    assert kinds, "the (64, 64) projected leaf's states are 8-bit codes"
    u32, _ = ftopt.galore(0.01, rank=64).update(gs[0], ftopt.galore(0.01, rank=64).init(p), p)
    torch.testing.assert_close(u8["a"], u32["a"], rtol=0.05, atol=1e-3)
    with pytest.raises(ValueError, match="^galore: state_bits must be 8 or 32"):
        ftopt.galore(0.1, state_bits=4)


def test_errors_name_the_argument_or_path_and_write_nothing():
    with pytest.raises(TypeError, match="scale_by_galore: rank must be an int"):
        ftopt.galore(0.1, rank=2.0)
    with pytest.raises(ValueError, match="scale_by_galore: rank must be positive"):
        ftopt.scale_by_galore(rank=0)
    with pytest.raises(ValueError, match="update_proj_gap"):
        ftopt.galore(0.1, update_proj_gap=0)
    with pytest.raises(TypeError, match="base_optimizer"):
        ftopt.scale_by_galore(base_optimizer="adam")
    p, gs = _draw(6, 2, torch.float32)
    for dims, exc, words in (
        ({**{n: None for n in SHAPES}, "b": Dims()}, ValueError, r"rank >= 2.*\['b'\]"),
        ({**{n: None for n in SHAPES}, "x": Dims(0, (0, 1))}, ValueError,
         r"\['x'\].*disjoint"),
        ({**{n: None for n in SHAPES}, "x": Dims(0, 1)}, ValueError,
         r"\['x'\].*all axes must be specified"),
        ({**{n: None for n in SHAPES}, "a": "rows"}, TypeError,
         r"weight_dimension_numbers at \['a'\]"),
        ({n: None for n in ("a", "b")}, ValueError, "weight_dimension_numbers does not match"),
    ):
        with pytest.raises(exc, match=words):
            ftopt.galore(0.1, weight_dimension_numbers=dims).init(p)
    tx = ftopt.galore(0.1, rank=2)
    state = tx.init(p)
    bad = {**p, "v": torch.zeros(3, 8)}  # a projector of (3, 8)'s shape, (8, 2)
    snapshot = [x.clone() for x in ftopt.tree.leaves((p, gs[0], state))]
    with pytest.raises(ValueError, match=r"state projector at \['v'\].*\(3, 7\).*\(7, 2\)"):
        tx.update(gs[0], tx.init(bad), p)
    with pytest.raises(ValueError, match=r"update at \['a'\].*\(4, 6\)"):
        tx.update({**gs[0], "a": torch.zeros(4, 6)}, state, p)
    with pytest.raises(ValueError, match=r"missing \['c'\]"):
        tx.update({n: v for n, v in gs[0].items() if n != "c"}, state, p)
    int_state = ftopt.tree.map(lambda x: x.to(torch.int32) if x.is_floating_point() else x,
                               state)
    with pytest.raises(TypeError, match=r"state projector at \['a'\].*floating-point"):
        tx.update(gs[0], int_state, p)
    with pytest.raises(TypeError, match="expected a GaLoreState"):
        tx.update(gs[0], (state[0].base_optimizer_state, *state[1:]), p)
    after = ftopt.tree.leaves((p, gs[0], state))
    assert all(torch.equal(a, b) for a, b in zip(after, snapshot))


def test_purity_determinism_and_checkpoint():
    p, gs = _draw(7, 3, torch.float32)
    tx = ftopt.galore(0.05, rank=2, update_proj_gap=2)
    state = tx.init(p)
    _, state = tx.update(gs[0], state, p)
    before = [x.clone() for x in ftopt.tree.leaves((p, gs[1], state))]
    a1, sa1 = tx.update(gs[1], state, p)
    a2, sa2 = tx.update(gs[1], state, p)
    assert all(torch.equal(x, y) for x, y in zip(ftopt.tree.leaves((p, gs[1], state)), before))
    assert all(torch.equal(x, y) for x, y in zip(ftopt.tree.leaves((a1, sa1)),
                                                 ftopt.tree.leaves((a2, sa2))))
    buf = io.BytesIO()
    torch.save(sa1, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert isinstance(loaded[0], ftopt.GaLoreState)
    b1, sb1 = tx.update(gs[2], sa1, p)  # count 2: the projector is refreshed
    b2, sb2 = tx.update(gs[2], loaded, p)
    assert all(torch.equal(x, y) for x, y in zip(ftopt.tree.leaves((b1, sb1)),
                                                 ftopt.tree.leaves((b2, sb2))))
    new_p, _ = ftopt.step(tx, p, gs[2], loaded)  # step() as update + apply
    torch.testing.assert_close(new_p["a"], ftopt.apply_updates(p, b1)["a"])


def test_explain_says_why_it_runs_eagerly():
    p, _ = _draw(8, 0, torch.float32)
    assert "scale_by_galore runs eagerly" in str(ftopt.explain(ftopt.galore(0.1), p))


def test_trains_a_low_rank_regression():
    """A (20, 10) map with a rank-2 target, learned through rank-4 projections."""
    gen = torch.Generator().manual_seed(9)
    target = torch.randn(20, 2, generator=gen) @ torch.randn(2, 10, generator=gen)
    x = torch.randn(128, 20, generator=gen)
    y = x @ target
    params = {"w": 0.1 * torch.randn(20, 10, generator=gen), "b": torch.zeros(10)}
    loss = lambda q: ((x @ q["w"] + q["b"] - y) ** 2).mean()  # noqa: E731
    tx = ftopt.galore(0.1, rank=4, update_proj_gap=20)
    state = tx.init(params)
    start = float(loss(params))
    for _ in range(300):
        params, state = ftopt.step(tx, params, torch.func.grad(loss)(params), state)
    end = float(loss(params))
    assert end < 0.02 * start, (start, end)  # (measured: 46 -> 0.18)
