"""adaptive_grad_clip against float64 math written from optax's formula (units in torch's
layouts), with clipped and unclipped units in every draw; optax's own layout through
``axis``; fused chains against eager; bad input refused before anything is written."""

from __future__ import annotations

import pytest
import torch

import ftopt

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = {"linear": (12, 7), "bias": (12,), "conv": (6, 3, 3, 3), "row": (1, 9),
          "scalar": (), "conv3d": (4, 2, 2, 2, 3)}


def _units(x: torch.Tensor) -> tuple[int, ...]:
    """The dims a unit spans in torch's layouts (timm's adaptive_clip_grad): the whole
    leaf when at most one dim exceeds 1, else all dims but the first."""
    if x.squeeze().ndim <= 1:
        return tuple(range(x.ndim))
    return tuple(range(1, x.ndim))


def _reference(u: torch.Tensor, p: torch.Tensor, clipping: float, eps: float,
               axes: tuple[int, ...]) -> torch.Tensor:
    u, p = u.double(), p.double()
    if axes:
        g_norm = u.square().sum(dim=axes, keepdim=True).sqrt()
        p_norm = p.square().sum(dim=axes, keepdim=True).sqrt()
    else:
        g_norm, p_norm = u.abs(), p.abs()
    max_norm = clipping * p_norm.clamp_min(eps)
    return torch.where(g_norm < max_norm, u, u * (max_norm / g_norm.clamp_min(1e-6)))


