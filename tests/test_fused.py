"""The fused backend against the eager one (under TRITON_INTERPRET=1 on the CPU).

Small sizes: every kernel runs in the Triton interpreter here. On a GPU machine the same
tests run the compiled kernels. The fp32 comparison covers every fusible entry of the test
registry (``tests/registry.py``); ``tests/test_fused_8bit.py`` runs every fusible entry
with 8-bit states.
"""

from __future__ import annotations

import pytest
import registry
import torch
from registry import standalone

import ftopt
from ftopt.lowering import kernel_files

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.usefixtures("one_thread")


# Hand-picked hyperparameters for registry entries (keyed by registry name); the others run
# with their registry defaults.
OVERRIDES = {
    "sgd": {"learning_rate": 0.05},
    "sgd[momentum]": {"learning_rate": 0.05, "momentum": 0.9},
    "adam": {"learning_rate": 0.01, "b1": 0.8, "b2": 0.95},
    "adamw": {"learning_rate": 0.01, "weight_decay": 0.1},
    "lion": {"learning_rate": 0.003, "weight_decay": 0.1},
    "rmsprop": {"learning_rate": 0.01, "decay": 0.95, "initial_scale": 0.1},
    "rmsprop[momentum]": {"learning_rate": 0.01, "momentum": 0.9, "eps_in_sqrt": False},
    "adagrad": {"learning_rate": 0.05},
    "lamb": {"learning_rate": 0.01, "weight_decay": 0.1},
    "lars": {"learning_rate": 0.1, "weight_decay": 0.01},
    "ademamix": {"learning_rate": 0.01, "weight_decay": 0.1, "b3": 0.99, "alpha": 3.0},
}
OPTIONS = {"quantize_states": {"bits": 32}}  # 8-bit states: tests/test_fused_8bit.py

# Every fusible registry entry as a standalone optimizer, and chains of several transforms.
CHAINS = {e.name: (lambda e=e: standalone(e, **OVERRIDES.get(e.name, {}),
                                          **OPTIONS.get(e.name, {})))
          for e in registry.fusible()}
COMPOSITES = {
    "sgd_nesterov": lambda: ftopt.sgd(0.05, momentum=0.9, nesterov=True),
    "adam_nesterov": lambda: ftopt.adam(0.01, nesterov=True, eps_root=1e-9),
    "bnb_sgd": lambda: ftopt.chain(ftopt.add_decayed_weights(0.01), ftopt.trace(0.9),
                                   ftopt.scale_by_learning_rate(0.05)),
    "bnb_rmsprop": lambda: ftopt.chain(ftopt.add_decayed_weights(0.01),
                                       ftopt.scale_by_rms(0.99, 1e-8, eps_in_sqrt=False),
                                       ftopt.scale_by_learning_rate(0.01)),
    "bnb_adagrad": lambda: ftopt.chain(ftopt.add_decayed_weights(0.01),
                                       ftopt.scale_by_rss(0.0, 1e-10, eps_in_sqrt=False),
                                       ftopt.scale_by_learning_rate(0.05)),
    "bnb_lamb": lambda: ftopt.chain(ftopt.scale_by_adam(0.9, 0.999, 1e-8),
                                    ftopt.clip_by_param_norm_ratio(0.5),
                                    ftopt.add_decayed_weights(0.01),
                                    ftopt.scale_by_learning_rate(0.01)),
    "bnb_lars": lambda: ftopt.chain(ftopt.add_decayed_weights(0.01), ftopt.trace(0.9),
                                    ftopt.clip_by_param_norm_ratio(0.02),
                                    ftopt.scale_by_learning_rate(0.1)),
    "global_clip_adam": lambda: ftopt.chain(ftopt.clip_by_global_norm(1.0),
                                            ftopt.adam(0.01)),
    "decay_masked": lambda: ftopt.adamw(
        0.01, weight_decay=0.1, mask=lambda p: {k: v.ndim > 1 for k, v in p.items()}),
    "scheduled": lambda: ftopt.adam(ftopt.warmup_cosine_decay_schedule(0.0, 0.01, 3, 20)),
}
assert not set(CHAINS) & set(COMPOSITES)
CHAINS.update(COMPOSITES)

