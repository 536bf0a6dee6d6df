"""More of optax's utilities against float64 formulas written here (optax's math), over 20+
steps, eagerly and fused (in the interpreter on a CPU): ``scale_by_schedule``,
``normalize_by_update_norm``, ``apply_every``; and what ``freeze``, ``selective_transform``
and ``multi_transform`` route where."""

from __future__ import annotations

import math

import pytest
import torch
from step_checks import fresh_generator

import ftopt

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = {"w": (6, 5), "conv": (3, 2, 4), "b": (7,), "s": ()}
LR = 0.05
STEPS = 21


def _tree(gen, scale=1.0):
    return {k: scale * torch.randn(s, generator=gen, dtype=torch.float64)
            for k, s in SHAPES.items()}


# ---------------------------------------------------------------- float64 references
# Each: (state, g, count) -> (update, state), count from 0, as optax's update_fn.


def _ref_schedule(fn):
    def ref(state, g, count):
        return {k: v * fn(count) for k, v in g.items()}, state
    return ref


def _ref_normalize(scale_factor, eps):
    def ref(state, g, count):
        norm = math.sqrt(sum(float(v.square().sum()) for v in g.values()))
        return {k: v / ((norm + eps) / scale_factor) for k, v in g.items()}, state
    return ref


def _ref_every(k):
    def ref(state, g, count):
        c = count % k
        acc = {n: g[n] + (state[n] if c != 0 else 0.0) for n in g}
        return {n: acc[n] * (1.0 if c == k - 1 else 0.0) for n in g}, acc
    return ref


SCHED = ftopt.schedules.warmup_cosine_decay_schedule(0.0, 2.0, 4, 15, 0.1)
CASES = {
    "scale_by_schedule": (lambda: ftopt.scale_by_schedule(SCHED), _ref_schedule(SCHED)),
    "scale_by_schedule[negative]": (
        lambda: ftopt.scale_by_schedule(ftopt.schedules.linear_schedule(-1.0, -0.2, 10)),
        _ref_schedule(ftopt.schedules.linear_schedule(-1.0, -0.2, 10))),
    "normalize_by_update_norm": (lambda: ftopt.normalize_by_update_norm(),
                                 _ref_normalize(1.0, 1e-6)),
    "normalize_by_update_norm[-2]": (lambda: ftopt.normalize_by_update_norm(-2.0, 1e-3),
                                     _ref_normalize(-2.0, 1e-3)),
    "apply_every[1]": (lambda: ftopt.apply_every(1), _ref_every(1)),
    "apply_every[3]": (lambda: ftopt.apply_every(3), _ref_every(3)),
}


def _run(name, backend):
    make, ref = CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    params64 = _tree(gen)
    tx = ftopt.chain(make(), ftopt.scale_by_learning_rate(LR))
    params = {k: v.float().to(DEVICE) for k, v in params64.items()}
    state = tx.init(params)
    ref_state = {k: torch.zeros_like(v) for k, v in params64.items()}
    moved = 0
    for count in range(STEPS):
        g64 = {k: v.float().double() for k, v in _tree(gen).items()}  # the same fp32 values
        grads = {k: v.float().to(DEVICE) for k, v in g64.items()}
        before = {k: v.clone() for k, v in params.items()}
        params, state = ftopt.step(tx, params, grads, state, backend=backend)
        u64, ref_state = ref(ref_state, g64, count)
        for k in params64:
            params64[k] = params64[k] - LR * u64[k]
            got = params[k].double().cpu()
            assert torch.allclose(got, params64[k], rtol=1e-5, atol=1e-6), (name, count, k)
        moved += any(not torch.equal(before[k], params[k]) for k in params)
    assert moved >= STEPS // 3, "the case never moved the params"
    return params


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_float64_reference_eager(name):
    _run(name, "eager")


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_float64_reference_fused(name):
    fused = _run(name, "fused")
    eager = _run(name, "eager")
    for k in fused:
        assert torch.allclose(fused[k].cpu(), eager[k].cpu(), rtol=1e-6, atol=1e-7), k


def test_apply_every_emits_every_k_steps_and_keeps_the_sum():
    tx = ftopt.apply_every(3)
    u = {"w": torch.tensor([1.0, -2.0])}
    state = tx.init(u)
    outs = []
    for i in range(7):
        out, state = tx.update({"w": u["w"] * (i + 1)}, state)
        outs.append(out["w"])
    zero = torch.zeros(2)
    assert [torch.equal(o, zero) for o in outs] == [True, True, False, True, True, False, True]
    assert torch.equal(outs[2], u["w"] * 6) and torch.equal(outs[5], u["w"] * 15)
    assert torch.equal(state.grad_acc["w"], u["w"] * 7) and int(state.count) == 7


def test_scale_by_schedule_counts_from_zero():
    seen = []

    def fn(count):
        seen.append(int(count))
        return 0.5

    tx = ftopt.scale_by_schedule(fn)
    u = {"w": torch.ones(3)}
    state = tx.init(u)
    for _ in range(3):
        out, state = tx.update(u, state)
    assert seen[:3] == [0, 1, 2] and torch.equal(out["w"], torch.full((3,), 0.5))


