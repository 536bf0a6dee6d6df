"""Prodigy on the fused path: one rule whose global sums (Σ g·(x0 − p), Σ|s|) are the
reduction pass's and whose estimate and numerator the main kernel computes and stores.
With skip_zeros the skipped elements keep their params and states bit for bit, fused
follows eager and both the float64 reference; a fused step reads nothing from the device.
The alias (``ftopt.prodigy``, that rule): both backends follow float64 over 20 steps, agree
step by step within SPEC §6, fp64 params keep E in float64, ``weight_decay_mask`` (the
torch stage) follows float64, the state is the stage's, and a donated step's launches and
torch ops do not grow with the number of leaves."""

from __future__ import annotations

import contextlib
import io

import optree
import pytest
import torch
from reference_prodigy import RefProdigy
from torch.utils._python_dispatch import TorchDispatchMode

import ftopt
from ftopt.lowering import tiles
from ftopt.rule_transform import rule_transform
from ftopt.transforms.prodigy import prodigy_rule

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HP = dict(learning_rate=5.0, betas=(0.8, 0.9), eps=1e-3, estim_lr0=1e-3, weight_decay=0.05)
REF = dict(lr=5.0, b1=0.8, b2=0.9, eps=1e-3, estim_lr0=1e-3, weight_decay=0.05)
SHAPES = {"w": (64, 80), "b": (70,)}
_HOST_READS = ("item", "__bool__", "__float__", "__int__", "tolist", "numpy")

pytestmark = pytest.mark.usefixtures("one_thread")


def _rule():
    """Prodigy as the one rule (the alias' transform without weight_decay_mask)."""
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


# ---- the alias (ftopt.prodigy) on both backends against float64 -------------------------

ALIAS = dict(learning_rate=1.0, betas=(0.9, 0.999), eps=1e-8, estim_lr0=1e-3,
             weight_decay=0.05)
