"""Optimistic Adam in optax's two interfaces: optax's docstring example of
``optimistic_adam`` (a bilinear game whose plain Adam cycles, which optimism brings to its
equilibrium) and the identity ``optimistic_adam(lr, o) == optimistic_adam_v2(1, alpha=lr,
beta=o)``, bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

import ftopt

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _game(opt, length=1025, dtype=torch.float32):
    """optax's example: f(x, y) = x·y, x descends, y ascends; the distance to (0, 0)."""
    params = (torch.tensor(1.0, dtype=dtype, device=DEVICE),
              torch.tensor(2.0, dtype=dtype, device=DEVICE))
    state, distances = opt.init(params), []
    for _ in range(length):
        x, y = params
        distances.append(math.hypot(float(x), float(y)))
        grads = (y, -x)  # ∂f/∂x, −∂f/∂y
        updates, state = opt.update(grads, state, params)
        params = ftopt.apply_updates(params, updates)
    return distances


def test_optax_docstring_example():
    """optax prints 2.243, 2.195, 2.161, 2.055, 0.796, 0.001. The same steps in float64
    give 0.79549 at step 256 (which prints 0.795): optax's float32 rounding lands a few
    1e-6 higher; ftopt's float32 run is 1.5e-6 from float64."""
    distances = _game(ftopt.optimistic_adam(1e-2, 1.0))
    exact = _game(ftopt.optimistic_adam(1e-2, 1.0), dtype=torch.float64)
    printed = [2.243, 2.195, 2.161, 2.055, 0.796, 0.001]
    for i, want in enumerate(printed):
        k = 4 ** i
        assert abs(distances[k] - want) <= 1e-3, (k, distances[k])
        assert abs(distances[k] - exact[k]) <= 1e-5 * max(exact[k], 1.0), (k, distances[k])
    plain = _game(ftopt.adam(1e-2))  # (the control: without optimism it does not converge)
    assert plain[1024] > 1.0


@pytest.mark.parametrize("kw", [{}, {"optimism": 0.3, "nesterov": False}])
def test_the_older_interface_is_v2_with_unit_learning_rate(kw):
    gen = torch.Generator().manual_seed(1)
    params = {"w": torch.randn(7, 3, generator=gen).to(DEVICE)}
    a = ftopt.optimistic_adam(0.02, b1=0.8, **kw)
    b = ftopt.optimistic_adam_v2(1.0, alpha=0.02, beta=kw.get("optimism", 0.02), b1=0.8,
                                 nesterov=kw.get("nesterov", True))
    pa, sa, pb, sb = params, a.init(params), params, b.init(params)
    for _ in range(4):
        g = {"w": torch.randn(7, 3, generator=gen).to(DEVICE)}
        pa, sa = ftopt.step(a, pa, g, sa)
        pb, sb = ftopt.step(b, pb, g, sb)
    assert torch.equal(pa["w"], pb["w"]) and not torch.equal(pa["w"], params["w"])
    with pytest.raises(ValueError, match="optimistic_adam: learning_rate cannot be a schedule"):
        ftopt.optimistic_adam(ftopt.schedules.constant_schedule(1e-2))
