"""Adafactor and Muon (matrix-stage optimizers) against float64 references of optax's math.

The references below are written from optax's code (``optax/_src/factorized.py``,
``optax.adafactor``, ``optax/contrib/_muon.py``) in float64, one leaf at a time, and run
>= 20 steps on 1-D, 2-D (factored and not) and 3-D leaves. The fused backend (Triton
kernels; the interpreter on a CPU) must match the eager one, and ``skip_zeros`` keeps
params and per-element states bit-identical where the raw gradient is zero.
"""

from __future__ import annotations

import math

import pytest
import torch

import ftopt
from ftopt.lowering.plan import plan_chain
from ftopt.quant import dequantize_blockwise, dynamic_map, encode_with_absmax, expand_absmax
from tests.step_checks import assert_kept_where_zero, bits, zero_step

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SHAPES = {"w": (12, 10), "v": (12, 10), "t": (4, 6), "b": (9,), "c": (3, 10, 12)}


def _tree(gen, zeros: bool = False, scale: float = 1.0):
    tree = {k: (scale * torch.randn(s, generator=gen)).to(DEVICE) for k, s in SHAPES.items()}
    if zeros:
        tree["w"][1, 2] = 0.0
        tree["w"][3] = -0.0
        tree["b"][0] = 0.0
        tree["c"][1, :, 4] = 0.0
        tree["t"][2, 3] = 0.0
    return tree


# ---- float64 references ---------------------------------------------------------------------
def _factored_dims(shape, min_dim):
    if len(shape) < 2:
        return None
    order = sorted(range(len(shape)), key=lambda i: shape[i])
    return None if shape[order[-2]] < min_dim else (order[-2], order[-1])


class AdafactorRef:
    """optax.adafactor(lr, min_dim, decay_rate, clipping_threshold=c, momentum=m,
    weight_decay_rate=wd), in float64."""

    def __init__(self, lr, min_dim=8, decay_rate=0.8, clip=1.0, momentum=None, wd=None,
                 eps=1e-30, param_scale=True):
        self.lr, self.min_dim, self.decay, self.clip = lr, min_dim, decay_rate, clip
        self.momentum, self.wd, self.eps, self.param_scale = momentum, wd, eps, param_scale
        self.count, self.state, self.mom = 0, {}, {}

    def step(self, params, grads):
        beta = 1.0 - (self.count + 1.0) ** (-self.decay)
        self.count += 1
        out = {}
        for k, p in params.items():
            g, p = grads[k].double(), p.double()
            dims = _factored_dims(g.shape, self.min_dim)
            g2 = g * g + self.eps
            if dims is not None:
                d1, d0 = dims
                row, col = self.state.get(k, (0.0, 0.0))
                row = beta * row + (1 - beta) * g2.mean(dim=d0)
                col = beta * col + (1 - beta) * g2.mean(dim=d1)
                self.state[k] = (row, col)
                rd1 = d1 - 1 if d1 > d0 else d1
                rf = (row / row.mean(dim=rd1, keepdim=True)) ** -0.5
                u = g * rf.unsqueeze(d0) * (col ** -0.5).unsqueeze(d1)
            else:
                v = beta * self.state.get(k, 0.0) + (1 - beta) * g2
                self.state[k] = v
                u = g * v ** -0.5
            if self.clip is not None:
                u = u / max(1.0, float(u.pow(2).mean().sqrt()) / self.clip)
            u = u * self.lr
            if self.param_scale:
                u = u * max(float(p.pow(2).mean().sqrt()), 1e-3)
            if self.momentum is not None:
                u = self.momentum * self.mom.get(k, 0.0) + (1 - self.momentum) * u
                self.mom[k] = u
            if self.wd is not None:
                u = u + self.wd * p
            out[k] = p - u
        return out