# ---------------------------------------------------------------- freezing


def _params(gen):
    out = {"layer": {"w": torch.randn(4, 5, generator=gen), "b": torch.randn(5, generator=gen)},
           "head": torch.randn(3, 4, generator=gen)}
    return ftopt.tree.map(lambda x: x.to(DEVICE), out)


def _like(params, gen):
    return ftopt.tree.map(lambda x: torch.randn(x.shape, generator=gen).to(DEVICE), params)


FROZEN = {"layer": {"w": False, "b": True}, "head": True}


@pytest.mark.parametrize("backend", ["eager", "fused"])
@pytest.mark.parametrize("how", ["tree", "callable"])
def test_selective_transform_trains_the_rest_and_keeps_frozen_leaves(backend, how):
    gen = torch.Generator().manual_seed(3)
    params = _params(gen)
    mask = FROZEN if how == "tree" else (
        lambda p: ftopt.tree.map(lambda x: x.shape != (4, 5), p))
    tx = ftopt.selective_transform(ftopt.adamw(1e-2, weight_decay=0.1), freeze_mask=mask)
    alone = ftopt.adamw(1e-2, weight_decay=0.1)
    state = tx.init(params)
    sub = {"w": params["layer"]["w"]}
    sub_state = alone.init(sub)
    p, s = params, state
    for _ in range(5):
        grads = _like(params, gen)
        p, s = ftopt.step(tx, p, grads, s, backend=backend)
        sub, sub_state = ftopt.step(alone, sub, {"w": grads["layer"]["w"]}, sub_state,
                                    backend=backend)
    assert torch.equal(p["layer"]["w"], sub["w"])  # the optimizer alone on that leaf
    assert not torch.equal(p["layer"]["w"], params["layer"]["w"])
    assert torch.equal(p["layer"]["b"], params["layer"]["b"])  # bit for bit
    assert torch.equal(p["head"], params["head"])
    # the frozen leaves hold no optimizer state: only the trained leaf's moments
    sizes = sorted(t.numel() for t in ftopt.tree.leaves(s) if t.ndim)
    assert sizes == [20, 20], sizes


def test_freeze_zeros_masked_updates_and_passes_the_rest():
    gen = torch.Generator().manual_seed(4)
    params = _params(gen)
    grads = _like(params, gen)
    tx = ftopt.freeze(FROZEN)
    out, _ = tx.update(grads, tx.init(params), params)
    assert torch.equal(out["layer"]["w"], grads["layer"]["w"])
    assert torch.equal(out["layer"]["b"], torch.zeros(5, device=DEVICE))
    assert torch.equal(out["head"], torch.zeros(3, 4, device=DEVICE))
    everything = ftopt.chain(ftopt.freeze(True), ftopt.sgd(0.1))
    p, _ = ftopt.step(everything, params, grads, everything.init(params))
    assert all(torch.equal(a, b) for a, b in zip(ftopt.tree.leaves(p), ftopt.tree.leaves(params)))
    odd = {"w": torch.tensor([math.nan, -0.0, -math.inf, 2.0], device=DEVICE)}  # +0.0 bits
    out, _ = ftopt.freeze(True).update(odd, ftopt.freeze(True).init(odd), odd)
    assert torch.equal(out["w"].view(torch.int32).cpu(), torch.zeros(4, dtype=torch.int32))
    p0 = {"w": torch.tensor([1.5, -2.0, 3.0, 0.25], device=DEVICE)}
    for backend in ("eager", "fused"):  # the fused rule writes the same zeros
        tx = ftopt.chain(ftopt.freeze(True), ftopt.scale(1.0))
        p, _ = ftopt.step(tx, p0, odd, tx.init(p0), backend=backend)
        assert torch.equal(p["w"], p0["w"]), backend
    nothing = ftopt.freeze(False)
    out, _ = nothing.update(grads, nothing.init(params), params)
    assert all(torch.equal(a, b) for a, b in zip(ftopt.tree.leaves(out),
                                                 ftopt.tree.leaves(grads)))


def test_set_to_zero_is_a_fused_rule():
    """Every update +0.0 (NaN, ±inf and −0.0 too), fused and eager alike; a chain holding
    it runs as one fused kernel, where the eager stateless transform it replaced split it."""
    odd = {"w": torch.tensor([math.nan, -0.0, -math.inf, 2.0, 3e-39], device=DEVICE),
           "s": torch.tensor(-1.5, device=DEVICE)}
    tx = ftopt.chain(ftopt.scale_by_adam(), ftopt.set_to_zero())
    for backend in ("eager", "fused"):
        out, _ = tx.update(odd, tx.init(odd), odd, backend=backend)
        for u in ftopt.tree.leaves(out):
            assert torch.equal(u.view(torch.int32).cpu(), torch.zeros(u.shape, dtype=torch.int32))
    plan = ftopt.explain(ftopt.chain(ftopt.scale_by_adam(), ftopt.set_to_zero(),
                                     ftopt.add_decayed_weights(0.1)), odd)
    assert "3 elementwise stages (scale_by_adam, set_to_zero, add_decayed_weights)" in plan


