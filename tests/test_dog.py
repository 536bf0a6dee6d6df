"""DoG and DoWG (optax.contrib's): optax's docstring examples, each step against float64
from the same state (every ``init_step`` kind, DoWG's default start), fused against eager
from the same state, and the state's layout."""

from __future__ import annotations

import math

import pytest
import reference_dog as RD
import torch

import ftopt

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = {"w": (9, 7), "b": (7,), "s": ()}


def _draw(seed, steps=6):
    gen = torch.Generator().manual_seed(seed)
    p = {k: torch.randn(s, generator=gen).to(DEVICE) for k, s in SHAPES.items()}
    gs = [{k: torch.randn(s, generator=gen).to(DEVICE) for k, s in SHAPES.items()}
          for _ in range(steps)]
    return p, gs


def _quadratic(solver, steps=5):
    params = torch.tensor([1.0, 2.0, 3.0], device=DEVICE)
    state = solver.init(params)
    values = []
    for _ in range(steps):
        updates, state = solver.update(2 * params, state, params)
        params = ftopt.apply_updates(params, updates)
        values.append(float((params**2).sum()))
    return values


def test_optax_docstring_examples():
    got = _quadratic(ftopt.dowg())
    want = [13.925367, 13.872763, 13.775433, 13.596172, 13.268837]
    assert all(abs(a - b) <= 2e-6 * b for a, b in zip(got, want)), got
    dog = _quadratic(ftopt.dog())
    assert all(13.99 <= v < 14.0 for v in dog), dog
    assert all(a > b for a, b in zip([14.0] + dog, dog))


def _ref_from(kind, state, tx_kw, weight_decay):
    """A float64 reference holding ftopt's state (a step from the same state)."""
    if kind == "dowg":
        ref = RD.RefDoWG(1.0, weight_decay=weight_decay, **tx_kw)
        ref.estim, ref.weighted = float(state.estim_sq_dist), float(state.weighted_sq_norm_grads)
    else:
        ref = RD.RefDoG(1.0, weight_decay=weight_decay, **tx_kw)
        ref.t = int(state.count)
        ref.max_dist = None if ref.t == 0 else float(state.max_dist)
        ref.sum_sq = float(state.sum_sq_norm_grads)
    ref.state = {k: {"init_params": v.double()} for k, v in state.init_params.items()}
    return ref


