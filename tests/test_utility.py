"""optax's everyday utilities against float64 formulas written here (optax's math), over
20+ steps, eagerly and fused (in the interpreter on a CPU): ``zero_nans``, ``clip``,
``keep_params_nonnegative``, ``centralize``, ``clip_by_block_rms``,
``scale_by_param_block_norm``."""

from __future__ import annotations

import math

import pytest
import torch

import ftopt

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = {"w": (6, 5), "conv": (3, 2, 4), "b": (7,), "s": ()}
LR = 0.05
STEPS = 20


def _tree(gen, scale=1.0):
    return {k: (scale * torch.randn(s, generator=gen, dtype=torch.float64)) for k, s in
            SHAPES.items()}


def _with_nans(g, gen):
    out = {}
    for k, v in g.items():
        hole = torch.rand(v.shape, generator=gen, dtype=torch.float64) < 0.2
        out[k] = torch.where(hole, math.nan, v)
    return out


def _ref_zero_nans(u, p):
    return torch.where(torch.isnan(u), 0.0, u)


def _ref_clip(u, p, max_delta=0.3):
    return torch.where(torch.isnan(u), u, u.clamp(-max_delta, max_delta))


def _ref_nonnegative(u, p):
    return torch.where(p + u < 0, -p, u)


def _ref_centralize(u, p):
    if u.dim() <= 1:
        return u
    return u - u.mean(dim=tuple(range(1, u.dim())), keepdim=True)


def _ref_block_rms(u, p, threshold=0.4):
    rms = u.square().mean().sqrt()
    return u / torch.clamp(rms / threshold, min=1.0)


def _ref_param_block_norm(u, p, min_scale=0.8):
    norm = p.square().sum().sqrt()  # (the 0-d leaf's |p| is below 0.8 now and then)
    return u * (min_scale if norm <= min_scale else norm)


# name -> (transform, float64 reference of its update, gradients with NaNs?, params >= 0?)
CASES = {
    "zero_nans": (lambda: ftopt.zero_nans(), _ref_zero_nans, True, False),
    "clip": (lambda: ftopt.clip(0.3), _ref_clip, False, False),
    "clip[tensor]": (lambda: ftopt.clip(torch.tensor(0.3, device=DEVICE)), _ref_clip, False,
                     False),
    "keep_params_nonnegative": (ftopt.keep_params_nonnegative, _ref_nonnegative, False, True),
    "centralize": (ftopt.centralize, _ref_centralize, False, False),
    "clip_by_block_rms": (lambda: ftopt.clip_by_block_rms(0.4), _ref_block_rms, False, False),
    "scale_by_param_block_norm": (lambda: ftopt.scale_by_param_block_norm(0.8),
                                  _ref_param_block_norm, False, False),
}


def _run_both(name, backend):
    make, ref, nans, nonneg = CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    params64 = _tree(gen)
    if nonneg:
        params64 = {k: v.abs() for k, v in params64.items()}
    # The update -lr * u would cross zero now and then: the rule must stop it.
    tx = ftopt.chain(ftopt.scale_by_learning_rate(LR), make()) if nonneg else ftopt.chain(
        make(), ftopt.scale_by_learning_rate(LR))
    params = {k: v.float().to(DEVICE) for k, v in params64.items()}
    state = tx.init(params)
    crossed = 0
    for _ in range(STEPS):
        g64 = _tree(gen, scale=10.0 if nonneg else 1.0)
        if nans:
            g64 = _with_nans(g64, gen)
        g64 = {k: v.float().double() for k, v in g64.items()}  # the same fp32 values
        grads = {k: v.float().to(DEVICE) for k, v in g64.items()}
        params, state = ftopt.step(tx, params, grads, state, backend=backend)
        for k in params64:
            if nonneg:
                crossed += int((params64[k] - LR * g64[k] < 0).sum())
                params64[k] = params64[k] + ref(-LR * g64[k], params64[k])
            else:
                params64[k] = params64[k] - LR * ref(g64[k], params64[k])
        for k in params:
            got = params[k].double().cpu()
            assert torch.isfinite(got).all(), (name, k)
            assert torch.allclose(got, params64[k], rtol=1e-5, atol=1e-6), (name, k)
            if nonneg:
                assert (got >= 0).all(), (name, k)
    if nonneg:
        assert crossed > 0, "the test never made an update cross zero"
    return params


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_float64_reference_eager(name):
    _run_both(name, "eager")


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_float64_reference_fused(name):
    fused = _run_both(name, "fused")
    eager = _run_both(name, "eager")
    # The params' norm scales every element's step: the two sums' orders (the kernel's
    # tree, torch's) part by an ulp, and after 20 steps the leaves differ by ~1e-7 of
    # their largest element, more than 1e-6 of a small element's own size.
    rtol = 1e-5 if name == "scale_by_param_block_norm" else 1e-6
    for k in fused:
        assert torch.allclose(fused[k].cpu(), eager[k].cpu(), rtol=rtol, atol=1e-7), k


def test_zero_nans_keeps_infinities_and_clip_keeps_nan():
    u = {"w": torch.tensor([math.nan, math.inf, -math.inf, 2.0, -3.0])}
    got, _ = ftopt.zero_nans().update(u, ftopt.EmptyState())
    assert torch.equal(got["w"], torch.tensor([0.0, math.inf, -math.inf, 2.0, -3.0]))
    got, _ = ftopt.clip(1.0).update(u, ftopt.EmptyState())
    assert torch.isnan(got["w"][0])
    assert torch.equal(got["w"][1:], torch.tensor([1.0, -1.0, 1.0, -1.0]))


def test_block_rms_leaves_small_leaves_alone_and_centralize_1d():
    u = {"small": torch.full((4,), 0.1), "big": torch.full((2, 2), 3.0)}
    got, _ = ftopt.clip_by_block_rms(1.0).update(u, ftopt.EmptyState())
    assert torch.equal(got["small"], u["small"])
    assert torch.allclose(got["big"], torch.full((2, 2), 1.0))
    got, _ = ftopt.centralize().update(u, ftopt.EmptyState())
    assert torch.equal(got["small"], u["small"])
    assert torch.equal(got["big"], torch.zeros(2, 2))


def test_bad_hyperparameters_are_refused():
    with pytest.raises(ValueError, match="clip: max_delta"):
        ftopt.clip(-1.0)
    with pytest.raises(ValueError, match="clip_by_block_rms: threshold"):
        ftopt.clip_by_block_rms(0.0)
    with pytest.raises(ValueError, match="params"):
        ftopt.keep_params_nonnegative().update({"w": torch.ones(2)}, ftopt.EmptyState())