def _ns64(x, steps=5, coeffs=(3.4445, -4.7750, 2.0315), eps=1e-8):
    a, b, c = coeffs
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class MuonRef:
    """optax.contrib.muon(lr, beta=beta, weight_decay=wd, adaptive=...) in float64: 2-D
    leaves Muon, the others AdamW (nesterov, as optax passes it)."""

    def __init__(self, lr, beta=0.95, wd=0.0, adaptive=False, b1=0.9, b2=0.999, eps=1e-8,
                 adam_wd=0.0):
        self.lr, self.beta, self.wd, self.adaptive = lr, beta, wd, adaptive
        self.b1, self.b2, self.eps, self.adam_wd = b1, b2, eps, adam_wd
        self.t, self.mu, self.nu = 0, {}, {}

    def step(self, params, grads):
        self.t += 1
        out = {}
        for k, p in params.items():
            g, p = grads[k].double(), p.double()
            if g.dim() == 2:
                bt, t = self.beta, self.t
                mu = bt * self.mu.get(k, 0.0) + (1 - bt) * g
                self.mu[k] = mu
                m_hat = bt * mu / (1 - bt ** (t + 1)) + (1 - bt) * g / (1 - bt**t)
                u = self.matrix(k, m_hat) + self.wd * p
            else:
                u = self.adam(k, g) + self.adam_wd * p
            out[k] = p - self.lr * u
        return out

    def matrix(self, k, m_hat):
        """Muon's update of the matrix leaf ``k`` from its momentum ``m_hat``."""
        o = _ns64(m_hat)
        if self.adaptive:
            o = (m_hat * o).sum() * o
        return o * math.sqrt(max(1.0, m_hat.shape[1] / m_hat.shape[0]))

    def adam(self, k, g):
        """AdamW's update (nesterov, no decay) of the leaf ``k``."""
        b1, b2, t = self.b1, self.b2, self.t
        mu = b1 * self.mu.get(k, 0.0) + (1 - b1) * g
        nu = b2 * self.nu.get(k, 0.0) + (1 - b2) * g * g
        self.mu[k], self.nu[k] = mu, nu
        m_hat = b1 * mu / (1 - b1 ** (t + 1)) + (1 - b1) * g / (1 - b1**t)
        return m_hat / ((nu / (1 - b2**t)).sqrt() + self.eps)


def _adafactor_pair(**kw):
    ref_kw = {"lr": kw.get("learning_rate"), "min_dim": kw.get("min_dim_size_to_factor", 8),
              "clip": kw.get("clipping_threshold", 1.0), "momentum": kw.get("momentum"),
              "wd": kw.get("weight_decay_rate")}
    kw.setdefault("min_dim_size_to_factor", 8)
    return ftopt.adafactor(**kw), AdafactorRef(**ref_kw)


ADAFACTOR_CASES = {
    "defaults": {"learning_rate": 0.05},
    "momentum, decay, clip 0.5": {"learning_rate": 0.05, "momentum": 0.9,
                                  "weight_decay_rate": 0.01, "clipping_threshold": 0.5},
    "no clip": {"learning_rate": 0.1, "clipping_threshold": None},
}


def _check_against(tx, ref, backend, steps=20, rtol=1e-4):
    gen = torch.Generator().manual_seed(0)
    params = _tree(gen)
    ref_params = {k: v.double() for k, v in params.items()}
    state = tx.init(params)
    for _ in range(steps):
        grads = _tree(gen)
        params, state = ftopt.step(tx, params, grads, state, backend=backend)
        ref_params = ref.step(ref_params, grads)
    for k in params:
        assert torch.allclose(params[k].double(), ref_params[k], rtol=rtol, atol=rtol), k
    return params, state


