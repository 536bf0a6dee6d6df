"""DP-SGD (optax.contrib's ``differentially_private_aggregate`` and ``dpsgd``) and optax's
per-example clipping functions: optax's docstring examples, float64 math transcribed from
optax, the noise (add_noise's at gamma 0: its bits, its statistics, its reproducibility),
bad input, skip_zeros refused, a checkpoint round trip, a private training run. (Their
gradients are per-example, which the registry suites do not pass:
``tests/registry.py::PARAMS_WRAPPERS`` sends them here.)"""

from __future__ import annotations

import io
import math

import pytest
import torch

import ftopt
from ftopt.transforms.noise import AddNoiseState

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F64 = torch.float64


def _tree(gen, batch=None, scale=1.0) -> dict:
    lead = () if batch is None else (batch,)
    shapes = {"w": (6, 5), "b": (5,), "s": ()}
    return {k: (scale * torch.randn(lead + s, generator=gen)).to(DEVICE)
            for k, s in shapes.items()}


def _ref_clipped_sum(grads: dict, clip: float) -> dict:
    """optax: m_i = nan_to_num(min(C/‖g_i‖, 1), nan=1), Σ_i m_i·g_i, in float64."""
    g = {k: v.to(F64).cpu() for k, v in grads.items()}
    batch = next(iter(g.values())).shape[0]
    norms = torch.tensor([math.sqrt(sum(float(v[i].square().sum()) for v in g.values()))
                          for i in range(batch)], dtype=F64)
    m = torch.nan_to_num(torch.minimum(clip / norms, torch.ones_like(norms)), nan=1.0)
    return {k: torch.einsum("b,b...->...", m, v) for k, v in g.items()}


@pytest.mark.parametrize("fn", ["per_example_global_norm_clip", "per_example_layer_norm_clip"])
def test_optax_docstring_examples(fn):
    grads = [torch.tensor([[0, 0, 0], [0, 3, 4], [4, 0, 3], [3, 4, 0]],
                          dtype=torch.float32, device=DEVICE)]
    for clip, want, clipped in ((math.inf, 7.0, 0), (0.0, 0.0, 3), (1.25, 1.75, 3)):
        sums, count = getattr(ftopt, fn)(grads, clip)
        assert torch.equal(sums[0].cpu(), torch.full((3,), want))
        count = count if fn == "per_example_global_norm_clip" else count[0]
        assert count.dtype == torch.int32 and int(count) == clipped


def test_clipping_matches_float64():
    gen = torch.Generator().manual_seed(1)
    grads = _tree(gen, batch=7)
    for k, v in grads.items():  # norms from ~0.1 to ~10: some clipped, some not
        grads[k] = v * torch.logspace(-1.5, 1, 7, device=DEVICE).view(-1, *[1] * (v.ndim - 1))
    grads["w"][2] = 0.0
    grads["b"][2] = 0.0
    grads["s"][2] = 0.0  # an all-zero example: multiplier 1 (optax's nan_to_num)
    clip = 2.0
    sums, count = ftopt.per_example_global_norm_clip(grads, clip)
    want = _ref_clipped_sum(grads, clip)
    for k in grads:
        torch.testing.assert_close(sums[k].cpu().to(F64), want[k], rtol=2e-6, atol=1e-6)
    norms = [math.sqrt(sum(float(v[i].double().square().sum()) for v in grads.values()))
             for i in range(7)]
    assert int(count) == sum(n > clip for n in norms) and 0 < int(count) < 7
    # per layer: C/√K each (uniform), C·√(Dₖ/D) (not)
    for uniform in (True, False):
        sums, counts = ftopt.per_example_layer_norm_clip(grads, clip, uniform=uniform)
        total = sum(v[0].numel() for v in grads.values())
        for k, v in grads.items():
            c = clip * math.sqrt(1 / 3 if uniform else v[0].numel() / total)
            want = _ref_clipped_sum({k: v}, c)[k]
            torch.testing.assert_close(sums[k].cpu().to(F64), want, rtol=2e-6, atol=1e-6)
            per = [float(v[i].double().norm()) for i in range(7)]
            assert int(counts[k]) == sum(n > c for n in per)


