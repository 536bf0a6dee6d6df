"""``apply_if_finite``: optax semantics, bit-exact skips, no host synchronisation.

* A NaN or an Inf gradient leaves params (a ``-0.0`` one included) and the inner state
  bit-identical and advances the counters; a finite step is the inner step bit for bit.
* The counters over a random finite/non-finite sequence follow optax's update rule
  (reset on a finite step, apply anyway after ``max_consecutive_errors``).
* ``Tensor.item`` and ``Tensor.__bool__`` raise during the update (no host sync).
* ``torch.save``/``torch.load(weights_only=True)``, ``step`` (donated or not), ``chain``,
  ``None`` gradients, ``quantize_states``, ``vmap`` and ``explain``.
"""

from __future__ import annotations

import io
import math

import pytest
import torch

import ftopt

SEED = 2024


def _params(gen):
    return {"w": torch.randn(5, 3, generator=gen), "b": torch.randn(3, generator=gen),
            "z": torch.tensor([-0.0, 0.0, 1.5])}


def _grads(gen, bad=None, leaf="w"):
    g = {"w": torch.randn(5, 3, generator=gen), "b": torch.randn(3, generator=gen),
         "z": torch.randn(3, generator=gen)}
    if bad is not None:
        g[leaf].view(-1)[int(torch.randint(g[leaf].numel(), (1,), generator=gen))] = bad
    return g


def _bits(tree):
    return [t.view(torch.uint8).clone() if t.is_floating_point() else t.clone()
            for t in ftopt.tree.leaves(tree)]


def _same_bits(a, b) -> bool:
    la, lb = _bits(a), _bits(b)
    return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))


def _inner():
    return ftopt.chain(ftopt.clip_by_global_norm(10.0), ftopt.adamw(1e-2, weight_decay=0.1))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("entry", ["update", "step", "step_donate"])
def test_non_finite_step_is_skipped_bit_exactly(bad, entry):
    gen = torch.Generator().manual_seed(SEED)
    tx = ftopt.apply_if_finite(_inner(), max_consecutive_errors=3)
    params = _params(gen)
    state = tx.init(params)
    params, state = ftopt.step(tx, params, _grads(gen), state)  # a non-trivial inner state
    grads = _grads(gen, bad, leaf="b")
    grads["w"] = None  # no gradient: ignored by the finiteness test
    before_p, before_inner = _bits(params), _bits(state.inner_state)
    if entry == "update":
        updates, new_state = tx.update(grads, state, params)
        assert updates["w"] is None
        assert all(torch.equal(u.view(torch.int32), torch.full_like(u, -0.0).view(torch.int32))
                   for u in (updates["b"], updates["z"]))
        new_params = ftopt.apply_updates(params, updates)
    else:
        new_params, new_state = ftopt.step(tx, params, grads, state,
                                           donate=entry == "step_donate")
    assert all(torch.equal(x, y) for x, y in zip(_bits(new_params), before_p))
    assert all(torch.equal(x, y) for x, y in zip(_bits(new_state.inner_state), before_inner))
    assert new_state.notfinite_count.item() == 1 and new_state.total_notfinite.item() == 1
    assert new_state.last_finite.item() is False
    assert new_state.notfinite_count.dtype == torch.int32


@pytest.mark.parametrize("entry", ["update", "step"])
def test_finite_step_equals_inner_bit_for_bit(entry):
    gen = torch.Generator().manual_seed(SEED + 1)
    inner = _inner()
    tx = ftopt.apply_if_finite(inner, 0)
    params = _params(gen)
    state, ref_state = tx.init(params), inner.init(params)
    p, ref_p = params, params
    for _ in range(3):
        grads = _grads(gen)
        grads["b"] = None
        if entry == "update":
            u, state = tx.update(grads, state, p)
            ref_u, ref_state = inner.update(grads, ref_state, ref_p)
            assert _same_bits(u, ref_u)
            p, ref_p = ftopt.apply_updates(p, u), ftopt.apply_updates(ref_p, ref_u)
        else:
            p, state = ftopt.step(tx, p, grads, state)
            ref_p, ref_state = ftopt.step(inner, ref_p, grads, ref_state)
        assert _same_bits(p, ref_p) and _same_bits(state.inner_state, ref_state)
        assert state.notfinite_count.item() == 0 and state.last_finite.item() is True
    assert not torch.equal(p["w"], params["w"])


@pytest.mark.parametrize("max_errors", [0, 1, 2])
def test_counters_follow_optax(max_errors):
    gen = torch.Generator().manual_seed(SEED + max_errors)
    inner = ftopt.adam(1e-2)
    tx = ftopt.apply_if_finite(inner, max_errors)
    params = _params(gen)
    state, ref_state = tx.init(params), inner.init(params)
    count = total = 0
    pattern = [1, 0, 0, 0, 1, 0, 0, 1, 1, 0, 0, 0, 0]  # 1: finite gradients
    for finite in pattern:
        grads = _grads(gen, None if finite else math.nan)
        # optax: count reset by a finite step, else incremented; apply if finite or
        # count > max_consecutive_errors; total counts every non-finite step.
        count = 0 if finite else count + 1
        total += 0 if finite else 1
        applied = finite or count > max_errors
        u, state = tx.update(grads, state, params)
        if applied:
            ref_u, ref_state = inner.update(grads, ref_state, params)
            assert _same_bits(u, ref_u)
        else:
            assert all(torch.equal(x, torch.full_like(x, -0.0)) for x in ftopt.tree.leaves(u))
        assert _same_bits(state.inner_state, ref_state)
        assert (state.notfinite_count.item(), state.total_notfinite.item()) == (count, total)
        assert state.last_finite.item() == bool(finite)
    assert total == pattern.count(0)


