"""Prodigy on the fused path: one rule whose global sums (Σ g·(x0 − p), Σ|s|) are the
reduction pass's and whose estimate and numerator the main kernel computes and stores.
With skip_zeros the skipped elements keep their params and states bit for bit, fused
follows eager and both the float64 reference; a fused step reads nothing from the device."""

from __future__ import annotations

import pytest
import torch
from reference_prodigy import RefProdigy

import ftopt
from ftopt.rule_transform import rule_transform
from ftopt.transforms.prodigy import prodigy_rule

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HP = dict(learning_rate=5.0, betas=(0.8, 0.9), eps=1e-3, estim_lr0=1e-3, weight_decay=0.05)
REF = dict(lr=5.0, b1=0.8, b2=0.9, eps=1e-3, estim_lr0=1e-3, weight_decay=0.05)
SHAPES = {"w": (64, 80), "b": (70,)}
_HOST_READS = ("item", "__bool__", "__float__", "__int__", "tolist", "numpy")

pytestmark = pytest.mark.usefixtures("one_thread")


def _rule():
    """Prodigy as the one rule the fused path runs (not yet the alias' default)."""
    return rule_transform(prodigy_rule(5.0, 0.8, 0.9, 0.9 ** 0.5, 1e-3, 1e-3, 1.0, 0.05,
                                       False))


def _params(gen):
    return {k: torch.randn(s, generator=gen).to(DEVICE) for k, s in SHAPES.items()}


def _grads(params, gen, zeros: bool = False):
    """Each element's sign fixed over the steps (the estimate grows); some exact zeros."""
    out = {}
    for k, p in params.items():
        sign = 1.0 - 2.0 * (torch.arange(p.numel()) % 2).reshape(p.shape)
        g = sign * (0.1 + torch.rand(p.shape, generator=gen))
        if zeros:
            g = torch.where(torch.rand(p.shape, generator=gen) < 0.3, 0.0, g)
        out[k] = g.to(DEVICE)
    return out


@pytest.mark.parametrize("donate", [False, True])
def test_skip_zeros_fused_keeps_skipped_bits(donate):
    gen = torch.Generator().manual_seed(12)
    tx = ftopt.skip_zeros(_rule())
    ref = RefProdigy(**REF)
    params = _params(gen)
    pe, se = params, tx.init(params)
    pf = {k: v.clone() for k, v in params.items()}
    sf = tx.init(pf)
    pr = {k: v.double().cpu() for k, v in params.items()}
    for _ in range(5):
        g = _grads(params, gen, zeros=True)
        before_p = {k: v.clone() for k, v in pf.items()}
        before_s = [{k: v.clone() for k, v in getattr(sf[0], n).items()}
                    for n in ("exp_avg", "exp_avg_sq", "grad_sum")]
        pe, se = ftopt.step(tx, pe, g, se, backend="eager")
        pf, sf = ftopt.step(tx, pf, g, sf, backend="fused", donate=donate)
        pr = ref.step(pr, {k: v.cpu() for k, v in g.items()},
                      skip={k: (v == 0).cpu() for k, v in g.items()})
        for k in SHAPES:
            zero = g[k] == 0
            assert torch.equal(pf[k][zero], before_p[k][zero])
            for old, name in zip(before_s, ("exp_avg", "exp_avg_sq", "grad_sum")):
                assert torch.equal(getattr(sf[0], name)[k][zero], old[k][zero])
            torch.testing.assert_close(pf[k], pe[k], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(pe[k].double().cpu(), pr[k], rtol=1e-5, atol=1e-5)
    assert abs(float(sf[0].estim_lr) - ref.estim) <= 1e-4 * ref.estim


def test_fused_step_reads_nothing_from_the_device(monkeypatch):
    gen = torch.Generator().manual_seed(14)
    tx = _rule()
    params = _params(gen)
    state = tx.init(params)
    params, state = ftopt.step(tx, params, _grads(params, gen), state, backend="fused",
                               donate=True)
    grads = [_grads(params, gen) for _ in range(2)]
    with monkeypatch.context() as m:
        for name in _HOST_READS:
            def guard(self, *args, _name=name, **kwargs):
                raise AssertionError(f"host read ({_name}) during a fused Prodigy step")
            m.setattr(torch.Tensor, name, guard)
        if DEVICE == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            for g in grads:
                params, state = ftopt.step(tx, params, g, state, backend="fused",
                                           donate=True)
        finally:
            if DEVICE == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    assert int(state.count) == 3