def test_aggregate_without_noise_is_the_clipped_mean():
    gen = torch.Generator().manual_seed(2)
    params, grads = _tree(gen), _tree(gen, batch=9, scale=1.5)
    tx = ftopt.differentially_private_aggregate(l2_norm_clip=3.0, noise_multiplier=0.0)
    u, state = tx.update(grads, tx.init(params), params)
    want = _ref_clipped_sum(grads, 3.0)
    for k in grads:
        assert u[k].shape == params[k].shape and u[k].dtype == params[k].dtype
        torch.testing.assert_close(u[k].cpu().to(F64), want[k] / 9, rtol=2e-6, atol=1e-7)
    assert int(state.count) == 1


def test_noise_is_add_noise_at_gamma_zero_and_reproducible():
    gen = torch.Generator().manual_seed(3)
    params, grads = _tree(gen), _tree(gen, batch=4)
    clip, mult, seed = 1.5, 0.7, 11
    tx = ftopt.differentially_private_aggregate(clip, mult, seed=seed)
    quiet = ftopt.differentially_private_aggregate(clip, 0.0)
    noise = ftopt.add_noise((clip * mult) ** 2, 0.0, seed)
    state, zeros = tx.init(params), {k: torch.zeros_like(v) for k, v in params.items()}
    last = None
    for _ in range(3):
        u, new = tx.update(grads, state, params)
        clean, _ = quiet.update(grads, quiet.init(params), params)
        z, _ = noise.update(zeros, AddNoiseState(state.count), params, backend="eager")
        for k in params:  # (Σ m·g + σz)/B, one division: within rounding of the sum
            torch.testing.assert_close(u[k], clean[k] + z[k] / 4, rtol=1e-6, atol=1e-6)
        again, _ = tx.update(grads, state, params)
        assert all(torch.equal(again[k], u[k]) for k in params)
        if last is not None:  # (the control: another step draws other noise)
            assert not torch.equal(u["w"], last["w"])
        last, state = u, new
    other = ftopt.differentially_private_aggregate(clip, mult, seed=seed + 1)
    u2, _ = other.update(grads, other.init(params), params)
    u1, _ = tx.update(grads, tx.init(params), params)
    assert not torch.equal(u1["w"], u2["w"])


def test_noise_statistics():
    """N(0, (C·σ)²)/B per element: the mean and standard deviation of 2·10⁵ draws."""
    n, batch, clip, mult = 200_000, 8, 2.0, 1.3
    params = {"w": torch.zeros(n, device=DEVICE)}
    grads = {"w": torch.zeros(batch, n, device=DEVICE)}
    tx = ftopt.differentially_private_aggregate(clip, mult, seed=5)
    u, _ = tx.update(grads, tx.init(params), params)
    z = u["w"].double() * batch / (clip * mult)
    assert abs(float(z.mean())) < 5 / math.sqrt(n)
    assert abs(float(z.std()) - 1) < 5 / math.sqrt(2 * n)


def test_dpsgd_is_the_chain_and_matches_float64():
    """dpsgd = aggregate, trace(momentum, nesterov), scale_by_learning_rate: three steps
    against float64 (no noise), and the chain's bits with noise."""
    gen = torch.Generator().manual_seed(4)
    params = _tree(gen)
    lr, clip, mom = 0.1, 2.5, 0.9
    for nesterov in (False, True):
        tx = ftopt.dpsgd(lr, clip, 0.0, momentum=mom, nesterov=nesterov)
        p, s = params, tx.init(params)
        ref_p = {k: v.to(F64).cpu() for k, v in params.items()}
        tr = {k: torch.zeros_like(v) for k, v in ref_p.items()}
        for _ in range(3):
            grads = _tree(gen, batch=5, scale=2.0)
            p, s = ftopt.step(tx, p, grads, s)
            agg = {k: v / 5 for k, v in _ref_clipped_sum(grads, clip).items()}
            tr = {k: agg[k] + mom * tr[k] for k in tr}
            d = {k: agg[k] + mom * tr[k] for k in tr} if nesterov else tr
            ref_p = {k: ref_p[k] - lr * d[k] for k in tr}
        for k in params:
            torch.testing.assert_close(p[k].cpu().to(F64), ref_p[k], rtol=1e-5, atol=1e-6)
    noisy = ftopt.dpsgd(lr, clip, 1.1, seed=9)
    chained = ftopt.chain(ftopt.differentially_private_aggregate(clip, 1.1, seed=9),
                          ftopt.identity(), ftopt.scale_by_learning_rate(lr))
    grads = _tree(gen, batch=5)
    a, _ = ftopt.step(noisy, params, grads, noisy.init(params))
    b, _ = ftopt.step(chained, params, grads, chained.init(params))
    assert all(torch.equal(a[k], b[k]) for k in params)


