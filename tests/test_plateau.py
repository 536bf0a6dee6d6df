"""``reduce_on_plateau`` against a transcription of optax.contrib's algorithm in Python
numbers, over metric sequences that improve, stall and recover."""

from __future__ import annotations

import math

import pytest
import torch

import ftopt


def _reference(values, factor, patience, rtol, atol, cooldown, accumulation_size, min_scale):
    """optax.contrib.reduce_on_plateau's state after each value (Python floats)."""
    s = dict(scale=1.0, best=math.inf, plateau=0, cooldown=0, count=0, avg=0.0)
    out = []
    for v in values:
        count = s["count"] + 1
        s["avg"] = (s["count"] * s["avg"] + v) / count
        s["count"] = count
        if count == accumulation_size:
            improved = s["avg"] < (1 - rtol) * s["best"] - atol
            best = s["avg"] if improved else s["best"]
            plateau = 0 if improved else s["plateau"] + 1
            if s["cooldown"] > 0:
                s.update(plateau=0, cooldown=s["cooldown"] - 1)
            else:
                reduce = plateau == patience
                s.update(plateau=0 if reduce else plateau,
                         scale=max(s["scale"] * factor if reduce else s["scale"], min_scale),
                         cooldown=cooldown if reduce else 0)
            s.update(best=best, count=0, avg=0.0)
        out.append(dict(s))
    return out


def _metrics(n, seed):
    """Falls, stalls (noise around a level) and falls again."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.rand(n, generator=gen, dtype=torch.float64).tolist()
    return [(10.0 - i if i < 8 else 2.0 + 0.01 * noise[i] if i < 40 else 1.0 - 0.01 * i)
            for i in range(n)]


@pytest.mark.parametrize("kw", [
    dict(),
    dict(factor=0.5, patience=3, cooldown=2),
    dict(factor=0.5, patience=2, rtol=0.0, atol=0.05, accumulation_size=3, min_scale=0.3),
    dict(factor=0.2, patience=1, cooldown=0, accumulation_size=2),
])
def test_matches_optax_algorithm(kw):
    args = dict(factor=0.1, patience=10, rtol=1e-4, atol=0.0, cooldown=0,
                accumulation_size=1, min_scale=0.0) | kw
    values = _metrics(60, len(kw))
    tx = ftopt.reduce_on_plateau(**args)
    params = {"w": torch.randn(3, dtype=torch.float64)}
    state = tx.init(params)
    g = {"w": torch.ones(3, dtype=torch.float64)}
    reductions = 0
    for v, want in zip(values, _reference(values, **args)):
        u, state = tx.update(g, state, params, value=v)
        assert float(state.scale) == pytest.approx(want["scale"], rel=1e-6)
        assert float(state.best_value) == want["best"] or math.isclose(
            float(state.best_value), want["best"], rel_tol=1e-12)
        assert int(state.plateau_count) == want["plateau"]
        assert int(state.cooldown_count) == want["cooldown"]
        assert int(state.count) == want["count"]
        assert torch.allclose(u["w"], g["w"] * want["scale"])
        reductions = want["scale"] < 1.0
    assert reductions  # (the control: the stall reduced the scale)


def test_in_a_chain_scales_the_steps_and_needs_no_host_read(monkeypatch):
    params = {"w": torch.randn(4), "b": torch.randn(2)}
    tx = ftopt.chain(ftopt.adam(1e-2), ftopt.reduce_on_plateau(factor=0.5, patience=1))
    state = tx.init(params)
    g = {"w": torch.randn(4), "b": torch.randn(2)}

    def forbid(*_args, **_kwargs):
        raise AssertionError("a branch on a tensor's value")

    outs = []
    for v in (1.0, 1.0, 1.0):
        monkeypatch.setattr(torch.Tensor, "__bool__", forbid)
        u, state = tx.update(g, state, params, value=torch.tensor(v))
        monkeypatch.undo()
        outs.append(u)
    # the first value improves on +inf; each later one does not: halved twice
    assert float(state[1].scale) == 0.25
    alone = ftopt.adam(1e-2)
    a_state = alone.init(params)
    for k, factor in enumerate((1.0, 0.5, 0.25)):
        want, a_state = alone.update(g, a_state, params)
        assert torch.allclose(outs[k]["w"], want["w"] * factor)


def test_errors():
    with pytest.raises(ValueError, match="factor"):
        ftopt.reduce_on_plateau(factor=1.0)
    with pytest.raises(ValueError, match="rtol or atol"):
        ftopt.reduce_on_plateau(rtol=0.0, atol=0.0)
    with pytest.raises(ValueError, match="patience"):
        ftopt.reduce_on_plateau(patience=0)
    tx = ftopt.reduce_on_plateau()
    params = {"w": torch.ones(2)}
    with pytest.raises(TypeError, match="value="):
        tx.update(params, tx.init(params), params)
    with pytest.raises(ValueError, match="one number"):
        tx.update(params, tx.init(params), params, value=torch.ones(2))
