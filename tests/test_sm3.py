"""SM3 (``scale_by_sm3``, ``sm3``) against float64 math transcribed from optax's
``scale_by_sm3``, step by step from the same state on 0-d to 3-D leaves; optax's
docstring example; skip_zeros exact with its control; fused chains against eager."""

from __future__ import annotations

import functools

import pytest
import torch

import ftopt

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = {"w": (6, 5), "b": (5,), "c": (3, 4, 2), "s": ()}


def _ref_step(g, mu, nu, b1, b2, eps):
    """optax's update for one leaf, in float64 (a 0-d leaf: as a vector)."""
    g, nu = g.double(), nu.double()
    mu = [m.double() for m in mu]
    coeff = 1.0 - b2 if b2 != 1.0 else 1.0
    if g.ndim < 2:
        accum = coeff * g**2 + b2 * mu[0]
    else:
        shaped = [m.reshape([1] * i + [m.numel()] + [1] * (g.ndim - i - 1))
                  for i, m in enumerate(mu)]
        accum = coeff * g**2 + b2 * functools.reduce(torch.minimum, shaped)
    inv = torch.where(accum > 0, (accum + eps).rsqrt(), torch.zeros_like(accum))
    new_nu = (1 - b1) * (g * inv) + b1 * nu
    if g.ndim < 2:
        new_mu = [accum]
    else:
        new_mu = [accum.amax(dim=[k for k in range(g.ndim) if k != i]) for i in range(g.ndim)]
    return new_nu, new_mu


def _draw(seed):
    gen = torch.Generator().manual_seed(seed)
    p = {k: torch.randn(s, generator=gen).to(DEVICE) for k, s in SHAPES.items()}
    gs = [{k: (torch.randn(s, generator=gen) * (1 + 3 * t)).to(DEVICE)
           for k, s in SHAPES.items()} for t in range(6)]
    return p, gs


@pytest.mark.parametrize("b1,b2", [(0.9, 1.0), (0.5, 0.95), (0.0, 1.0)])
def test_matches_float64_from_the_same_state(b1, b2):
    p, gs = _draw(1)
    eps = 1e-8
    tx = ftopt.scale_by_sm3(b1, b2, eps)
    state = tx.init(p)
    assert [tuple(m.shape) for m in state.mu["c"]] == [(3,), (4,), (2,)]
    assert [tuple(m.shape) for m in state.mu["b"]] == [(5,)]
    assert [tuple(m.shape) for m in state.mu["s"]] == [()]
    for g in gs:
        u, new = tx.update(g, state, p)
        for k in SHAPES:
            want_nu, want_mu = _ref_step(g[k], state.mu[k], state.nu[k], b1, b2, eps)
            torch.testing.assert_close(u[k].double(), want_nu, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(new.nu[k].double(), want_nu, rtol=1e-5, atol=1e-7)
            for got, want in zip(new.mu[k], want_mu):
                torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
        assert not torch.equal(new.mu["w"][0], state.mu["w"][0])
        state = new


def test_optax_docstring_example():
    params = torch.tensor([1.0, 2.0, 3.0])
    solver = ftopt.sm3(learning_rate=0.003)
    state = solver.init(params)
    values = []
    for _ in range(5):
        grad = 2 * params
        updates, state = solver.update(grad, state, params)
        params = ftopt.apply_updates(params, updates)
        values.append(float((params**2).sum()))
    assert [f"{v:.2E}" for v in values] == ["1.40E+01"] * 5
    assert all(a > b for a, b in zip([14.0] + values, values))


@pytest.mark.parametrize("backend", ["fused", "eager"])
def test_skip_zeros_keeps_params_and_states(backend):
    p, gs = _draw(2)
    gs[1]["w"][1] = 0.0  # a zero row and a zero element, non-zero the step before
    gs[1]["b"][2] = 0.0
    runs = {}
    for skip in (True, False):
        tx = ftopt.sm3(0.05, skip_zeros=skip)
        before = ftopt.step(tx, p, gs[0], tx.init(p), backend=backend)
        runs[skip] = (before, ftopt.step(tx, before[0], gs[1], before[1], backend=backend))
    (q0, s0), (q1, s1) = runs[True]
    zero_w, zero_b = gs[1]["w"] == 0, gs[1]["b"] == 0
    assert zero_w.any() and zero_b.any()
    assert torch.equal(q1["w"][zero_w], q0["w"][zero_w])
    assert torch.equal(s1[0].nu["w"][zero_w], s0[0].nu["w"][zero_w])
    assert torch.equal(s1[0].mu["b"][0][zero_b], s0[0].mu["b"][0][zero_b])
    assert not torch.equal(s1[0].mu["w"][0], s0[0].mu["w"][0])  # the maxima advance
    (c0, t0), (c1, t1) = runs[False]  # the control: the momentum moves them
    assert not torch.equal(c1["w"][zero_w], c0["w"][zero_w])
    assert not torch.equal(t1[0].nu["w"][zero_w], t0[0].nu["w"][zero_w])


def test_fused_chain_equals_eager():
    p, gs = _draw(3)
    tx = ftopt.chain(ftopt.scale_by_sm3(0.9, 0.99), ftopt.add_decayed_weights(0.01),
                     ftopt.scale_by_learning_rate(0.02))
    runs = {}
    for backend in ("fused", "eager"):
        q, s = p, tx.init(p)
        for g in gs:
            q, s = ftopt.step(tx, q, g, s, backend=backend)
        runs[backend] = q
    for k in SHAPES:
        torch.testing.assert_close(runs["fused"][k], runs["eager"][k], rtol=1e-6, atol=1e-7)
    assert "scale_by_sm3 (matrix stage" in ftopt.explain(tx, p)


def test_bad_hyperparameters_are_refused():
    with pytest.raises(ValueError, match="scale_by_sm3: b2 must be"):
        ftopt.scale_by_sm3(b2=1.5)
    with pytest.raises(ValueError, match="scale_by_sm3: b1 must be"):
        ftopt.sm3(0.1, momentum=-0.1)