def test_bad_input_is_refused_and_leaves_inputs_alone():
    gen = torch.Generator().manual_seed(6)
    params, grads = _tree(gen), _tree(gen, batch=3)
    kept = {k: v.clone() for k, v in params.items()}
    tx = ftopt.dpsgd(0.1, 1.0, 1.0)
    state = tx.init(params)
    bad = dict(grads, w=torch.randn(4, 6, 5, device=DEVICE))
    with pytest.raises(ValueError, match=r"\['w'\] has shape \(4, 6, 5\).*batch 3"):
        ftopt.step(tx, params, bad, state)
    with pytest.raises(ValueError, match="batch on dim 0"):
        ftopt.step(tx, params, dict(grads, s=torch.tensor(1.0, device=DEVICE)), state)
    with pytest.raises(TypeError, match=r"\['b'\]: expected a floating-point tensor"):
        ftopt.step(tx, params, dict(grads, b=torch.ones(3, 5, dtype=torch.int64,
                                                        device=DEVICE)), state)
    skipping = ftopt.chain(ftopt.differentially_private_aggregate(1.0, 1.0),
                           ftopt.sgd(0.1), ftopt.skip_zeros())
    with pytest.raises(TypeError, match="cannot run under skip_zeros"):
        ftopt.step(skipping, params, grads, skipping.init(params))
    assert all(torch.equal(params[k], kept[k]) for k in params)
    assert int(state[0].count) == 0
    for kwargs, err in (({"l2_norm_clip": -1.0}, ValueError),
                        ({"l2_norm_clip": math.inf}, ValueError),
                        ({"noise_multiplier": -0.5}, ValueError),
                        ({"seed": -1}, ValueError), ({"seed": 1.5}, TypeError)):
        args = {"l2_norm_clip": 1.0, "noise_multiplier": 1.0, **kwargs}
        with pytest.raises(err, match="differentially_private_aggregate: "
                                      + next(iter(kwargs))):
            ftopt.differentially_private_aggregate(**args)
    with pytest.raises(RuntimeError, match="per-example gradients"):
        ftopt.step(tx, params, grads, state, backend="fused")


def test_pure_and_checkpoint_round_trip():
    gen = torch.Generator().manual_seed(7)
    params = _tree(gen)
    tx = ftopt.dpsgd(0.05, 1.0, 0.8, seed=2, momentum=0.5)
    p, s = params, tx.init(params)
    steps = [_tree(gen, batch=4) for _ in range(4)]
    for g in steps[:2]:
        copies = {k: v.clone() for k, v in g.items()}
        p, s = ftopt.step(tx, p, g, s, donate=False)
        assert all(torch.equal(g[k], copies[k]) for k in g)
    buf = io.BytesIO()
    torch.save({"p": p, "s": s}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    a, b = (p, s), (loaded["p"], loaded["s"])
    for g in steps[2:]:
        a = ftopt.step(tx, *a[:1], g, a[1])
        b = ftopt.step(tx, *b[:1], g, b[1])
    assert all(torch.equal(a[0][k], b[0][k]) for k in params)


def test_private_training_lowers_the_loss():
    """Logistic regression with per-example gradients from torch.func.vmap(grad)."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(256, 10, generator=gen).to(DEVICE)
    w_true = torch.randn(10, generator=gen).to(DEVICE)
    y = (x @ w_true > 0).float()
    params = {"w": torch.zeros(10, device=DEVICE), "b": torch.zeros((), device=DEVICE)}

    def loss(p, xb, yb):
        return torch.nn.functional.binary_cross_entropy_with_logits(xb @ p["w"] + p["b"], yb)

    per_example = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))
    tx = ftopt.dpsgd(0.5, l2_norm_clip=1.0, noise_multiplier=0.3, seed=1, momentum=0.9)
    state, start = tx.init(params), float(loss(params, x, y))
    for i in range(60):
        batch = slice(32 * (i % 8), 32 * (i % 8 + 1))
        grads = per_example(params, x[batch], y[batch])
        params, state = ftopt.step(tx, params, grads, state)
    assert float(loss(params, x, y)) < 0.6 * start
