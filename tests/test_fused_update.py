"""``tx.update`` on the fused path (one kernel per group writing the updates and the new
states) against the eager update: every chain (every fusible registry entry and the
composites of test_fused.CHAINS), half-precision grads, no params, None
gradients, skip_zeros bit-identity, 8-bit states, purity and the planner's choice."""

from __future__ import annotations

import pytest
import torch
from registry import BY_NAME, LEAF_STATES
from step_checks import field_leaves, without_fields

import ftopt
from ftopt.chunked import entry as chunked_entry
from ftopt.lowering import entry, kernel_files
from tests.test_fused import CHAINS, DEVICE, QUANT_SHAPES, _bits, _rel_err, _tree

# Chains that read no params: the registry's (of test_fused.CHAINS) and two composites.
PARAM_FREE = [*(n for n in CHAINS if n in BY_NAME and not BY_NAME[n].needs_params),
              "global_clip_adam", "scheduled"]


pytestmark = pytest.mark.usefixtures("one_thread")


def _snapshot(*trees):
    return [x.clone() for x in ftopt.tree.leaves(trees)]


def _unchanged(snapshot, *trees) -> bool:
    now = ftopt.tree.leaves(trees)
    return len(now) == len(snapshot) and all(
        torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(snapshot, now))


# Newton-Schulz's quintic iterations amplify the last-bit differences of their input
# (the fused momentum) about tenfold: the agreement is fp32 rounding times that.
# Schedule-Free's update c·(z − y) + (c·b1 + 1 − b1)·u reads param-sized values: the one
# ulp of a param (~1e-7) by which the fused and eager z differ after a step moves an update
# of size ~lr by ~1e-5 of itself (the params agree to 1e-6: tests/test_fused.py).
# Prodigy's numerator is a dot product Σ g·(x0 − p) with cancellation (condition ~200 on
# the second step here): the fused reduction pass and torch sum in different orders, each
# ~7e-7 of the float64 value, so up to ~1.5e-6 apart (tests/test_prodigy_fused.py checks
# both against float64).
TOLERANCE = {"scale_by_muon": 1e-5, "muon": 1e-5, "muon[dims]": 1e-5, "scale_by_normuon": 1e-5,
             "normuon": 1e-5, "normuon[dims]": 1e-5, "schedule_free": 1e-5,
             "schedule_free_sgd": 1e-5,
             "schedule_free_adamw": 1e-5, "prodigy": 1e-5,
             # n̂ − m̂² cancels: the bias corrections' roundings (fused multiplies by
             # their reciprocals, eager divides) come out ~10x larger
             "scale_by_stddev[bias_correction]": 1e-5}


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_fused_update_matches_eager(name):
    tx = CHAINS[name]()
    gen = torch.Generator().manual_seed(21)
    params = _tree(gen, torch.float32)
    state_e = state_f = tx.init(params)
    for _ in range(5):
        grads = _tree(gen, torch.float32)
        before, old_state = _snapshot(params, grads, state_f), state_f
        u_f, state_f = tx.update(grads, state_f, params, backend="fused")
        assert _unchanged(before, params, grads, old_state)
        u_e, state_e = tx.update(grads, state_e, params, backend="eager")
        for k in params:
            assert u_f[k].dtype == torch.float32 and u_f[k].shape == params[k].shape
            assert _rel_err(u_f[k], u_e[k]) <= TOLERANCE.get(name, 1e-6), (name, k)
        for a, b in zip(ftopt.tree.leaves(state_f), ftopt.tree.leaves(state_e)):
            assert a.dtype == b.dtype
            if a.is_floating_point():
                assert _rel_err(a, b) <= TOLERANCE.get(name, 1e-6), name
            else:
                assert torch.equal(a, b), name
        params = ftopt.apply_updates(params, u_e)