CASES = {
    "heuristic": ("dog", {"init_step": ("heuristic", 1e-3)}),
    "distance": ("dog", {"init_step": ("distance", 0.05), "eps": 1e-6}),
    "learning_rate": ("dog", {"init_step": ("learning_rate", 0.02)}),
    "dowg": ("dowg", {}),
    "dowg_start": ("dowg", {"init_estim_sq_dist": 0.3, "eps": 1e-3}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_step_matches_float64_from_the_same_state(case):
    kind, kw = CASES[case]
    wd = 0.05
    alias = getattr(ftopt, kind)
    tx = alias(1.0, weight_decay=wd, **kw)
    p, gs = _draw(1)
    state = tx.init(p)
    scales = []
    for g in gs:
        ref = _ref_from(kind, state[1], kw, wd)  # (decay, scale_by_dog/dowg, lr)
        want = ref.step(p, g)
        p_new, state = ftopt.step(tx, p, g, state)
        scale = max(float((want[k] - p[k].double()).abs().max()) for k in SHAPES)
        for k in SHAPES:
            err = float((p_new[k].double() - want[k]).abs().max())
            assert err <= 1e-6 * scale + 2e-7 * float(want[k].abs().max()), (case, k, err)
        scales.append(scale)
        p = p_new
    assert min(scales) > 0  # every step moved the params


def test_state_layout_and_start_values():
    p, _ = _draw(2)
    heuristic = ftopt.scale_by_dog(("heuristic", 1e-3)).init(p)
    assert isinstance(heuristic, ftopt.DoGState) and int(heuristic.count) == 0
    assert float(heuristic.max_dist) == 0.0  # r_ε comes from init_params at the first step
    assert all(torch.equal(heuristic.init_params[k], p[k]) for k in SHAPES)
    assert heuristic.init_params["w"] is not p["w"]
    assert float(ftopt.scale_by_dog(("distance", 0.25)).init(p).max_dist) == 0.25
    dowg = ftopt.scale_by_dowg(eps=1e-3).init(p)
    assert isinstance(dowg, ftopt.DoWGState) and abs(float(dowg.estim_sq_dist) - 1e-3) < 1e-10


@pytest.mark.parametrize("kind", ["dog", "dowg"])
def test_fused_update_equals_eager_from_the_same_state(kind):
    tx = getattr(ftopt, kind)(0.5, weight_decay=0.05)
    p, gs = _draw(3)
    state = tx.init(p)
    for g in gs:
        u_f, s_f = tx.update(g, state, p, backend="fused")
        u_e, s_e = tx.update(g, state, p, backend="eager")
        for k in SHAPES:
            torch.testing.assert_close(u_f[k], u_e[k], rtol=1e-5, atol=1e-9)
        p, state = ftopt.apply_updates(p, u_e), s_e


def test_bad_input_is_refused():
    p, gs = _draw(4)
    for tx in (ftopt.dog(), ftopt.dowg()):
        with pytest.raises(ValueError, match="needs params"):
            tx.update(gs[0], tx.init(p))
    with pytest.raises(ValueError, match="init_step must be"):
        ftopt.scale_by_dog(("far", 1.0))
    with pytest.raises(ValueError, match="eps must be"):
        ftopt.scale_by_dowg(eps=0.0)


def _ldog_ref(state, p, g, reps_rel, eps, scale):
    """optax's scale_by_distance_over_gradients in float64, per leaf, from ``state``:
    (updates, max_dist, grad_sum_of_squares)."""
    u, dists, sums = {}, {}, {}
    for k in p:
        x0, x, gk = (t.double() for t in (state.init_params[k], p[k], g[k]))
        d = float(state.max_dist[k])
        d = reps_rel * (1 + float(x0.norm())) if d < 0 else d  # (optax's init value)
        dists[k] = max(d, float((x - x0).norm()))
        sums[k] = float(state.grad_sum_of_squares[k]) + float(gk.square().sum())
        u[k] = scale * dists[k] / math.sqrt(sums[k] + eps) * gk
    return u, dists, sums


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_layerwise_dog_matches_float64_from_the_same_state(backend):
    reps_rel, eps, scale = 1e-3, 1e-6, -1.0
    tx = ftopt.scale_by_distance_over_gradients(reps_rel, eps, global_scale=scale)
    p, gs = _draw(5)
    state = tx.init(p)
    assert all(float(state.max_dist[k]) == -1.0 for k in SHAPES)  # (before a first step)
    assert all(state.max_dist[k].ndim == 0 for k in SHAPES)
    for g in gs:
        want, dists, sums = _ldog_ref(state, p, g, reps_rel, eps, scale)
        u, state = tx.update(g, state, p, backend=backend)
        for k in SHAPES:
            torch.testing.assert_close(u[k].double(), want[k], rtol=2e-6, atol=1e-12)
            assert abs(float(state.max_dist[k]) - dists[k]) <= 1e-6 * dists[k]
            assert abs(float(state.grad_sum_of_squares[k]) - sums[k]) <= 1e-6 * sums[k]
        p = {k: p[k] - 0.1 * g[k] for k in SHAPES}  # (the distance grows: r̄ moves)
    # each leaf its own step: the per-leaf scales differ
    ratios = {k: float(u[k].flatten()[0] / gs[-1][k].flatten()[0]) for k in SHAPES}
    assert len({round(r, 9) for r in ratios.values()}) == len(SHAPES)


def test_layerwise_dog_skip_zeros_keeps_an_all_zero_leaf():
    tx = ftopt.chain(ftopt.scale_by_distance_over_gradients(1e-3), ftopt.skip_zeros())
    plain = ftopt.scale_by_distance_over_gradients(1e-3)
    p, gs = _draw(6, steps=2)
    s, t = tx.init(p), plain.init(p)
    _, s = tx.update(gs[0], s, p)
    _, t = plain.update(gs[0], t, p)
    g = dict(gs[1], b=torch.zeros_like(gs[1]["b"]))
    g["w"][0] = 0.0
    u, s2 = tx.update(g, s, p)
    v, t2 = plain.update(g, t, p)
    inner, old = s2[0], s[0]
    assert torch.equal(inner.max_dist["b"], old.max_dist["b"])
    assert torch.equal(inner.grad_sum_of_squares["b"], old.grad_sum_of_squares["b"])
    assert torch.equal(u["b"], torch.full_like(u["b"], -0.0)) and u["b"].signbit().all()
    assert torch.equal(u["w"][0], torch.full_like(u["w"][0], -0.0))
    # a partly zero leaf advances from its norm, where the zeros count as zeros
    assert torch.equal(inner.grad_sum_of_squares["w"], t2.grad_sum_of_squares["w"])
    # the control: without skip_zeros the zero leaf's r̄ still moves (p ≠ x0 after a step)
    p2 = {k: p[k] + 0.5 for k in SHAPES}
    _, t3 = plain.update(g, t, p2)
    assert not torch.equal(t3.max_dist["b"], t.max_dist["b"])
    _, s3 = tx.update(g, s, p2)
    assert torch.equal(s3[0].max_dist["b"], s[0].max_dist["b"])