@pytest.mark.parametrize("case", list(ADAFACTOR_CASES))
@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_adafactor_matches_float64_reference(case, backend):
    tx, ref = _adafactor_pair(**ADAFACTOR_CASES[case])
    _, state = _check_against(tx, ref, backend)
    factored = state[0]
    # w, v (12x10) and c (3x10x12) are factored, t (4x6, dims < 8) and b are not; as
    # optax, v_row drops the largest dim and v_col the second largest
    assert factored.v_row["w"].shape == (10,) and factored.v_col["w"].shape == (12,)
    assert factored.v_row["c"].shape == (3, 10) and factored.v_col["c"].shape == (3, 12)
    assert factored.v["t"].shape == (4, 6) and factored.v["w"].shape == (1,)
    assert int(factored.count) == 20


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_muon_matches_float64_reference(adaptive, backend):
    """The alias is a ``partition`` (optax's routing): fused in segments, the Muon and
    Adam branches in the same kernels (see tests/test_muon_fused.py)."""
    tx = ftopt.muon(0.02, weight_decay=0.01, adaptive=adaptive, ns_dtype=torch.float32)
    ref = MuonRef(0.02, wd=0.01, adaptive=adaptive)
    _check_against(tx, ref, backend, rtol=2e-4)


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_muon_chain_matches_float64_reference(backend):
    """The Muon half of the alias as one chain (fused in segments) on 2-D leaves."""
    tx = ftopt.chain(ftopt.scale_by_muon(ns_dtype=torch.float32), ftopt.scale_by_shape(),
                     ftopt.add_decayed_weights(0.01), ftopt.scale_by_learning_rate(0.02))
    ref = MuonRef(0.02, wd=0.01)
    gen = torch.Generator().manual_seed(0)
    keys = [k for k, s in SHAPES.items() if len(s) == 2]
    params = {k: torch.randn(SHAPES[k], generator=gen).to(DEVICE) for k in keys}
    ref_params = {k: v.double() for k, v in params.items()}
    state = tx.init(params)
    for _ in range(20):
        grads = {k: torch.randn(SHAPES[k], generator=gen).to(DEVICE) for k in keys}
        params, state = ftopt.step(tx, params, grads, state, backend=backend)
        ref_params = ref.step(ref_params, grads)
    for k in keys:
        assert torch.allclose(params[k].double(), ref_params[k], rtol=2e-4, atol=2e-4), k


def test_scale_by_muon_orthogonalises_as_the_reference():
    gen = torch.Generator().manual_seed(3)
    tx = ftopt.scale_by_muon(beta=0.9, nesterov=False, ns_dtype=torch.float32)
    u = {"a": torch.randn(7, 5, generator=gen), "b": torch.randn(7, 5, generator=gen),
         "c": torch.randn(5, 7, generator=gen), "d": torch.randn(4, generator=gen)}
    out, state = tx.update(u, tx.init(u))
    for k in "abc":
        # first step, no Nesterov: m̂ = (1−β)·g/(1−β) = g
        assert torch.allclose(out[k].double(), _ns64(u[k].double()), rtol=1e-5, atol=1e-5)
    assert torch.allclose(out["d"], u["d"], rtol=1e-6)
    assert torch.equal(state[0].count, torch.tensor(1, dtype=torch.int32))


def test_newton_schulz_batches_equal_shapes():
    gen = torch.Generator().manual_seed(4)
    calls = []
    original = torch.linalg.matrix_norm

    def counting(x, *a, **k):
        calls.append(tuple(x.shape))
        return original(x, *a, **k)

    u = {"a": torch.randn(6, 4, generator=gen), "b": torch.randn(6, 4, generator=gen),
         "c": torch.randn(3, 3, generator=gen)}
    tx = ftopt.scale_by_muon(ns_dtype=torch.float32)
    torch.linalg.matrix_norm = counting
    try:
        tx.update(u, tx.init(u))
    finally:
        torch.linalg.matrix_norm = original
    assert sorted(calls) == [(1, 3, 3), (2, 4, 6)]  # tall leaves are transposed


def test_muon_default_ns_dtype_is_bf16_on_cuda_only():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 8, 6, generator=gen)
    from ftopt.transforms.muon import _ns_dtype
    assert _ns_dtype(x, None) == torch.float32
    assert _ns_dtype(x.double(), None) == torch.float64
    assert _ns_dtype(x, torch.bfloat16) == torch.bfloat16
    if torch.cuda.is_available():
        assert _ns_dtype(x.cuda(), None) == torch.bfloat16


def test_chains_fuse_their_elementwise_stages():
    params = _tree(torch.Generator().manual_seed(6))
    ada = ftopt.adafactor(0.05, momentum=0.9, weight_decay_rate=0.01,
                          min_dim_size_to_factor=8)
    text = ftopt.explain(ada, params, backend="fused", file=open("/dev/null", "w"))
    assert ("segments: [p + u] fused -> scale_by_factored_rms (matrix stage" in text
            or "scale_by_factored_rms (matrix stage" in text)
    assert ("[clip_by_block_rms, scale_by_learning_rate, scale_by_param_block_rms, ema, "
            "add_decayed_weights, scale] fused") in text
    mu = ftopt.chain(ftopt.scale_by_muon(), ftopt.scale_by_shape(),
                     ftopt.add_decayed_weights(0.1), ftopt.scale_by_learning_rate(0.1))
    segments = plan_chain(mu).segments
    assert segments is not None and [type(s).__name__ for s in segments][0] == "ChainPlan"
    assert segments[0].stages[0].rule.name == "muon_momentum"