# Leaf sizes: 0, 1, odd, not a multiple of the block, more than one block.
SHAPES = {"empty": (0,), "one": (1,), "scalar": (), "odd": (7, 5), "ragged": (1031,),
          "two_blocks": (3, 1500)}


# Leaf sizes for 8-bit states (tests/test_fused_8bit.py, tests/test_fused_update.py).
QUANT_SHAPES = {"small": (3, 5), "big": (33, 130), "odd_big": (4099,)}


def _tree(gen, dtype, shapes=SHAPES):
    return {k: torch.randn(s, generator=gen).to(dtype).to(DEVICE) for k, s in shapes.items()}


def _rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    if a.numel() == 0:
        return 0.0
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _run(tx, steps, dtype, backend, donate, seed=0, zero_rows=False, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    params = _tree(gen, dtype, shapes)
    state = tx.init(params)
    history = []
    for i in range(steps):
        grads = _tree(gen, dtype, shapes)
        if zero_rows:
            grads["odd"][i % 7] = 0.0
            grads["ragged"][::3] = -0.0
        params, state = ftopt.step(tx, params, grads, state, backend=backend, donate=donate)
        history.append(({k: v.clone() for k, v in params.items()}, state))
    return history


def _fp32_steps(name: str) -> int:
    """20 steps for the hand-picked chains (OVERRIDES, COMPOSITES); 6 for the other registry
    entries (the interpreter's cost is per step: add an entry to OVERRIDES for 20)."""
    return 20 if name in OVERRIDES or name in COMPOSITES else 6


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_fused_matches_eager_fp32(name):
    tx = CHAINS[name]()
    eager = _run(tx, _fp32_steps(name), torch.float32, "eager", False)
    fused = _run(tx, _fp32_steps(name), torch.float32, "fused", False)
    for (pe, _), (pf, _) in zip(eager, fused):
        for k in pe:
            assert _rel_err(pf[k], pe[k]) <= 1e-6, (name, k)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["adamw", "lion", "bnb_lamb", "sgd[momentum]", "ademamix"])
def test_fused_matches_eager_half(name, dtype):
    """Each step from the same 16-bit params and fp32 state: within one rounding."""
    tx = CHAINS[name]()
    gen = torch.Generator().manual_seed(1)
    params = _tree(gen, dtype)
    state = tx.init(params)
    for _ in range(3):
        grads = _tree(gen, dtype)
        pe, se = ftopt.step(tx, params, grads, state, backend="eager")
        pf, sf = ftopt.step(tx, params, grads, state, backend="fused")
        for k in pe:
            assert pf[k].dtype == dtype
            # Both round an fp32 value once; those fp32 values may differ by float error
            # relative to the inputs (the GPU contracts a*b+c into one fma), so allow one
            # ulp of the result plus that error.
            fp32_err = 4 * torch.finfo(torch.float32).eps * params[k].float().abs()
            tol = torch.finfo(dtype).eps * pe[k].float().abs() + fp32_err
            assert ((pf[k].float() - pe[k].float()).abs() <= tol).all(), (name, k)
        for a, b in zip(ftopt.tree.leaves(sf), ftopt.tree.leaves(se)):
            if a.is_floating_point():
                assert _rel_err(a, b) <= 1e-5
        params, state = pe, se


