"""Partitions whose branches hold matrix stages, fused in segments (``ftopt.muon``).

The fused step must equal the eager one within fp32 rounding (Newton-Schulz amplifies
last-bit differences of its input, so the tolerance is a few ulps times ten), launch two
kernels per group whatever the number of leaves (the Muon momentum; then Muon's
decay and learning rate with the whole Adam branch), run Newton-Schulz once per shape,
keep skip_zeros' guarantees and survive a checkpoint. Small sizes: on the CPU the
kernels run in the Triton interpreter.
"""

from __future__ import annotations

import io

import pytest
import registry
import torch
from step_checks import (
    assert_kept_where_zero,
    assert_trees_close,
    bits,
    fresh_generator,
    zero_step,
)

import ftopt
from ftopt.lowering import plan as plan_lib
from ftopt.transforms import muon as muon_lib

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

pytestmark = pytest.mark.usefixtures("one_thread")

# Two 2-D leaves of one shape, a tall and a wide one (Muon); 1-D, 0-d and 3-D (Adam).
SHAPES = {"w1": (8, 6), "w2": (8, 6), "tall": (10, 4), "wide": (3, 7), "b": (6,),
          "s": (), "c": (2, 3, 4)}


def _tree(gen, zeros: bool = False, dtype=torch.float32):
    tree = {k: torch.randn(s, generator=gen).to(DEVICE, dtype) for k, s in SHAPES.items()}
    if zeros:
        tree["w1"][1] = 0.0
        tree["tall"][:, 2] = -0.0
        tree["b"][:3] = 0.0
        tree["c"][1, 0] = 0.0
    return tree


def _muon(**kw):
    return ftopt.muon(0.02, weight_decay=0.1, adam_weight_decay=0.01,
                      ns_dtype=torch.float32, **kw)