def test_no_host_sync_during_update(monkeypatch):
    # The wrapper's own work (finiteness flag, counters, selection) must not read the
    # device. The inner transform is exempt: on the CPU its eager path may read CPU
    # scalars, which is free there.
    gen = torch.Generator().manual_seed(SEED + 7)
    inner = ftopt.chain(ftopt.adam(1e-2), ftopt.scale(0.5))
    in_inner = []

    def inner_update(updates, state, params=None, **extra):
        in_inner.append(True)
        try:
            return inner.update(updates, state, params, **extra)
        finally:
            in_inner.pop()

    tx = ftopt.apply_if_finite(ftopt.GradientTransformation(inner.init, inner_update), 2)
    params = _params(gen)
    state = tx.init(params)
    grads = [_grads(gen), _grads(gen, math.nan), _grads(gen, math.inf), _grads(gen)]
    calls = []

    def guard(name, original):
        def patched(self, *args, **kwargs):
            if not in_inner:
                calls.append(name)
                raise AssertionError(f"host synchronisation ({name}) in apply_if_finite")
            return original(self, *args, **kwargs)
        return patched

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "item", guard("item", torch.Tensor.item))
        m.setattr(torch.Tensor, "__bool__", guard("__bool__", torch.Tensor.__bool__))
        for g in grads:
            updates, state = tx.update(g, state, params)
            params = ftopt.apply_updates(params, updates)
    assert calls == []
    assert state.total_notfinite.item() == 2 and state.notfinite_count.item() == 0
    assert all(torch.isfinite(p).all() for p in ftopt.tree.leaves(params))


def test_checkpoint_round_trip():
    gen = torch.Generator().manual_seed(SEED + 3)
    tx = ftopt.apply_if_finite(ftopt.lion(1e-3), 2)
    params = _params(gen)
    state = tx.init(params)
    for g in (_grads(gen), _grads(gen, math.nan)):
        params, state = ftopt.step(tx, params, g, state)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert isinstance(loaded, ftopt.ApplyIfFiniteState) and _same_bits(loaded, state)
    assert loaded.last_finite.dtype == torch.bool
    g = _grads(gen)
    a = ftopt.step(tx, params, g, state)
    b = ftopt.step(tx, params, g, loaded)
    assert _same_bits(a, b)


def test_donated_step_writes_back_and_explain_names_the_reason():
    gen = torch.Generator().manual_seed(SEED + 4)
    tx = ftopt.apply_if_finite(ftopt.adam(1e-2, skip_zeros=True), 1)
    params = _params(gen)
    reason = ftopt.explain(tx, params, file=io.StringIO())
    assert "apply_if_finite" in reason and "eager" in reason
    with pytest.raises(RuntimeError, match="apply_if_finite"):
        ftopt.step(tx, params, _grads(gen), tx.init(params), backend="fused")
    state = tx.init(params)
    for bad in (None, math.nan):
        g = _grads(gen, bad)
        want_p, want_s = ftopt.step(tx, params, g, state)
        p_ids = [id(t) for t in ftopt.tree.leaves((params, state))]
        params, state = ftopt.step(tx, params, g, state, donate=True)
        assert [id(t) for t in ftopt.tree.leaves((params, state))] == p_ids
        assert _same_bits((params, state), (want_p, want_s))


def test_inside_chain_and_quantized():
    gen = torch.Generator().manual_seed(SEED + 5)
    params = {"big": torch.randn(4096, generator=gen), "small": torch.randn(3, generator=gen)}
    guarded = ftopt.apply_if_finite(ftopt.chain(ftopt.scale_by_adam(), ftopt.trace(0.5)), 1)
    tx = ftopt.quantize_states(ftopt.chain(guarded, ftopt.scale(-1e-2)), bits=8)
    state = tx.init(params)
    assert isinstance(state[0].inner_state[0].mu["big"], tuple)  # 8-bit codes inside
    good = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
    bad = {k: v.clone() for k, v in good.items()}
    bad["small"][1] = math.nan
    p1, s1 = ftopt.step(tx, params, good, state)
    assert not torch.equal(p1["big"], params["big"]) and s1[0].last_finite.item()
    p2, s2 = ftopt.step(tx, p1, bad, s1)
    assert _same_bits(p2, p1) and _same_bits(s2[0].inner_state, s1[0].inner_state)