def _draw(seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    p = {k: torch.randn(s, generator=gen).to(DEVICE, dtype) for k, s in SHAPES.items()}
    # Gradients of mixed scale: per unit, some above clipping·‖p‖ and some below.
    g = {}
    for k, s in SHAPES.items():
        scale = torch.rand(s[:1] if len(s) > 1 and s[0] > 1 else (), generator=gen)
        scale = (10.0 ** (3 * scale - 2)).reshape(scale.shape + (1,) * (len(s) - scale.ndim))
        g[k] = (torch.randn(s, generator=gen) * scale).to(DEVICE, dtype)
    return p, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_per_unit(dtype):
    p, g = _draw(1, dtype)
    clipping, eps = 0.1, 1e-3
    tx = ftopt.adaptive_grad_clip(clipping, eps)
    p0, g0 = {k: v.clone() for k, v in p.items()}, {k: v.clone() for k, v in g.items()}
    u, _ = tx.update(g, tx.init(p), p)
    clipped = kept = 0
    for k in SHAPES:
        want = _reference(g[k], p[k], clipping, eps, _units(g[k]))
        assert u[k].dtype == torch.float32 and u[k].shape == g[k].shape
        torch.testing.assert_close(u[k].double(), want, rtol=2e-6, atol=1e-30)
        same = (want == g[k].double())
        clipped += int((~same).sum())
        kept += int(same.sum())
    assert clipped > 0 and kept > 0  # both branches drawn
    for k in SHAPES:  # inputs untouched
        assert torch.equal(p[k], p0[k]) and torch.equal(g[k], g0[k])


def test_units_are_output_rows_and_axis_gives_optaxs_layout():
    p, g = _draw(2)
    u, _ = ftopt.adaptive_grad_clip(0.05).update(g, None, p)
    ratio = u["linear"].norm(dim=1) / p["linear"].norm(dim=1).clamp_min(1e-3)
    assert (ratio <= 0.05 * (1 + 1e-6)).all() and (ratio > 0.05 * 0.999).any()
    # optax's default on JAX's (in, out) kernels is axis 0: the same units.
    pt, gt = {"k": p["linear"].T.contiguous()}, {"k": g["linear"].T.contiguous()}
    ut, _ = ftopt.adaptive_grad_clip(0.05, axis=0).update(gt, None, pt)
    torch.testing.assert_close(ut["k"].T, u["linear"], rtol=1e-6, atol=0)
    uc, _ = ftopt.adaptive_grad_clip(0.05, axis=(1, 2, 3)).update(
        {"c": g["conv"]}, None, {"c": p["conv"]})
    torch.testing.assert_close(uc["c"], u["conv"], rtol=0, atol=0)


@pytest.mark.parametrize("skip", [False, True])
def test_fused_chain_equals_eager(skip):
    p, g = _draw(3)
    g["linear"][2:5] = 0.0  # whole zero rows and a zero element
    g["bias"][4] = 0.0
    parts = [ftopt.adaptive_grad_clip(0.05), ftopt.adamw(1e-2, weight_decay=0.1)]
    tx = ftopt.chain(*parts, *([ftopt.skip_zeros()] if skip else []))
    runs = {}
    for backend in ("fused", "eager"):
        q, s = p, tx.init(p)
        for _ in range(3):
            q, s = ftopt.step(tx, q, g, s, backend=backend)
        runs[backend] = q
    for k in SHAPES:
        torch.testing.assert_close(runs["fused"][k], runs["eager"][k], rtol=1e-6, atol=1e-7)
    zero = g["linear"] == 0
    moved = runs["eager"]["linear"] != p["linear"]
    if skip:
        assert torch.equal(runs["fused"]["linear"][zero], p["linear"][zero])
        assert not moved[zero].any()
    else:  # the control: weight decay moves them
        assert moved[zero].all()


def test_bad_input_is_refused_before_anything_is_written():
    p, g = _draw(4)
    tx = ftopt.chain(ftopt.adam(1e-2), ftopt.adaptive_grad_clip(0.05))
    state = tx.init(p)
    before = [t.clone() for t in ftopt.tree.leaves((p, state))]
    for _ in range(2):  # a call with params first: its cached launch must not serve one without
        tx.update(g, state, p, backend="fused")
    for backend in ("fused", "eager"):
        with pytest.raises(ValueError, match="adaptive_grad_clip needs params"):
            tx.update(g, state, backend=backend)
    bad = ftopt.chain(ftopt.adam(1e-2), ftopt.adaptive_grad_clip(0.05, axis=3))
    for backend in ("fused", "eager"):
        with pytest.raises(ValueError, match=r"at \['bias'\]: axis 3 is out of range"):
            ftopt.step(bad, p, g, bad.init(p), donate=True, backend=backend)
    after = ftopt.tree.leaves((p, state))
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    with pytest.raises(ValueError, match="clipping must be"):
        ftopt.adaptive_grad_clip(-1.0)
    with pytest.raises(TypeError, match="axis must be"):
        ftopt.adaptive_grad_clip(0.1, axis=())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unitwise_norm_is_each_units_norm_broadcast(dtype):
    """Against float64 norms written unit by unit: torch's layouts by default, optax's
    ``axis`` otherwise; fp32 for bf16 input."""
    gen = torch.Generator().manual_seed(3)
    for name, shape in SHAPES.items():
        x = torch.randn(shape, generator=gen).to(DEVICE, dtype)
        got = ftopt.unitwise_norm(x)
        assert got.shape == x.shape and got.dtype == torch.float32, name
        axes = _units(x)
        want = (x.double().square().sum(dim=axes, keepdim=True).sqrt() if axes
                else x.double().abs()).expand(x.shape)
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    x = torch.randn(4, 3, generator=gen).to(DEVICE)
    for i in range(3):  # axis=0: one unit a column
        torch.testing.assert_close(ftopt.unitwise_norm(x, axis=0)[:, i],
                                   x[:, i].norm().expand(4))
    assert torch.equal(ftopt.unitwise_norm(x, axis=(0, -1)), x.norm().expand(4, 3))
    with pytest.raises(ValueError, match="unitwise_norm: axis 2 is out of range"):
        ftopt.unitwise_norm(x, axis=2)
    with pytest.raises(TypeError, match="axis must be an int"):
        ftopt.unitwise_norm(x, axis=1.0)
    with pytest.raises(TypeError, match="expected a floating-point tensor"):
        ftopt.unitwise_norm(torch.ones(3, dtype=torch.int64))


def test_unitwise_clip_and_norm_compose_to_adaptive_grad_clip():
    """adaptive_grad_clip's update is unitwise_clip(unitwise_norm(u), clipping ·
    max(unitwise_norm(p), eps), u), bit for bit; units under their bound keep their bits
    (the control: the others change), and a zero norm divides by div_eps."""
    p, u = _draw(11)
    clipping, eps = 0.05, 1e-3
    tx = ftopt.adaptive_grad_clip(clipping, eps)
    got, _ = tx.update(u, tx.init(p), p)
    kept = changed = 0
    for k in SHAPES:
        g_norm = ftopt.unitwise_norm(u[k])
        max_norm = clipping * ftopt.unitwise_norm(p[k]).clamp_min(eps)
        want = ftopt.unitwise_clip(g_norm, max_norm, u[k])
        assert torch.equal(got[k], want), k
        under = g_norm < max_norm
        assert torch.equal(want[under], u[k][under])
        kept, changed = kept + int(under.sum()), changed + int((want != u[k]).sum())
    assert kept and changed
    zero = torch.zeros(3)
    assert torch.equal(ftopt.unitwise_clip(zero, zero, torch.ones(3)), zero)
    assert torch.equal(ftopt.unitwise_clip(zero, zero, torch.ones(3), div_eps=0.5), zero)