def _run(tx, backend: str, steps: int = 3, donate: bool = False, zeros: bool = False,
         grad_dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    params = _tree(gen)
    state = tx.init(params)
    for _ in range(steps):
        params, state = ftopt.step(tx, params, _tree(gen, zeros, grad_dtype), state,
                                   backend=backend, donate=donate)
    return params, state


def _close(a, b):
    assert_trees_close(a, b, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("donate", [False, True])
def test_muon_fused_matches_eager(nesterov, donate):
    tx = _muon(nesterov=nesterov)
    assert plan_lib.plan_chain(tx).segments is not None
    fused = _run(tx, "fused", donate=donate)
    eager = _run(tx, "eager", donate=donate)
    _close(fused, eager)


def test_muon_fused_bf16_grads_match_eager():
    """16-bit grads: the Adam leaves read their raw (bf16) gradient in the last segment,
    the Muon leaves the matrix stage's fp32 output (one kernel: a per-leaf flag picks)."""
    tx = _muon()
    _close(_run(tx, "fused", grad_dtype=torch.bfloat16),
           _run(tx, "eager", grad_dtype=torch.bfloat16))


def test_two_launches_per_step_and_one_newton_schulz_per_shape(kernel_launches,
                                                               monkeypatch):
    calls = []
    real = muon_lib.newton_schulz
    monkeypatch.setattr(muon_lib, "newton_schulz",
                        lambda x, *a, **k: (calls.append(tuple(x.shape)), real(x, *a, **k))[1])
    tx = _muon()
    _run(tx, "fused", steps=2, donate=True)
    assert len(kernel_launches) == 4  # per step: the momentum; the rest with Adam
    # w1 and w2 share a shape: one batched call of 2
    assert sorted(calls) == sorted([(2, 8, 6), (1, 10, 4), (1, 3, 7)] * 2)


def test_explain_says_what_runs_where():
    params = _tree(torch.Generator().manual_seed(1))
    text = ftopt.explain(_muon(), params, backend="fused", file=io.StringIO())
    assert ("segments: [muon_momentum] fused -> newton_schulz (matrix stage on 'muon' "
            "leaves") in text
    assert "segment 1 [muon_momentum]: 4 leaves, 157 elements" in text
    assert "newton_schulz (torch): 4 leaves, 157 elements, 3 shape(s)" in text
    assert ("[add_decayed_weights, scale_by_learning_rate, scale_by_adam, "
            "add_decayed_weights, scale_by_learning_rate]: 7 leaves, 188 elements; input: "
            "the previous part's output (4 leaves), the raw gradient (3)") in text
    assert "kernel launches per step: 2" in text and "eager" not in text


def _per_element(state) -> dict:
    inner = state.inner_states
    muon_state = inner["muon"].inner_state[0][0]
    adam_state = inner["adam"].inner_state[0]
    return {"mu": muon_state.mu, "adam_mu": adam_state.mu, "adam_nu": adam_state.nu}


@pytest.mark.parametrize("backend", ["fused", "eager"])
def test_skip_zeros_keeps_params_and_states(backend):
    """A step with zeros after a warm-up: params and per-element states keep their bits
    where the raw gradient is zero; the control (no skip_zeros) moves them."""
    out = {}
    for skip in (False, True):
        gen = torch.Generator().manual_seed(2)
        params, warmup = _tree(gen), [_tree(gen), _tree(gen)]
        grads = _tree(gen, zeros=True)
        out[skip] = zero_step(_muon(skip_zeros=skip), params, warmup, grads, _per_element,
                              backend)
    assert [k for k, g in grads.items() if bool((g == 0).any())] == ["w1", "tall", "b", "c"]
    assert_kept_where_zero(grads, *out[True])
    c_before_p, c_before_s, c_new_p, c_new_s = out[False]
    for k in ("w1", "tall", "b", "c"):
        zero = grads[k] == 0
        assert bool((c_new_p[k][zero] != c_before_p[k][zero]).all()), k
    assert bool((c_new_s["mu"]["w1"][grads["w1"] == 0] != c_before_s["mu"]["w1"][
        grads["w1"] == 0]).all())


def test_skip_zeros_fused_matches_eager():
    tx = _muon(skip_zeros=True)
    _close(_run(tx, "fused", zeros=True, donate=True), _run(tx, "eager", zeros=True))


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_checkpoint_continues_bit_identically():
    tx = _muon()
    gen = torch.Generator().manual_seed(3)
    params = _tree(gen)
    state = tx.init(params)
    for _ in range(2):
        params, state = ftopt.step(tx, params, _tree(gen), state, backend="fused")
    loaded_p, loaded_s = _roundtrip(params), _roundtrip(state)
    for _ in range(2):
        grads = _tree(gen)
        params, state = ftopt.step(tx, params, grads, state, backend="fused")
        loaded_p, loaded_s = ftopt.step(tx, loaded_p, grads, loaded_s, backend="fused",
                                        donate=True)
    for x, y in zip(ftopt.tree.leaves((params, state)), ftopt.tree.leaves((loaded_p,
                                                                          loaded_s))):
        assert torch.equal(bits(x), bits(y))
    assert int(state.inner_states["muon"].inner_state[0][0].count) == 4


def test_bad_adam_state_raises_and_writes_nothing():
    """Every segment is checked before the first kernel: a bad state of the Adam branch
    (last segment) raises naming the leaf, and the Muon momentum (first segment) and the
    params are as they were (donated)."""
    tx = _muon()
    gen = torch.Generator().manual_seed(4)
    params = _tree(gen)
    state = tx.init(params)
    adam_state = state.inner_states["adam"].inner_state[0]
    bad = adam_state._replace(nu={**adam_state.nu, "b": torch.zeros(5, device=DEVICE)})
    inner = state.inner_states["adam"].inner_state
    state = state._replace(inner_states={
        **state.inner_states,
        "adam": state.inner_states["adam"]._replace(inner_state=(bad, *inner[1:]))})
    snapshot = [t.clone() for t in ftopt.tree.leaves((params, state))]
    with pytest.raises(ValueError, match=r"\['b'\]"):
        ftopt.step(tx, params, _tree(gen), state, backend="fused", donate=True)
    for x, y in zip(ftopt.tree.leaves((params, state)), snapshot):
        assert torch.equal(x, y)


def _matrices(tree):
    return {k: v.ndim == 2 for k, v in tree.items()}


GENERAL = {
    # A matrix stage inside masked: the other leaves pass the gradient through.
    "masked muon": lambda: ftopt.chain(
        ftopt.masked(ftopt.scale_by_muon(ns_dtype=torch.float32), _matrices),
        ftopt.scale_by_learning_rate(0.05)),
    # Two Muon branches with other hyperparameters (one position, per-leaf scalars) and
    # a third with none: the third runs whole in the last segment.
    "two muon branches": lambda: ftopt.partition(
        {"a": ftopt.chain(ftopt.scale_by_muon(beta=0.9, ns_dtype=torch.float32),
                          ftopt.scale_by_learning_rate(0.05)),
         "b": ftopt.chain(ftopt.scale_by_muon(beta=0.5, ns_dtype=torch.float32),
                          ftopt.scale_by_learning_rate(0.01)),
         "c": ftopt.sgd(0.1, momentum=0.9)},
        lambda t: {k: ("a" if k == "w1" else "b") if v.ndim == 2 else "c"
                   for k, v in t.items()}),
    # A stateful matrix stage (Adafactor's factored moments) in a branch.
    "adafactor and adam": lambda: ftopt.partition(
        {"f": ftopt.adafactor(0.05, momentum=0.9, min_dim_size_to_factor=4),
         "a": ftopt.adam(0.01)},
        lambda t: {k: "f" if v.ndim >= 2 else "a" for k, v in t.items()}),
}


@pytest.mark.parametrize("name", list(GENERAL))
def test_general_partitions_with_matrix_stages_match_eager(name):
    tx = GENERAL[name]()
    assert plan_lib.plan_chain(tx).segments is not None
    _close(_run(tx, "fused", donate=True), _run(tx, "eager"))


def _ndim_at_least_two(tree):
    return {k: v.ndim >= 2 for k, v in tree.items()}


# Every fusible entry with a matrix stage (``tests/registry.py``, trait ``mixes``) after
# a decay masked to matrices, so that a segment before the matrix stage passes the 1-D,
# 0-d and 3-D leaves through and the next reads them as its input; and a chain every
# part of which passes some leaves through.
MATRIX_FUSIBLE = registry.names(e for e in registry.fusible() if e.mixes)
PASSED_THROUGH_ALL = "masked muon, masked scale"


def _after_a_masked_decay(name: str):
    if name == PASSED_THROUGH_ALL:
        rest = ftopt.chain(ftopt.masked(ftopt.scale_by_muon(ns_dtype=torch.float32), _matrices),
                           ftopt.masked(ftopt.scale_by_learning_rate(0.05), _ndim_at_least_two))
    else:
        rest = registry.standalone(name)
    return ftopt.chain(ftopt.add_decayed_weights(0.03, mask=_ndim_at_least_two), rest)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", MATRIX_FUSIBLE + [PASSED_THROUGH_ALL])
def test_16bit_leaves_passed_through_a_segment_match_eager(name, dtype):
    """A leaf the first segment passes through (no stage there applies to it) reaches the
    next segment as that segment reads every seeded input: fp32 (the update kernel's
    output), whatever the params' and gradients' dtype; an update passed through every
    part keeps the gradient's dtype, as on the eager path. Each step from the same
    inputs."""
    tx = _after_a_masked_decay(name)
    assert plan_lib.plan_chain(tx).segments is not None
    gen = fresh_generator()
    params = _tree(gen, dtype=dtype)
    state = tx.init(params)
    for _ in range(2):
        grads = _tree(gen, zeros=True, dtype=dtype)
        pe, se = ftopt.step(tx, params, grads, state, backend="eager")
        for _ in range(2):  # (a read of memory no one wrote differs from call to call)
            pf, sf = ftopt.step(tx, params, grads, state, backend="fused")
            assert_trees_close(sf, se, rtol=2e-5, atol=1e-6)
            for k in pe:
                assert pf[k].dtype == dtype
                ulp = torch.finfo(dtype).eps * pe[k].float().abs()
                assert ((pf[k].float() - pe[k].float()).abs() <= ulp + 1e-6).all(), k
        ue, _ = tx.update(grads, state, params, backend="eager")
        uf, _ = tx.update(grads, state, params, backend="fused")
        for k in ue:
            assert uf[k].dtype == ue[k].dtype, (k, uf[k].dtype, ue[k].dtype)
            torch.testing.assert_close(uf[k], ue[k], rtol=2e-5, atol=1e-6)
        params, state = pe, se