@pytest.mark.parametrize("make", [
    lambda skip: ftopt.adafactor(0.05, momentum=0.9, weight_decay_rate=0.01,
                                 min_dim_size_to_factor=8, skip_zeros=skip),
    lambda skip: ftopt.chain(ftopt.scale_by_muon(ns_dtype=torch.float32),
                             ftopt.scale_by_shape(), ftopt.add_decayed_weights(0.01),
                             ftopt.scale_by_learning_rate(0.02),
                             *([ftopt.skip_zeros()] if skip else [])),
], ids=["adafactor", "scale_by_muon chain"])
@pytest.mark.parametrize("donate", [False, True])
def test_fused_matches_eager(make, donate):
    results = {}
    for backend in ("fused", "eager"):
        tx = make(True)
        gen = torch.Generator().manual_seed(7)
        params = _tree(gen)
        state = tx.init(params)
        for _ in range(4):
            params, state = ftopt.step(tx, params, _tree(gen, zeros=True), state,
                                       backend=backend, donate=donate)
        results[backend] = (params, state)
    for x, y in zip(ftopt.tree.leaves(results["fused"]), ftopt.tree.leaves(results["eager"])):
        assert torch.allclose(x.double(), y.double(), rtol=1e-5, atol=1e-6)


def _per_element_states(tx_name, state):
    """The per-element float states (which skip_zeros keeps bit for bit)."""
    if tx_name == "adafactor":
        factored, ema_state = state[0], state[4]
        return {"v": factored.v, "ema": ema_state.ema}
    return {"mu": state[0][0].mu}


@pytest.mark.parametrize("name", ["adafactor", "muon_chain"])
@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_skip_zeros_keeps_params_and_states(name, backend):
    """Warm up, then a step with zeros: params and per-element states keep their bits
    where the raw gradient is zero; the control (no skip_zeros) moves them. Adafactor's
    row and column means are reductions and advance (SPEC §3 for norms)."""
    out = {}
    warm = torch.Generator().manual_seed(9)
    warmup = [_tree(warm), _tree(warm)]
    grads = _tree(torch.Generator().manual_seed(10), zeros=True)
    for skip in (False, True):
        if name == "adafactor":
            tx = ftopt.adafactor(0.05, momentum=0.9, weight_decay_rate=0.01,
                                 min_dim_size_to_factor=8, skip_zeros=skip)
        else:
            tx = ftopt.chain(ftopt.scale_by_muon(ns_dtype=torch.float32),
                             ftopt.scale_by_learning_rate(0.02),
                             *([ftopt.skip_zeros()] if skip else []))
        out[skip] = zero_step(tx, _tree(torch.Generator().manual_seed(8)), warmup, grads,
                              lambda state: _per_element_states(name, state), backend)
    assert_kept_where_zero(grads, *out[True])
    c_before, _, c_new, _ = out[False]
    assert any(bool((c_new[k][g == 0] != c_before[k][g == 0]).any())
               for k, g in grads.items())


def test_adafactor_bad_state_names_the_leaf_and_writes_nothing():
    tx = ftopt.adafactor(0.05, min_dim_size_to_factor=8)
    gen = torch.Generator().manual_seed(11)
    params = _tree(gen)
    state = tx.init(params)
    bad = state[0]._replace(v_row={**state[0].v_row, "w": torch.zeros(5, device=DEVICE)})
    state = (bad, *state[1:])
    snapshot = {k: v.clone() for k, v in params.items()}
    for backend in ("eager", "fused"):
        with pytest.raises(ValueError, match=r"v_row at \['w'\]"):
            ftopt.step(tx, params, _tree(gen), state, backend=backend, donate=True)
        for k in params:
            assert torch.equal(params[k], snapshot[k])
    with pytest.raises(ValueError, match="decay_rate"):
        ftopt.scale_by_factored_rms(decay_rate=-1.0)
    with pytest.raises(ValueError, match="ns_steps"):
        ftopt.scale_by_muon(ns_steps=0)
    with pytest.raises(ValueError, match="preconditioning"):
        ftopt.scale_by_muon(preconditioning="aol")