def test_many_leaves():
    shapes = {f"leaf{i}": ((i * 37) % 300,) if i % 3 else (i % 5 + 1, 11) for i in range(56)}
    tx = ftopt.adamw(0.01, weight_decay=0.1)
    eager = _run(tx, 4, torch.float32, "eager", False, shapes=shapes)
    fused = _run(tx, 4, torch.float32, "fused", True, shapes=shapes)
    for k in shapes:
        assert _rel_err(fused[-1][0][k], eager[-1][0][k]) <= 1e-6


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32) if x.dtype == torch.float32 else x.view(torch.int16)


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("name", ["adamw", "lion", "ademamix", "bnb_sgd", "lamb"])
def test_fused_skip_zeros(name, donate):
    gen = torch.Generator().manual_seed(3)
    skip_tx = ftopt.skip_zeros(CHAINS[name]())
    plain_tx = CHAINS[name]()
    params = _tree(gen, torch.float32)
    state_s, state_p = skip_tx.init(params), plain_tx.init(params)
    for _ in range(2):  # make the states non-zero
        grads = _tree(gen, torch.float32)
        params_s, state_s = ftopt.step(skip_tx, params, grads, state_s, backend="fused")
        _, state_p = ftopt.step(plain_tx, params, grads, state_p, backend="fused")
    grads = _tree(gen, torch.float32)
    grads["odd"][2] = 0.0
    grads["odd"][4] = -0.0
    grads["ragged"][100:700] = 0.0
    # A full block with zeros and one without (in place they may take different code).
    grads["two_blocks"][0, 10:20] = 0.0
    zero = {k: g == 0 for k, g in grads.items()}
    before = {k: v.clone() for k, v in params.items()}
    state_before = [x.clone() for x in ftopt.tree.leaves(state_s)]
    new_s, st_s = ftopt.step(skip_tx, {k: v.clone() for k, v in params.items()}, grads,
                             state_s, backend="fused", donate=donate)
    new_p, st_p = ftopt.step(plain_tx, params, grads, state_p, backend="fused")
    for k in params:
        z = zero[k]
        assert torch.equal(_bits(new_s[k][z]), _bits(before[k][z])), k
        assert torch.equal(_bits(new_s[k][~z]), _bits(new_p[k][~z])) or name == "lamb", k
        if name in ("adamw", "lion", "bnb_sgd") and z.any():
            assert not torch.equal(new_p[k][z], before[k][z]), k  # the control
    inner_s = ftopt.tree.leaves(st_s)
    for old, new in zip(state_before, inner_s):
        if new.shape == grads["odd"].shape and new.is_floating_point():
            assert torch.equal(_bits(new[zero["odd"]]), _bits(old[zero["odd"]]))


def test_donate_false_leaves_inputs_untouched():
    gen = torch.Generator().manual_seed(5)
    tx = ftopt.adamw(0.01, weight_decay=0.1)
    params = _tree(gen, torch.float32)
    state = tx.init(params)
    grads = _tree(gen, torch.float32)
    snapshot = [x.clone() for x in ftopt.tree.leaves((params, grads, state))]
    new_params, new_state = ftopt.step(tx, params, grads, state, backend="fused")
    for old, now in zip(snapshot, ftopt.tree.leaves((params, grads, state))):
        assert torch.equal(_bits(old) if old.is_floating_point() else old,
                           _bits(now) if now.is_floating_point() else now)
    assert not torch.equal(new_params["odd"], params["odd"])


def test_donate_true_updates_in_place():
    gen = torch.Generator().manual_seed(6)
    tx = ftopt.adam(0.01)
    params = _tree(gen, torch.float32)
    state = tx.init(params)
    ids = [id(x) for x in ftopt.tree.leaves((params, state))]
    for _ in range(3):
        grads = _tree(gen, torch.float32)
        before = params["odd"].clone()
        params, state = ftopt.step(tx, params, grads, state, backend="fused", donate=True)
        assert [id(x) for x in ftopt.tree.leaves((params, state))] == ids
        assert not torch.equal(before, params["odd"])
    assert int(state[0].count) == 3


