"""Polyak's step size (``scale_by_polyak``, ``polyak_sgd``) against optax's formula."""

from __future__ import annotations

import math

import pytest
import torch

import ftopt


def test_polyak_sgd_reproduces_optax_example():
    # optax's docstring: f(x) = sum(x²) from [1, 2, 3], five steps
    tx = ftopt.polyak_sgd()
    params = {"x": torch.tensor([1.0, 2.0, 3.0])}
    state = tx.init(params)
    seen = []
    for _ in range(5):
        x = params["x"]
        value, grad = float((x * x).sum()), {"x": 2 * x}
        u, state = tx.update(grad, state, params, value=value)
        params = ftopt.apply_updates(params, u)
        seen.append(float((params["x"] ** 2).sum()))
    assert seen == pytest.approx([3.5, 0.875, 0.21875, 0.0546875, 0.013671875], rel=1e-6)


@pytest.mark.parametrize("variant", ["sps", "sps+"])
@pytest.mark.parametrize("f_min,eps,max_lr", [(0.0, 0.0, 1.0), (0.5, 1e-3, 0.05),
                                              (3.0, 0.0, 10.0)])
def test_matches_formula(variant, f_min, eps, max_lr):
    gen = torch.Generator().manual_seed(3)
    tx = ftopt.scale_by_polyak(f_min, max_lr, eps, variant)
    for value in (2.0, 0.1, 7.5):
        u = {"w": torch.randn(5, 3, generator=gen, dtype=torch.float64),
             "b": torch.randn(4, generator=gen, dtype=torch.float64), "none": None}
        got, _ = tx.update(u, tx.init(u), value=value)
        sq = float(u["w"].square().sum() + u["b"].square().sum())
        gap = value - f_min
        if variant == "sps+":
            gap = max(gap, 0.0)
        step = 0.0 if sq + eps <= 2.220446049250313e-16 else min(gap / (sq + eps), max_lr)
        assert got["none"] is None
        for k in ("w", "b"):
            assert torch.allclose(got[k], u[k] * step, rtol=1e-12, atol=0.0), (k, step)


def test_zero_updates_step_zero_and_no_host_read(monkeypatch):
    tx = ftopt.scale_by_polyak()
    u = {"w": torch.zeros(3)}

    def forbid(*_args, **_kwargs):
        raise AssertionError("a branch on a tensor's value")

    monkeypatch.setattr(torch.Tensor, "__bool__", forbid)
    got, _ = tx.update(u, tx.init(u), value=torch.tensor(1.0))
    monkeypatch.undo()
    assert torch.equal(got["w"], torch.zeros(3)) and not torch.isnan(got["w"]).any()


def test_errors():
    with pytest.raises(ValueError, match="variant"):
        ftopt.scale_by_polyak(variant="sps++")
    with pytest.raises(ValueError, match="max_learning_rate"):
        ftopt.polyak_sgd(max_learning_rate=-1.0)
    tx = ftopt.polyak_sgd()
    p = {"w": torch.ones(2)}
    with pytest.raises(TypeError, match="value="):
        tx.update(p, tx.init(p), p)
    with pytest.raises(ValueError, match="f_min"):
        ftopt.scale_by_polyak(f_min=math.nan)