def test_block_rms_transforms_match_optax_formulas():
    gen = torch.Generator().manual_seed(12)
    u = {"a": 3 * torch.randn(5, 4, generator=gen), "b": 0.01 * torch.randn(6, generator=gen)}
    p = {"a": torch.randn(5, 4, generator=gen), "b": torch.full((6,), 1e-5)}
    clipped, _ = ftopt.clip_by_block_rms(0.5).update(u, ftopt.EmptyState())
    scaled, _ = ftopt.scale_by_param_block_rms(1e-3).update(u, ftopt.EmptyState(), p)
    for k in u:
        rms = u[k].double().pow(2).mean().sqrt()
        want = u[k].double() / max(1.0, float(rms) / 0.5)
        assert torch.allclose(clipped[k].double(), want, rtol=1e-6), k
        p_rms = float(p[k].double().pow(2).mean().sqrt())
        want = u[k].double() * max(p_rms, 1e-3)
        assert torch.allclose(scaled[k].double(), want, rtol=1e-6), k


# ---- Adafactor's momentum storage: bf16 (dtype_momentum / state_dtype) and 8 bits --------
# "big" has 4608 elements (>= min_size 4096, 18 blocks of 256), so state_bits=8 quantizes it.
LAYOUT_SHAPES = {"big": (64, 72), "w": (12, 10), "b": (9,)}
LAYOUTS = {
    "dtype_momentum bf16": {"dtype_momentum": torch.bfloat16},
    "state_dtype fp16": {"state_dtype": torch.float16},
    "state_bits 8": {"state_bits": 8},
    "state_bits 8, bf16": {"state_bits": 8, "state_dtype": torch.bfloat16},
}


def _layout_tree(gen, zeros: bool = False):
    tree = {k: torch.randn(s, generator=gen).to(DEVICE) for k, s in LAYOUT_SHAPES.items()}
    if zeros:
        tree["big"][:8] = 0.0  # flat elements 0..575: blocks 0 and 1 all zero
        tree["big"][20, ::3] = -0.0
        tree["w"][2] = 0.0
        tree["b"][4] = 0.0
    return tree


def _adafactor_layout(layout, skip):
    return ftopt.adafactor(0.05, momentum=0.9, weight_decay_rate=0.01,
                           min_dim_size_to_factor=8, skip_zeros=skip, **LAYOUTS[layout])