def test_hyperparameter_change_compiles_nothing():
    gen = torch.Generator().manual_seed(7)
    lr = torch.tensor(0.01)
    txs = [ftopt.adamw(lr, weight_decay=torch.tensor(0.1)), ftopt.adamw(0.02, b1=0.5)]
    params = _tree(gen, torch.float32)
    for tx in txs:
        state = tx.init(params)
        params, state = ftopt.step(tx, params, _tree(gen, torch.float32), state,
                                   backend="fused", donate=True)
        modules = len(kernel_files._MODULES)
        for value in (0.5, 0.001, 0.3):
            lr.fill_(value)
            params, state = ftopt.step(tx, params, _tree(gen, torch.float32), state,
                                       backend="fused", donate=True)
        assert len(kernel_files._MODULES) == modules


def test_tensor_hyperparameters_take_effect():
    gen = torch.Generator().manual_seed(8)
    lr = torch.tensor(0.01)
    tx = ftopt.sgd(lr)
    params = _tree(gen, torch.float32)
    grads = _tree(gen, torch.float32)
    state = tx.init(params)
    a, _ = ftopt.step(tx, params, grads, state, backend="fused")
    lr.fill_(0.02)
    b, _ = ftopt.step(tx, params, grads, state, backend="fused")
    delta_a = a["odd"] - params["odd"]
    delta_b = b["odd"] - params["odd"]
    assert torch.allclose(delta_b, 2 * delta_a, rtol=1e-4, atol=1e-6)


def test_planner_reasons():
    params = {"w": torch.randn(4, 3, device=DEVICE)}
    grads = {"w": torch.randn(4, 3, device=DEVICE)}
    tx = ftopt.adam(0.1)
    state = tx.init(params)
    assert "no elementwise rule" in ftopt.explain(
        ftopt.chain(ftopt.stateless(lambda u, p: u), ftopt.sgd(0.1)), params, file=_Null())
    with pytest.raises(RuntimeError, match="requires grad"):
        leaf = {"w": params["w"].clone().requires_grad_()}
        ftopt.step(tx, leaf, grads, state, backend="fused")
    with pytest.raises(RuntimeError, match="no elementwise rule"):
        ftopt.step(ftopt.chain(ftopt.stateless(lambda u, p: u)), params, grads,
                   (ftopt.EmptyState(),), backend="fused")
    with pytest.raises(RuntimeError, match="float64 is not fp32/fp16/bf16"):
        wide = {"w": torch.randn(4, 3, dtype=torch.float64, device=DEVICE)}
        ftopt.step(tx, wide, wide, tx.init(wide), backend="fused")

    def vmapped(p, g):
        out, _ = ftopt.step(ftopt.sgd(0.1), {"w": p}, {"w": g}, ftopt.sgd(0.1).init({"w": p}))
        return out["w"]

    torch.func.vmap(vmapped)(torch.randn(2, 3), torch.randn(2, 3))  # falls back to eager
    text = ftopt.explain(tx, params, file=_Null())
    if DEVICE == "cpu":
        assert "eager (tensors are on the CPU" in text
        text = ftopt.explain(tx, params, backend="fused", file=_Null())
    assert "path: fused" in text and "bytes per element: main kernel reads 16, writes 12" in text


class _Null:
    def write(self, _):
        pass

    def flush(self):
        pass


def test_cached_donated_step_follows_new_grad_tensors(tensor_checks):
    """Donated steps reuse their tables; new gradient tensors (alternating buffers, fresh
    tensors, a changed dtype, in-place writes) must each be read, as the eager path does."""
    gen = torch.Generator().manual_seed(11)
    tx = ftopt.adam(0.01)
    params = _tree(gen, torch.float32)
    reference = {k: v.clone() for k, v in params.items()}
    state, ref_state = tx.init(params), tx.init(reference)
    a, b = _tree(gen, torch.float32), _tree(gen, torch.float32)
    sequence = [a, b, a, b, _tree(gen, torch.float32), a,
                {k: v.to(torch.bfloat16) for k, v in b.items()}, b]
    for i, grads in enumerate(sequence):
        if i == 5:
            a["odd"].mul_(-3.0)  # same tensor object, new values
        params, state = ftopt.step(tx, params, grads, state, backend="fused", donate=True)
        reference, ref_state = ftopt.step(tx, reference, grads, ref_state, backend="eager")
        for k in params:
            assert _rel_err(params[k], reference[k]) < 1e-6, (i, k)