def test_vmap_over_an_ensemble():
    gen = torch.Generator().manual_seed(SEED + 6)
    tx = ftopt.apply_if_finite(ftopt.adam(1e-2), 1)
    params = {"w": torch.randn(3, 4, generator=gen)}
    grads = {"w": torch.randn(3, 4, generator=gen)}
    grads["w"][1, 2] = math.inf  # member 1 is skipped, the others step
    state = torch.func.vmap(tx.init)(params)

    def one(p, g, s):
        u, s = tx.update(g, s, p)
        return ftopt.apply_updates(p, u), s

    new_p, new_s = torch.func.vmap(one)(params, grads, state)
    assert new_s.last_finite.tolist() == [True, False, True]
    assert torch.equal(new_p["w"][1], params["w"][1])
    for i in (0, 2):
        one_p, _ = one({"w": params["w"][i]}, {"w": grads["w"][i]},
                       tx.init({"w": params["w"][i]}))
        torch.testing.assert_close(new_p["w"][i], one_p["w"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("value,err", [(-1, ValueError), (1.0, TypeError), (True, TypeError)])
def test_bad_max_consecutive_errors(value, err):
    with pytest.raises(err, match="apply_if_finite: max_consecutive_errors must be an int"):
        ftopt.apply_if_finite(ftopt.adam(1e-3), value)


def test_wrong_state_is_named():
    tx = ftopt.apply_if_finite(ftopt.adam(1e-3), 1)
    params = {"w": torch.randn(2)}
    with pytest.raises(ValueError, match="ApplyIfFiniteState"):
        tx.update({"w": torch.randn(2)}, ftopt.adam(1e-3).init(params), params)


def test_inner_update_may_run_fused():
    # ``backend`` reaches the inner transform: its update runs as a fused kernel (here in
    # the Triton interpreter); the selection around it is the same.
    gen = torch.Generator().manual_seed(SEED + 8)
    inner = ftopt.adam(1e-2)
    tx = ftopt.apply_if_finite(inner, 1)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (the interpreter on a CPU)
    params = ftopt.tree.map(lambda x: x.to(device), _params(gen))
    state, ref_state = tx.init(params), inner.init(params)
    for bad in (None, math.nan):
        g = ftopt.tree.map(lambda x: x.to(device), _grads(gen, bad))
        u, state = tx.update(g, state, params, backend="fused")
        if bad is None:
            ref_u, ref_state = inner.update(g, ref_state, params, backend="fused")
            assert _same_bits(u, ref_u)
        else:
            assert all(torch.equal(x, torch.full_like(x, -0.0)) for x in ftopt.tree.leaves(u))
        assert _same_bits(state.inner_state, ref_state)


_HOST_READS = ("item", "__bool__", "__int__", "__float__", "__index__", "cpu", "tolist",
               "numpy")


# The eager path on a CPU reads CPU scalars (free there: test_no_host_sync_during_update
# guards the wrapper's own work); on a GPU it must not read the device either.
_UNREAD_BACKENDS = ["fused", *(["eager"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("backend", _UNREAD_BACKENDS)
def test_whole_update_reads_nothing_from_the_device(monkeypatch, backend):
    """The wrapper and the inner step together (fused: the Triton interpreter on a CPU;
    eager on a GPU) read no tensor on the host over finite, NaN and Inf steps: the counts
    the wrapper kept or advanced on its device flag are never read (per-step scalars come
    from the device). Each host read raises; on CUDA, so does any synchronisation. A
    skipped step leaves the inner state and the params bit-identical."""
    gen = torch.Generator().manual_seed(SEED + 9)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inner = ftopt.adamw(1e-2, weight_decay=0.1)
    tx = ftopt.apply_if_finite(inner, 2)  # the -inf step after the inf is skipped too
    params = ftopt.tree.map(lambda x: x.to(device), _params(gen))
    state = tx.init(params)
    ref_state = inner.init(params)
    steps = [None, math.nan, None, math.inf, -math.inf, None]
    grads = [ftopt.tree.map(lambda x: x.to(device), _grads(gen, bad)) for bad in steps]
    u, state = tx.update(grads[0], state, params, backend=backend)  # compiles; not checked
    ref_u, ref_state = inner.update(grads[0], ref_state, params, backend=backend)
    reads = []

    def guard(name):
        def patched(self, *args, **kwargs):
            reads.append(name)
            raise AssertionError(f"host read ({name}) during a guarded update")
        return patched

    outputs = []
    with monkeypatch.context() as m:
        for name in _HOST_READS:
            m.setattr(torch.Tensor, name, guard(name))
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            for g in grads[1:]:
                u, state = tx.update(g, state, params, backend=backend)
                new_params = ftopt.apply_updates(params, u)
                outputs.append((g, u, state, params, new_params))
                params = new_params
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    assert reads == []
    previous = state
    for bad, (g, u, state, before, after) in zip(steps[1:], outputs):
        if bad is None:
            ref_u, ref_state = inner.update(g, ref_state, before, backend=backend)
            assert _same_bits(u, ref_u)
        else:
            assert _same_bits(after, before)
        assert _same_bits(state.inner_state, ref_state)
        previous = state
    assert int(previous.total_notfinite) == 3 and int(previous.notfinite_count) == 0
    assert int(previous.inner_state[0].count) == 3  # three finite steps applied