def test_fused_update_is_pure():
    tx = ftopt.adamw(0.01, weight_decay=0.1)
    gen = torch.Generator().manual_seed(22)
    params, grads = _tree(gen, torch.float32), _tree(gen, torch.float32)
    state = tx.init(params)
    state = tx.update(grads, state, params, backend="fused")[1]  # non-zero moments
    before = _snapshot(params, grads, state)
    u1, s1 = tx.update(grads, state, params, backend="fused")
    assert _unchanged(before, params, grads, state)
    u2, s2 = tx.update(grads, state, params, backend="fused")
    for a, b in zip(ftopt.tree.leaves((u1, s1)), ftopt.tree.leaves((u2, s2))):
        assert torch.equal(a, b)  # same inputs, same outputs
    assert not torch.equal(s1[0].mu["odd"], state[0].mu["odd"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["adamw", "lion", "bnb_lamb", "ademamix"])
def test_fused_update_half_grads(name, dtype):
    tx = CHAINS[name]()
    gen = torch.Generator().manual_seed(23)
    params = _tree(gen, dtype)
    state = tx.init(params)
    grads = _tree(gen, dtype)
    u_f, s_f = tx.update(grads, state, params, backend="fused")
    u_e, s_e = tx.update(grads, state, params, backend="eager")
    for k in params:
        assert u_f[k].dtype == torch.float32
        assert _rel_err(u_f[k], u_e[k].float()) <= 1e-5, (name, k)
    for a, b in zip(ftopt.tree.leaves(s_f), ftopt.tree.leaves(s_e)):
        if a.is_floating_point():
            assert _rel_err(a, b) <= 1e-5


@pytest.mark.parametrize("name", PARAM_FREE)
def test_fused_update_without_params(name):
    """Chains that read no params fuse with ``params=None``; ``None`` gradients give
    ``None`` updates and leave those leaves' states as they were."""
    tx = CHAINS[name]()
    gen = torch.Generator().manual_seed(24)
    params = _tree(gen, torch.float32)
    state = tx.init(params)
    grads = {**_tree(gen, torch.float32), "odd": None}
    u_f, s_f = tx.update(grads, state, backend="fused")
    u_e, s_e = tx.update(grads, state, backend="eager")
    assert u_f["odd"] is None and u_e["odd"] is None
    for k in params:
        if k != "odd":
            assert _rel_err(u_f[k], u_e[k]) <= TOLERANCE.get(name, 1e-6), (name, k)
    for old, a, b in zip(*(ftopt.tree.leaves(without_fields(s, LEAF_STATES))
                           for s in (state, s_f, s_e))):
        if a.shape == params["odd"].shape and a.is_floating_point():
            assert torch.equal(a, old)  # the None leaf's state is untouched
        if a.is_floating_point():
            assert _rel_err(a, b) <= 1e-6
    for a, b in zip(*(field_leaves(s, LEAF_STATES) for s in (s_f, s_e))):
        assert _rel_err(a, b) <= TOLERANCE.get(name, 1e-6)  # (from a matrix stage's output)


def test_fused_update_params_needed():
    tx = ftopt.adamw(0.01, weight_decay=0.1)
    params = _tree(torch.Generator().manual_seed(25), torch.float32)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(params, tx.init(params), backend="fused")


@pytest.mark.parametrize("name", ["adamw", "lion", "clip_adam", "bnb_sgd"])
def test_fused_update_skip_zeros(name):
    """Zero-gradient elements: update exactly zero, states bit-identical; the other
    elements bit-identical to the fused update without the flag; the control case."""
    base = {"adamw": CHAINS["adamw"], "lion": CHAINS["lion"], "bnb_sgd": CHAINS["bnb_sgd"],
            "clip_adam": lambda: ftopt.chain(ftopt.clip_by_global_norm(0.5),
                                             ftopt.adam(0.01))}[name]
    tx_plain, tx_skip = base(), ftopt.chain(base(), ftopt.skip_zeros())
    gen = torch.Generator().manual_seed(26)
    params = _tree(gen, torch.float32)
    state = tx_plain.init(params)
    state = tx_plain.update(_tree(gen, torch.float32), state, params, backend="fused")[1]
    grads = _tree(gen, torch.float32)
    grads["odd"][2] = 0.0
    grads["ragged"][::3] = -0.0
    zero = {k: g == 0 for k, g in grads.items()}
    u_s, (s_s, _) = tx_skip.update(grads, (state, ftopt.EmptyState()), params,
                                   backend="fused")
    u_p, s_p = tx_plain.update(grads, state, params, backend="fused")
    for k in params:
        # -0.0 exactly: p + (-0.0) is p for every p, -0.0 included.
        assert (u_s[k][zero[k]] == 0).all() and torch.signbit(u_s[k][zero[k]]).all(), k
        assert torch.equal(_bits(u_s[k][~zero[k]]), _bits(u_p[k][~zero[k]])), k
    for stage_old, stage_s, stage_p in zip(state, s_s, s_p):
        for field in getattr(stage_old, "_fields", ()):
            if field == "count":
                continue
            for k, z in zero.items():
                old, new, ctl = (getattr(st, field)[k] for st in (stage_old, stage_s,
                                                                   stage_p))
                assert torch.equal(_bits(new[z]), _bits(old[z])), (field, k)
                assert torch.equal(_bits(new[~z]), _bits(ctl[~z])), (field, k)
                if z.any():
                    assert not torch.equal(ctl[z], old[z]), (field, k)  # the control


@pytest.mark.parametrize("skip", [False, True])
def test_fused_update_8bit(skip):
    tx = ftopt.adam(0.01, state_bits=8, skip_zeros=skip)
    gen = torch.Generator().manual_seed(27)
    params = _tree(gen, torch.float32, QUANT_SHAPES)
    state = tx.init(params)
    for _ in range(2):
        grads = _tree(gen, torch.float32, QUANT_SHAPES)
        grads["big"][:3] = 0.0
        u_f, s_f = tx.update(grads, state, params, backend="fused")
        u_e, s_e = tx.update(grads, state, params, backend="eager")
        for k in params:
            assert _rel_err(u_f[k], u_e[k]) <= 2e-4, k
        codes = [(a, b) for a, b in zip(ftopt.tree.leaves(s_f), ftopt.tree.leaves(s_e))
                 if a.dtype == torch.uint8]
        assert codes and all((a != b).float().mean() < 1e-3 for a, b in codes)
        state = s_e


def test_update_backend_choice():
    """auto fuses on a GPU and runs eagerly on the CPU; nested updates never fuse on
    their own; under autograd the update is differentiable (eager)."""
    tx = ftopt.adam(0.01)
    gen = torch.Generator().manual_seed(28)
    params = _tree(gen, torch.float32, {"w": (4, 3)})
    grads = _tree(gen, torch.float32, {"w": (4, 3)})
    state = tx.init(params)
    calls = []
    real, real_cached = entry.update, entry.cached_update

    def spy(*args, **kwargs):
        result, reason = real(*args, **kwargs)
        calls.append(reason)
        return result, reason

    def cached_spy(*args):  # a fused update over the tables of the last one
        result = real_cached(*args)
        if result is not None:
            calls.append(None)
        return result

    entry.update, entry.cached_update = spy, cached_spy
    try:
        tx.update(grads, state, params)
        assert calls == ([None] if DEVICE == "cuda" else ["tensors are on the CPU"])
        calls.clear()
        tx.update(grads, state, params, backend="fused")
        assert calls == [None]  # one fused call for the whole chain, none nested
        calls.clear()
        tx.update(grads, state, params, backend="eager")
        assert calls == []
        # step(backend="eager") updates eagerly on every device (no fused update inside).
        chunked = chunked_entry.step
        chunked_entry.step = lambda *args: None  # the tx.update + apply route
        try:
            ftopt.step(tx, params, grads, state, backend="eager")
        finally:
            chunked_entry.step = chunked
        assert calls == []
    finally:
        entry.update, entry.cached_update = real, real_cached
    with pytest.raises(ValueError, match="backend must be one of"):
        tx.update(grads, state, params, backend="triton")
    g = {"w": grads["w"].clone().requires_grad_()}
    with pytest.raises(RuntimeError, match="gradient requires grad"):
        tx.update(g, state, params, backend="fused")
    u, _ = tx.update(g, state, params)  # differentiable, eagerly
    u["w"].sum().backward()
    assert g["w"].grad is not None
    with pytest.raises(RuntimeError, match="no elementwise rule"):
        ftopt.chain(ftopt.stateless(lambda u, p: u), ftopt.sgd(0.1)).update(
            grads, (ftopt.EmptyState(), ftopt.sgd(0.1).init(params)), params,
            backend="fused")


def test_fused_update_compiles_once_per_layout():
    tx = ftopt.adamw(torch.tensor(0.01), weight_decay=0.1)
    gen = torch.Generator().manual_seed(29)
    params = _tree(gen, torch.float32)
    state = tx.init(params)
    state = tx.update(_tree(gen, torch.float32), state, params, backend="fused")[1]
    modules = len(kernel_files._MODULES)
    for _ in range(3):
        state = tx.update(_tree(gen, torch.float32), state, params, backend="fused")[1]
    assert len(kernel_files._MODULES) == modules


MIXED = {"a": ((7, 5), torch.float32), "b": ((1031,), torch.bfloat16),
         "c": ((3, 1500), torch.float32), "d": ((), torch.float16), "e": ((0,), torch.float32),
         "f": ((2, 0, 3), torch.float32)}


def _mixed(gen):
    return {k: torch.randn(s, generator=gen).to(dt).to(DEVICE) for k, (s, dt) in MIXED.items()}


@pytest.mark.parametrize("entry", ["step", "update"])
def test_repeated_functional_calls(entry, monkeypatch, tensor_checks):
    """Non-donated steps and updates over trees shaped like the last call's reuse its
    tables (one group per dtype pair here) and write each output to its own memory."""
    from ftopt.lowering import functional

    cached = []
    real = functional.fast_functional

    def spy(*args):
        result = real(*args)
        cached.append(result is not None)
        return result

    monkeypatch.setattr(functional, "fast_functional", spy)
    tx = ftopt.adamw(0.01, weight_decay=0.1)
    gen = torch.Generator().manual_seed(30)
    params = _mixed(gen)
    state_f = state_e = tx.init(params)
    params_f = params_e = params
    for i in range(5):
        grads = _mixed(gen)
        if i == 2:
            grads["a"] = None  # a different set of leaves: the full path again
        inputs = (params_f, grads, state_f)
        before = _snapshot(*inputs)
        if entry == "step":
            params_f, new_state = ftopt.step(tx, params_f, grads, state_f, backend="fused")
            params_e, state_e = ftopt.step(tx, params_e, grads, state_e, backend="eager")
            got, want = params_f, params_e
        else:
            got, new_state = tx.update(grads, state_f, params_f, backend="fused")
            want, state_e = tx.update(grads, state_e, params_e, backend="eager")
            params_f = params_e = ftopt.apply_updates(params_e, want)
        assert _unchanged(before, *inputs)  # pure
        state_f = new_state
        for k in MIXED:
            if want[k] is None:
                assert got[k] is None
                continue
            assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, (i, k)
            # 16-bit params: each step rounds once on both paths; the two trajectories
            # may drift apart by an ulp per step.
            tol = 1e-5 if got[k].dtype == torch.float32 else 4 * torch.finfo(
                got[k].dtype).eps
            assert _rel_err(got[k].float(), want[k].float()) <= tol, (i, k)
        for a, b in zip(ftopt.tree.leaves(state_f), ftopt.tree.leaves(state_e)):
            assert a.shape == b.shape and a.dtype == b.dtype
            if a.is_floating_point():
                assert _rel_err(a, b) <= 1e-5
    # Calls 1 and 4 fit the tables of the call before; 2 and 3 differ in their None leaves.
    assert cached == [True, False, False, True]
    # Each output leaf is its own memory: writing one changes no other.
    leaves = [t for t in ftopt.tree.leaves((got, state_f)) if t.numel()]
    snapshot = [t.clone() for t in leaves]
    leaves[0].add_(1.0)
    for t, old in zip(leaves[1:], snapshot[1:]):
        assert torch.equal(t, old)


def test_functional_calls_recheck_new_inputs(tensor_checks):
    """After a cached call, inputs that do not fit get the full checks and their errors."""
    tx = ftopt.adam(0.01)
    gen = torch.Generator().manual_seed(31)
    params = _mixed(gen)
    state = tx.init(params)
    for _ in range(2):
        tx.update(_mixed(gen), state, params, backend="fused")
        ftopt.step(tx, params, _mixed(gen), state, backend="fused")
    wrong_shape = {**_mixed(gen), "a": torch.randn(5, 7, device=DEVICE)}
    with pytest.raises(ValueError, match=r"\['a'\].*shape"):
        tx.update(wrong_shape, state, params, backend="fused")
    with pytest.raises(ValueError, match=r"\['a'\].*shape"):
        ftopt.step(tx, params, wrong_shape, state, backend="fused")
    elsewhere = {**_mixed(gen), "c": torch.randn(3, 1500, device="meta")}
    with pytest.raises(ValueError, match=r"grad at \['c'\]: on meta"):
        ftopt.step(tx, params, elsewhere, state, backend="fused")
    grads = _mixed(gen)
    wide = {**grads, "b": grads["b"].float()}  # another dtype: another group layout
    u_f, _ = tx.update(wide, state, params, backend="fused")
    u_e, _ = tx.update(wide, state, params, backend="eager")
    assert _rel_err(u_f["b"], u_e["b"]) <= 1e-6