def test_cached_donated_step_checks_new_grads(tensor_checks):
    """A gradient that does not fit the cached tables goes through the full checks: a
    clear error naming the leaf, and the caller's params and state untouched."""
    gen = torch.Generator().manual_seed(12)
    tx = ftopt.adam(0.01)
    params = _tree(gen, torch.float32)
    state = tx.init(params)
    grads = _tree(gen, torch.float32)
    params, state = ftopt.step(tx, params, grads, state, backend="fused", donate=True)
    snapshot = [x.clone() for x in ftopt.tree.leaves((params, state))]
    bad = [
        ({**grads, "odd": torch.randn(5, 7, device=DEVICE)}, ValueError, r"\['odd'\].*shape"),
        ({**grads, "odd": torch.randn(7, 5, device="meta")}, ValueError,
         r"grad at \['odd'\]: on meta"),
        ({**grads, "odd": torch.randn(5, 7, device=DEVICE).t()}, RuntimeError,
         "not contiguous"),
        ({**grads, "odd": "not a tensor"}, TypeError, r"\['odd'\]"),
    ]
    for wrong, error, match in bad:
        with pytest.raises(error, match=match):
            ftopt.step(tx, params, wrong, state, backend="fused", donate=True)
        for old, now in zip(snapshot, ftopt.tree.leaves((params, state))):
            assert torch.equal(old, now)
    moved = {k: (v.to("meta") if k == "odd" else v) for k, v in state[0].mu.items()}
    with pytest.raises(ValueError, match=r"state mu at \['odd'\]: on meta"):
        ftopt.step(tx, params, grads, (state[0]._replace(mu=moved), *state[1:]),
                   backend="fused")


@pytest.mark.parametrize("donate", [False, True])
def test_step_counts_advance_in_every_case(donate):
    """The main kernel increments the step counts; a step with no elements to launch
    over (empty leaves, no gradients) still advances them, and a donate=False step
    leaves the given count alone."""
    gen = torch.Generator().manual_seed(13)
    tx = ftopt.chain(ftopt.clip_by_global_norm(1.0), ftopt.adam(0.01), ftopt.lion(0.001))
    for shapes, with_grads in (({"e": (0,), "f": (2, 0)}, True), ({"a": (3, 4)}, False),
                               ({"a": (3, 4), "b": (5,)}, True)):
        params = _tree(gen, torch.float32, shapes)
        state = tx.init(params)
        for i in range(3):
            grads = _tree(gen, torch.float32, shapes) if with_grads else {
                k: None for k in shapes}
            before = [int(c) for c in _counts(state)]
            params, new_state = ftopt.step(tx, params, grads, state, backend="fused",
                                           donate=donate)
            assert [int(c) for c in _counts(new_state)] == [i + 1, i + 1]
            if not donate:
                assert [int(c) for c in _counts(state)] == before
            state = new_state


def _counts(state):
    return [leaf for leaf in ftopt.tree.leaves(state) if not leaf.is_floating_point()]


def test_donated_step_of_module_parameters_fuses():
    """nn.Parameters (requires_grad) with grad mode on: a donated step is never
    differentiable, so it fuses, writes in place and leaves them Parameters."""
    torch.manual_seed(14)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    model.to(DEVICE)
    reference = {k: v.detach().clone() for k, v in model.named_parameters()}
    tx = ftopt.adamw(0.01, weight_decay=0.1)
    params = dict(model.named_parameters())
    state, ref_state = tx.init(params), tx.init(reference)
    ids = {k: id(v) for k, v in params.items()}
    for _ in range(3):
        model.zero_grad()
        model(torch.randn(4, 5, device=DEVICE)).square().sum().backward()
        grads = {k: p.grad for k, p in model.named_parameters()}
        params, state = ftopt.step(tx, dict(model.named_parameters()), grads, state,
                                   donate=True, backend="fused")
        reference, ref_state = ftopt.step(tx, reference, grads, ref_state, backend="eager")
    for k, p in model.named_parameters():
        assert id(p) == ids[k] and isinstance(p, torch.nn.Parameter) and p.requires_grad
        assert _rel_err(p.detach(), reference[k]) <= 1e-6, k