def test_selective_transform_bool_and_errors():
    gen = torch.Generator().manual_seed(5)
    params = _params(gen)
    grads = _like(params, gen)
    all_frozen = ftopt.selective_transform(ftopt.adam(1e-2), freeze_mask=True)
    p, s = ftopt.step(all_frozen, params, grads, all_frozen.init(params))
    assert all(torch.equal(a, b) for a, b in zip(ftopt.tree.leaves(p), ftopt.tree.leaves(params)))
    assert not [t for t in ftopt.tree.leaves(s) if t.ndim]
    bad = ftopt.selective_transform(ftopt.adam(1e-2), freeze_mask={"layer": {"w": True}})
    with pytest.raises(ValueError, match="params"):
        bad.init(params)
    with pytest.raises(TypeError):
        ftopt.selective_transform(ftopt.adam(1e-2), {"layer": True})  # keyword only, as optax


def test_multi_transform_is_partition():
    assert ftopt.multi_transform is ftopt.partition


def test_bad_hyperparameters_are_refused():
    with pytest.raises(ValueError, match="apply_every: k"):
        ftopt.apply_every(0)
    with pytest.raises(TypeError, match="apply_every: k"):
        ftopt.apply_every(1.5)
    with pytest.raises(TypeError, match="scale_by_schedule: step_size_fn"):
        ftopt.scale_by_schedule(0.1)
    with pytest.raises(ValueError, match="normalize_by_update_norm: eps"):
        ftopt.normalize_by_update_norm(1.0, -1e-6)


def test_fused_update_without_params_of_a_callable_mask_with_a_none_gradient():
    """The fused path judges a callable mask on the updates, as eager does, a ``None``
    gradient leaf left out (it raised an IndexError)."""
    frozen = lambda p: ftopt.tree.map(lambda x: x.ndim < 2, p)  # noqa: E731
    gen = torch.Generator().manual_seed(6)
    params = {"a": torch.randn(3, 4, generator=gen).to(DEVICE),
              "b": torch.randn(5, generator=gen).to(DEVICE),
              "odd": torch.randn(2, 2, generator=gen).to(DEVICE)}
    for tx in (ftopt.chain(ftopt.masked(ftopt.scale_by_adam(), frozen), ftopt.scale(0.1)),
               ftopt.chain(ftopt.freeze(frozen), ftopt.scale(0.1))):
        state = tx.init(params)
        grads = {"a": torch.randn(3, 4, generator=gen).to(DEVICE),
                 "b": torch.randn(5, generator=gen).to(DEVICE), "odd": None}
        u_f, s_f = tx.update(grads, state, backend="fused")
        u_e, s_e = tx.update(grads, state, backend="eager")
        assert u_f["odd"] is None and u_e["odd"] is None
        for k in ("a", "b"):
            assert torch.allclose(u_f[k], u_e[k], rtol=1e-6, atol=1e-7), k


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("mask", ["freeze", "rule"])
def test_a_fused_update_passes_a_masked_out_leaf_through_in_its_dtype(dtype, skip, mask):
    """A leaf that no position of the chain applies to (``freeze``'s others, or those a
    rule's own mask leaves out: ``add_decayed_weights(mask=...)``) gets its gradient back
    in the gradient's dtype on both paths, with skip_zeros in the chain too (its kernels
    write fp32 updates; the control: the other leaf's update is fp32 on both), bit for
    bit, in the first call and the cached one after it."""
    gen = fresh_generator()
    params = {"b": torch.randn(7, generator=gen).to(DEVICE, dtype),
              "w": torch.randn(3, 5, generator=gen).to(DEVICE, dtype)}
    grads = {k: torch.randn(v.shape, generator=gen).to(DEVICE, dtype)
             for k, v in params.items()}
    grads["w"][0, :2] = 0.0
    if mask == "freeze":
        inner = ftopt.freeze(lambda p: {k: v.ndim == 1 for k, v in p.items()})
    else:
        inner = ftopt.add_decayed_weights(0.1, mask={"b": True, "w": False})
    tx = ftopt.chain(ftopt.skip_zeros(), inner) if skip else inner
    state = tx.init(params)
    eager, _ = tx.update(grads, state, params, backend="eager")
    assert eager["w"].dtype == dtype and eager["b"].dtype == torch.float32
    for _ in range(2):
        fused, _ = tx.update(grads, state, params, backend="fused")
        for k in params:
            assert fused[k].dtype == eager[k].dtype
            assert torch.equal(fused[k].view(torch.int16 if fused[k].element_size() == 2
                                             else torch.int32),
                               eager[k].view(torch.int16 if eager[k].element_size() == 2
                                             else torch.int32))