ALIAS_REF = dict(lr=1.0, b1=0.9, b2=0.999, eps=1e-8, estim_lr0=1e-3, weight_decay=0.05)
# Faster moments: the estimate grows ~900-fold in 20 steps. (With lr = 5 and
# safeguard_warmup it grows without bound, E ~1e30 by step 16: the backends and float64
# then part ways as any two fp32 runs of a diverging recurrence do.)
GROW = dict(learning_rate=1.0, betas=(0.8, 0.9), eps=1e-3, estim_lr0=1e-3, weight_decay=0.05)
GROW_REF = dict(lr=1.0, b1=0.8, b2=0.9, eps=1e-3, estim_lr0=1e-3, weight_decay=0.05)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x − ref| relative to max |ref|."""
    x, ref = x.double().cpu(), ref.double().cpu()
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


@pytest.mark.parametrize("safeguard", [False, True])
@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_alias_follows_float64_over_20_steps(backend, safeguard):
    """20 steps with gradients of fixed sign (the estimate grows ~500-fold): params within
    1e-6 of the float64 reference, the estimate within 2e-6 (its numerator is a dot product
    of fp32 sums). The two backends sum in different orders and are as close to float64."""
    gen = torch.Generator().manual_seed(31)
    tx = ftopt.prodigy(**GROW, safeguard_warmup=safeguard)
    ref = RefProdigy(**GROW_REF, safeguard_warmup=safeguard)
    params = _params(gen)
    pr = {k: v.double().cpu() for k, v in params.items()}
    state = tx.init(params)
    for _ in range(20):
        g = _grads(params, gen)
        params, state = ftopt.step(tx, params, g, state, backend=backend, donate=True)
        pr = ref.step(pr, {k: v.cpu() for k, v in g.items()})
        for k in SHAPES:
            assert _rel(params[k], pr[k]) <= 1e-6, k
    assert ref.estim > 100 * GROW_REF["estim_lr0"]  # (the estimate did grow)
    assert abs(float(state[0].estim_lr) / ref.estim - 1) <= 2e-6


def test_alias_fused_matches_eager_step_by_step():
    """SPEC §6 from the same inputs at every step: params, m, v, s, E and num within 1e-6
    relative; counts and params0 equal."""
    gen = torch.Generator().manual_seed(32)
    tx = ftopt.prodigy(**ALIAS)
    params = _params(gen)
    state = tx.init(params)
    for _ in range(6):
        g = _grads(params, gen)
        pf, sf = ftopt.step(tx, params, g, state, backend="fused")
        params, state = ftopt.step(tx, params, g, state, backend="eager")
        (f,), (e,) = sf, state
        for k in SHAPES:
            assert _rel(pf[k], params[k]) <= 1e-6, k
            for name in ("exp_avg", "exp_avg_sq", "grad_sum"):
                assert _rel(getattr(f, name)[k], getattr(e, name)[k]) <= 1e-6, (name, k)
            assert torch.equal(f.params0[k], e.params0[k])
        for name in ("estim_lr", "numerator_weighted"):
            assert _rel(getattr(f, name), getattr(e, name)) <= 1e-6, name
        assert torch.equal(f.count, e.count)


@pytest.mark.parametrize("bits, read, written", [(32, "20", "16"), (8, "11.047", "7.047")])
def test_alias_runs_as_one_fused_rule(bits, read, written):
    """One rule (no torch stage), 8-bit states too; the donated main kernel reads g, p, m,
    v and s and writes p, m, v and s: params0 (fp32 whatever the layout) is read by the
    norm pass only, and a donated step leaves it where it is."""
    params = {"w": torch.randn(64, 80, generator=torch.Generator().manual_seed(1)).to(DEVICE)}
    with contextlib.redirect_stdout(io.StringIO()):
        text = str(ftopt.explain(ftopt.prodigy(**ALIAS, state_bits=bits), params,
                                 donate=True, backend="fused"))
    assert "scale_by_prodigy" in text and "matrix stage" not in text
    assert "path: fused" in text and "kernel launches per step: 3" in text
    assert f"main kernel reads {read}, writes {written};" in text, text


def test_fp64_params_keep_the_estimate_in_float64():
    """fp64 params (the eager path): E and num are float64 tensors of the state and the
    steps follow the float64 reference to 1e-12."""
    gen = torch.Generator().manual_seed(33)
    tx = ftopt.prodigy(**ALIAS)
    params = {k: v.double() for k, v in _params(gen).items()}
    ref = RefProdigy(**ALIAS_REF)
    pr = {k: v.clone().cpu() for k, v in params.items()}
    state = tx.init(params)
    assert state[0].estim_lr.dtype == state[0].numerator_weighted.dtype == torch.float64
    for _ in range(10):
        g = {k: v.double() for k, v in _grads(params, gen).items()}
        params, state = ftopt.step(tx, params, g, state)
        pr = ref.step(pr, {k: v.cpu() for k, v in g.items()})
        for k in SHAPES:
            assert _rel(params[k], pr[k]) <= 1e-12, k
    assert state[0].estim_lr.dtype == torch.float64
    assert abs(float(state[0].estim_lr) / ref.estim - 1) <= 1e-12


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_weight_decay_mask_keeps_the_stage(backend):
    """weight_decay_mask (per-leaf values, which a rule has not) runs the batched torch
    stage: the decay where the mask holds, as the float64 reference does."""
    gen = torch.Generator().manual_seed(34)
    mask = {"w": True, "b": False}
    tx = ftopt.prodigy(**ALIAS, weight_decay_mask=mask)
    ref = RefProdigy(**ALIAS_REF, decayed=mask)
    params = _params(gen)
    pr = {k: v.double().cpu() for k, v in params.items()}
    state = tx.init(params)
    assert "matrix stage" in str(ftopt.explain(tx, params))
    for _ in range(5):
        g = _grads(params, gen)
        params, state = ftopt.step(tx, params, g, state, backend=backend)
        pr = ref.step(pr, {k: v.cpu() for k, v in g.items()})
    for k in SHAPES:
        assert _rel(params[k], pr[k]) <= 1e-6, k


def test_state_layout_is_the_stage_layout():
    """The rule's state is the stage's (optax's ProdigyState): a state either one makes
    loads into the other and steps to the same values."""
    gen = torch.Generator().manual_seed(35)
    params = _params(gen)
    rule_tx = ftopt.prodigy(**ALIAS)
    stage_tx = ftopt.prodigy(**ALIAS, weight_decay_mask={"w": True, "b": True})
    a, b = rule_tx.init(params), stage_tx.init(params)
    fa, sa = optree.tree_flatten(a, namespace="ftopt")
    fb, sb = optree.tree_flatten(b, namespace="ftopt")
    assert sa == sb and type(a[0]) is type(b[0]) is ftopt.ProdigyState
    assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(fa, fb))
    params, b = ftopt.step(stage_tx, params, _grads(params, gen), b)
    g = _grads(params, gen)
    pa, sa = ftopt.step(rule_tx, params, g, b)  # the rule, from the stage's state
    pb, sb = ftopt.step(stage_tx, params, g, b)
    for k in SHAPES:
        assert _rel(pa[k], pb[k]) <= 1e-6, k
    assert _rel(sa[0].estim_lr, sb[0].estim_lr) <= 1e-6


class _Ops(TorchDispatchMode):
    """Counts the ATen ops dispatched, host queries aside."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "promote_types" not in str(func):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_donated_step_ops_do_not_grow_with_leaves(kernel_launches):
    """A donated fused step of the alias: the reduction pass (its kernel, the leaves' sums
    and the global sums) and the main kernel, and the same torch ops, for 3 leaves or 12
    (no per-leaf work on the host or the device)."""
    launches, ops = [], []
    for n in (3, 12):
        gen = torch.Generator().manual_seed(36)
        params = {f"l{i}": torch.randn(5, 3 + i % 4, generator=gen).to(DEVICE)
                  for i in range(n)}
        tx = ftopt.prodigy(**ALIAS)
        state = tx.init(params)
        grads = [{k: torch.randn(v.shape, generator=gen).to(DEVICE) for k, v in params.items()}
                 for _ in range(3)]
        for g in grads[:2]:  # (the plan and the bound launches are cached)
            params, state = ftopt.step(tx, params, g, state, backend="fused", donate=True)
        before = len(kernel_launches)
        with _Ops() as counter:
            params, state = ftopt.step(tx, params, grads[2], state, backend="fused",
                                       donate=True)
        launches.append(len(kernel_launches) - before)
        ops.append(counter.count)
    assert launches[0] == launches[1] <= 4, launches
    assert ops[0] == ops[1], ops


@pytest.mark.parametrize("backend", ["eager", "fused"])
@pytest.mark.parametrize("donate", [False, True])
def test_no_gradient_mass_keeps_the_estimate(backend, donate):
    """Σ|s| = 0 (here: only empty leaves) keeps E and num (optax's 0/0 would be NaN); the
    fused kernel stores them from its one masked program, with or without donation."""
    tx = ftopt.prodigy(**HP)
    params = {"e": torch.randn(2, 0, 3).to(DEVICE), "f": torch.randn(0).to(DEVICE)}
    state = tx.init(params)
    old = state[0].estim_lr.clone()
    poison = {"e": torch.zeros(2, 0, 3).to(DEVICE), "f": torch.zeros(0).to(DEVICE)}
    _, new = ftopt.step(tx, params, poison, state, backend=backend, donate=donate)
    assert torch.equal(new[0].estim_lr, old)
    assert float(new[0].numerator_weighted) == 0.0
    assert int(new[0].count) == 1


@pytest.mark.parametrize("mode", ["stores", "tiles"])
@pytest.mark.parametrize("layout", ["fp32", "bf16 params", "8-bit"])
def test_skip_zeros_zero_first_tiles_still_advance_the_estimate(layout, mode, monkeypatch):
    """Donated skip_zeros steps whose first programs see only zero gradients (tiles that
    store nothing, or may return at once) still store the new E
    and num: the same bits as the steps without donation, which store every tile."""
    monkeypatch.setattr(tiles, "SKIP_MODES", dict.fromkeys(tiles.SKIP_MODES, mode))
    gen = torch.Generator().manual_seed(5)
    tx = ftopt.prodigy(**HP, skip_zeros=True, state_bits=8 if layout == "8-bit" else 32)
    params = {"w": _params(gen)["w"]}
    if layout == "bf16 params":
        params = {k: v.bfloat16() for k, v in params.items()}
    grads = _grads(params, gen)
    grads["w"].view(-1)[:4096] = 0  # (its first programs' tiles, 4096 when interpreted)
    grads = {k: v.to(params[k].dtype) for k, v in grads.items()}
    results = {}
    for donate in (False, True):
        p = optree.tree_map(torch.clone, params)
        s = tx.init(p)
        for _ in range(3):
            p, s = ftopt.step(tx, p, grads, s, backend="fused", donate=donate)
        results[donate] = s[0]
    kept, donated = results[False], results[True]
    assert float(kept.estim_lr) > 1e-3  # (the estimate grew: a check that can fail)
    assert torch.equal(donated.estim_lr, kept.estim_lr)
    assert torch.equal(donated.numerator_weighted, kept.numerator_weighted)


@pytest.mark.parametrize("bits", [32, 8])
def test_step_with_no_gradients_keeps_the_running_scalars(bits):
    """Every gradient ``None`` (the eager one-pass step has nothing to run): E and num are
    kept and the state is a whole ProdigyState, on both backends."""
    tx = ftopt.prodigy(**HP, state_bits=bits)
    params = {"w": torch.randn(300).to(DEVICE)}
    state = tx.init(params)
    for backend in ("eager", "fused"):
        _, new = ftopt.step(tx, params, {"w": None}, state, backend=backend)
        assert isinstance(new[0], ftopt.ProdigyState)
        assert torch.equal(new[0].estim_lr, state[0].estim_lr)
        assert torch.equal(new[0].numerator_weighted, state[0].numerator_weighted)