@pytest.mark.parametrize("donate", [False, True])
def test_steps_do_not_keep_gradients_alive(donate):
    """The cached tables must not hold the last step's gradients: with
    zero_grad(set_to_none=True) their memory is the next backward's."""
    import gc
    import weakref

    gen = torch.Generator().manual_seed(15)
    tx = ftopt.adam(0.01)
    params = _tree(gen, torch.float32)
    state = tx.init(params)
    refs = []
    for _ in range(3):
        grads = _tree(gen, torch.float32)
        refs.append(weakref.ref(grads["ragged"]))
        params, state = ftopt.step(tx, params, grads, state, backend="fused", donate=donate)
        del grads
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.mark.usefixtures("tensor_checks")
def test_every_donated_step_checks_the_storage_of_every_tensor(monkeypatch):
    """Kept or new gradient tensors, every cached donated step checks all its tensors
    (params, states, gradients) in one call, and every step stays correct."""
    from ftopt.lowering import checks

    calls = []
    real = checks.TensorCheck.fit
    monkeypatch.setattr(checks.TensorCheck, "fit",
                        lambda self, *parts: calls.append(sum(map(len, parts)))
                        or real(self, *parts))
    gen = torch.Generator().manual_seed(16)
    tx = ftopt.adam(0.01)
    params = _tree(gen, torch.float32)
    reference = {k: v.clone() for k, v in params.items()}
    state, ref_state = tx.init(params), tx.init(reference)
    kept = _tree(gen, torch.float32)
    n_tensors = 2 * len(params) + 2 * len(params) + 1  # params, grads, mu, nu, count
    for i in range(8):
        grads = _tree(gen, torch.float32) if i < 4 else kept
        calls.clear()
        params, state = ftopt.step(tx, params, grads, state, backend="fused", donate=True)
        reference, ref_state = ftopt.step(tx, reference, grads, ref_state, backend="eager")
        if i > 0:
            assert calls == [n_tensors], (i, calls)
    for k in params:
        assert _rel_err(params[k], reference[k]) < 1e-5, k


@pytest.mark.parametrize("donate", [False, True])
def test_misaligned_new_grads_leave_the_aligned_tables(donate):
    """Tables built for 16-byte-aligned tensors compile vector accesses; a gradient that
    starts 4 bytes into its storage (contiguous, so it fuses) must not go through them:
    the full path builds unaligned tables, and the results stay the eager ones."""
    from ftopt.lowering.plan import plan_chain

    gen = torch.Generator().manual_seed(17)
    tx = ftopt.adam(0.01)
    params = _tree(gen, torch.float32)
    state = tx.init(params)
    reference = {k: v.clone() for k, v in params.items()}
    ref_state = tx.init(reference)
    for i in range(3):
        grads = _tree(gen, torch.float32)
        if i == 2:
            shifted = {}
            for k, g in grads.items():
                storage = torch.empty(g.numel() + 1, device=DEVICE)
                shifted[k] = storage[1:].view(g.shape).copy_(g)
            grads = shifted
            big = grads["two_blocks"]
            assert big.is_contiguous() and big.data_ptr() % 16 == 4
        params, state = ftopt.step(tx, params, grads, state, backend="fused", donate=donate)
        reference, ref_state = ftopt.step(tx, reference, grads, ref_state, backend="eager")
        for k in params:
            assert _rel_err(params[k], reference[k]) <= 1e-6, (i, k)
    plan = plan_chain(tx)
    prepared = plan.prepared if donate else plan.functional["p"].prepared
    assert not any(group.aligned for group in prepared.groups)
