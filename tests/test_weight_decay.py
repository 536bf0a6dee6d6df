"""Weight decay with a schedule (optax's ``add_decayed_weights(schedule)``) and cautious
weight decay (optax.contrib's ``add_cautious_weight_decay``) against float64 math written
from their formulas, on both backends."""

from __future__ import annotations

import pytest
import torch
from step_checks import fresh_generator

import ftopt

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = {"w": (16, 12), "b": (33,)}


def _tree(gen, dtype=torch.float32, zeros: float = 0.0) -> dict:
    """Random leaves; a fraction ``zeros`` of the elements +0.0 or -0.0."""
    out = {}
    for name, shape in SHAPES.items():
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        hit = torch.rand(shape, generator=gen, dtype=torch.float64) < zeros
        sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0).double()
        out[name] = torch.where(hit, 0.0 * sign, x).to(DEVICE, dtype)
    return out


def _cautious64(u, p, wd):
    """The formula in float64: u + wd·p where sign(u)·sign(p) >= 0."""
    u, p = u.double(), p.double()
    return torch.where(torch.sign(u) * torch.sign(p) >= 0, u + wd * p, u)


def _near(x, ref, scale) -> None:
    """``x`` (fp32 or 16-bit) within two roundings of its dtype of the float64 ``ref``."""
    eps = torch.finfo(x.dtype).eps
    err = (x.double() - ref).abs()
    assert bool((err <= 2 * eps * (ref.abs() + scale.abs()) + 1e-30).all()), \
        float((err - 2 * eps * (ref.abs() + scale.abs())).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_cautious_decay_matches_float64(backend, dtype):
    """One step of the transform alone, zeros of both signs in u and p among random
    values: the decay lands exactly where the signs are not opposite."""
    gen = fresh_generator()
    wd = 0.3
    params, updates = _tree(gen, dtype, zeros=0.2), _tree(gen, dtype, zeros=0.2)
    tx = ftopt.add_cautious_weight_decay(wd)
    out, _ = tx.update(updates, tx.init(params), params, backend=backend)
    for k in SHAPES:
        ref = _cautious64(updates[k], params[k], wd)
        _near(out[k], ref, wd * params[k].double())
        opposite = torch.sign(updates[k]) * torch.sign(params[k]) < 0
        assert bool(opposite.any()) and bool((~opposite).any())
        assert torch.equal(out[k][opposite], updates[k][opposite])  # untouched, bit for bit
        moved = ~opposite & (params[k] != 0)
        assert bool((out[k][moved] != updates[k][moved]).any())  # the control: it decays


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_cautious_decay_reads_signs_not_the_product(backend):
    """u = ±1e-30 against p = ∓1e-30: their fp32 product underflows to -0.0, which a
    ``u·p >= 0`` test would call aligned; the signs say opposite, so u is kept. A zero
    update of either sign decays (sign(0) = 0)."""
    tiny = 1e-30
    u = torch.tensor([tiny, -tiny, 0.0, -0.0, 2.0, -2.0], device=DEVICE)
    p = torch.tensor([-tiny, tiny, 3.0, 3.0, 1.0, 1.0], device=DEVICE)
    assert bool((u[:2] * p[:2] == 0).all())
    tx = ftopt.add_cautious_weight_decay(0.5)
    params, updates = {"x": p}, {"x": u}
    out, _ = tx.update(updates, tx.init(params), params, backend=backend)
    want = torch.tensor([tiny, -tiny, 1.5, 1.5, 2.5, -2.0], device=DEVICE)
    assert torch.equal(out["x"], want), out["x"]


@pytest.mark.parametrize("cautious", [False, True])
@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_scheduled_decay_follows_its_schedule(backend, cautious):
    """``chain(scale_by_adam, decay(schedule), scale_by_learning_rate)`` over 5 steps
    against float64 Adam with wd = schedule(t − 1) at step t; the count is kept in
    ``WeightDecaySchedule`` and a checkpoint taken mid-way continues bit for bit."""
    gen = fresh_generator()
    lr, b1, b2, eps = 0.05, 0.8, 0.95, 1e-8
    schedule = ftopt.linear_schedule(0.4, 0.05, 3)
    make = ftopt.add_cautious_weight_decay if cautious else ftopt.add_decayed_weights
    tx = ftopt.chain(ftopt.scale_by_adam(b1, b2, eps), make(schedule),
                     ftopt.scale_by_learning_rate(lr))
    params = _tree(gen)
    state = tx.init(params)
    assert isinstance(state[1], ftopt.WeightDecaySchedule)
    ref = {k: p.double() for k, p in params.items()}
    m = {k: torch.zeros_like(p) for k, p in ref.items()}
    v = {k: torch.zeros_like(p) for k, p in ref.items()}
    grads_by_step = [_tree(gen) for _ in range(5)]
    for t, grads in enumerate(grads_by_step, start=1):
        if t == 3:
            saved = (params, ftopt.tree.map(torch.clone, ftopt.state_dict(state, tx, params)))
        params, state = ftopt.step(tx, params, grads, state, backend=backend)
        assert int(state[1].count) == t
        wd = float(schedule(t - 1))
        for k in SHAPES:
            g = grads[k].double()
            m[k] = b1 * m[k] + (1 - b1) * g
            v[k] = b2 * v[k] + (1 - b2) * g * g
            d = (m[k] / (1 - b1 ** t)) / ((v[k] / (1 - b2 ** t)).sqrt() + eps)
            d = _cautious64(d, ref[k], wd) if cautious else d + wd * ref[k]
            step = -lr * d
            ref[k] = ref[k] + step
            err = (params[k].double() - ref[k]).abs()
            assert bool((err <= 1e-5 * step.abs() + 2e-7 * ref[k].abs() + 1e-7).all()), \
                (t, k, float(err.max()))
    resumed = saved[0]
    loaded = ftopt.load_state_dict(tx.init(resumed), tx, resumed, saved[1])
    for grads in grads_by_step[2:]:
        resumed, loaded = ftopt.step(tx, resumed, grads, loaded, backend=backend)
    assert int(loaded[1].count) == 5
    assert all(torch.equal(resumed[k], params[k]) for k in SHAPES)


def test_aliases_take_a_scheduled_weight_decay():
    """An alias whose decay is ``add_decayed_weights`` takes a schedule as optax's does:
    ``adamw(lr, weight_decay=schedule)`` is the chain with the scheduled decay, bit for
    bit."""
    gen = fresh_generator()
    schedule = ftopt.cosine_decay_schedule(0.2, 4)
    a = ftopt.adamw(0.01, weight_decay=schedule)
    b = ftopt.chain(ftopt.scale_by_adam(0.9, 0.999, 1e-8), ftopt.add_decayed_weights(schedule),
                    ftopt.scale_by_learning_rate(0.01))
    params = _tree(gen)
    pa, pb = params, params
    sa, sb = a.init(params), b.init(params)
    for _ in range(4):
        grads = _tree(gen)
        pa, sa = ftopt.step(a, pa, grads, sa, backend="eager")
        pb, sb = ftopt.step(b, pb, grads, sb, backend="eager")
    assert all(torch.equal(pa[k], pb[k]) for k in SHAPES)


def test_a_negative_decay_is_refused():
    """The constant is checked (>= 0) when the transform is made, naming it."""
    for make in (ftopt.add_decayed_weights, ftopt.add_cautious_weight_decay):
        with pytest.raises(ValueError, match="weight_decay"):
            make(-0.1)