def _ema(state):
    return state[4].ema


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_adafactor_momentum_layouts_fused_match_eager(layout):
    """Each layout keeps its storage through steps, and the fused backend matches the
    eager one: 16-bit states to one unit in the last place (an fp32 rounding difference
    may flip a 16-bit rounding), params to fp32 rounding, or to a few 16-bit units of the
    update where the momentum is 16-bit, 8-bit codes exactly but for a rare one-code tie,
    absmax to fp32 rounding."""
    want = torch.bfloat16 if "bf16" in layout else (
        torch.float16 if "fp16" in layout else torch.float32)
    runs = {}
    for backend in ("eager", "fused"):
        tx = _adafactor_layout(layout, skip=False)
        gen = torch.Generator().manual_seed(21)
        params = _layout_tree(gen)
        state = tx.init(params)
        for _ in range(4):
            params, state = ftopt.step(tx, params, _layout_tree(gen), state, backend=backend)
        runs[backend] = (params, state)
    for backend, (_, state) in runs.items():
        ema = _ema(state)
        if "state_bits 8" in layout:
            assert isinstance(ema["big"], ftopt.rules.QuantizedSlot), backend
            assert ema["big"].codes.dtype == torch.uint8 and ema["big"].absmax.shape == (18,)
        else:
            assert ema["big"].dtype == want, backend
        assert ema["w"].dtype == want and ema["b"].dtype == want, backend
        assert state[0].v_row["big"].dtype == torch.float32  # second moments stay fp32
    (p_e, s_e), (p_f, s_f) = runs["eager"], runs["fused"]
    for k in LAYOUT_SHAPES:
        e, f = _ema(s_e)[k], _ema(s_f)[k]
        sixteen = isinstance(e, torch.Tensor) and e.dtype != torch.float32
        # the update (the momentum) is ~1e-2 here: one bf16 unit of it is ~4e-5
        atol = 2e-4 if sixteen else 1e-6
        assert torch.allclose(p_f[k], p_e[k], rtol=1e-5, atol=atol), k
        if isinstance(e, ftopt.rules.QuantizedSlot):
            step = (f.codes.int() - e.codes.int()).abs()
            assert int(step.max()) <= 1 and float((step > 0).float().mean()) < 1e-3, k
            assert torch.allclose(f.absmax, e.absmax, rtol=1e-5), k
        elif not sixteen:
            ulp = torch.finfo(e.dtype).eps
            assert torch.allclose(f, e, rtol=2 * ulp, atol=1e-7), k
        else:
            # In units in the last place of the 16-bit values: a 1-ulp fp32 difference
            # upstream (the kernels round without fma, torch's CUDA ops with it) can round
            # the other way, and the next steps carry it on: at most 2 units measured on
            # the CPU, 8 on an H200 (4 steps); 16 allowed.
            spacing = (torch.nextafter(e, e.new_full((), float("inf"))) - e).float().abs()
            ulps = ((f.float() - e.float()).abs() / spacing).max()
            assert ulps <= 16, (k, float(ulps))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_adafactor_momentum_layouts_skip_zeros(layout, backend):
    """Where the raw gradient is zero: params bit-identical; a 16-bit momentum keeps its
    bits; an 8-bit one keeps all-zero blocks byte for byte (codes and absmax) and re-encodes
    other skipped elements from their old value under the new absmax (SPEC §5)."""
    tx = _adafactor_layout(layout, skip=True)
    gen = torch.Generator().manual_seed(22)
    params = _layout_tree(gen)
    state = tx.init(params)
    for _ in range(2):
        params, state = ftopt.step(tx, params, _layout_tree(gen), state, backend=backend)
    before_p = {k: v.clone() for k, v in params.items()}
    before = ftopt.tree.map(lambda x: x.clone(), _ema(state))
    grads = _layout_tree(gen, zeros=True)
    new_p, new_state = ftopt.step(tx, params, grads, state, backend=backend)
    after = _ema(new_state)
    for k, g in grads.items():
        zero = g == 0
        assert torch.equal(bits(new_p[k])[zero], bits(before_p[k])[zero]), k
        assert not torch.equal(new_p[k][~zero], before_p[k][~zero]), k  # the rest moves
        old, new = before[k], after[k]
        if not isinstance(new, ftopt.rules.QuantizedSlot):
            assert torch.equal(new[zero], old[zero]), k
            continue
        assert torch.equal(new.codes.reshape(-1)[:512], old.codes.reshape(-1)[:512]), k
        assert torch.equal(new.absmax[:2], old.absmax[:2]), k
        qmap = dynamic_map(True, new.codes.device)
        old_value = dequantize_blockwise(old.codes, old.absmax, qmap).reshape(-1)
        per_element = expand_absmax(new.absmax, old_value.numel())
        want = encode_with_absmax(old_value, per_element, qmap)
        flat_zero = zero.reshape(-1)
        assert torch.equal(new.codes.reshape(-1)[flat_zero], want[flat_zero]), k
        assert bool((new.absmax[2:] != old.absmax[2:]).any()), k


def test_adafactor_dtype_momentum_errors_name_the_argument():
    with pytest.raises(ValueError, match="adafactor: dtype_momentum must be"):
        ftopt.adafactor(0.1, momentum=0.9, dtype_momentum=torch.float64)
    with pytest.raises(TypeError, match="adafactor: dtype_momentum must be a torch.dtype"):
        ftopt.adafactor(0.1, momentum=0.9, dtype_momentum="bf16")
    with pytest.raises(ValueError, match="disagree"):
        ftopt.adafactor(0.1, momentum=0.9, dtype_momentum=torch.float16,
                        state_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="adafactor: state_bits must be 8 or 32"):
        ftopt.adafactor(0.1, momentum=0.9, state_bits=16)
    # without momentum there is no per-element state to store: the chain is unchanged
    params = {"w": torch.randn(12, 10, device=DEVICE)}
    tx = ftopt.adafactor(0.1, dtype_momentum=torch.bfloat16, min_dim_size_to_factor=8)
    state = tx.init(params)
    assert ftopt.tree.leaves(state[1:]) == [] and state[0].v_row["w"].dtype == torch.float32
