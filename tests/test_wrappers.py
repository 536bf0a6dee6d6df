"""``MultiSteps`` and ``inject_hyperparams`` against float64 formulas written here (optax's
semantics), over 20+ steps; the inner update may run fused (the interpreter on a CPU)."""

from __future__ import annotations

import pytest
import torch

import ftopt
from ftopt.lowering import kernel_files

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tree(gen):
    return {"w": torch.randn(4, 3, generator=gen).to(DEVICE),
            "b": torch.randn(5, generator=gen).to(DEVICE)}


@pytest.mark.parametrize("use_grad_mean", [True, False])
@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_multisteps_is_sgd_on_the_accumulated_gradient(use_grad_mean, backend):
    gen = torch.Generator().manual_seed(3)
    k, lr = 3, 0.1
    ms = ftopt.MultiSteps(ftopt.sgd(lr, momentum=0.5), k, use_grad_mean=use_grad_mean)
    tx = ms.gradient_transformation()
    params = _tree(gen)
    ref = {n: v.double() for n, v in params.items()}
    trace = {n: torch.zeros_like(v) for n, v in ref.items()}
    acc = {n: torch.zeros_like(v) for n, v in ref.items()}
    state = tx.init(params)
    for i in range(21):
        grads = _tree(gen)
        before = params
        u, state = tx.update(grads, state, params, backend=backend)
        params = ftopt.apply_updates(params, u)
        for n in ref:
            acc[n] = acc[n] + grads[n].double()
        final = (i + 1) % k == 0
        assert bool(ms.has_updated(state)) == final
        if final:
            for n in ref:
                g = acc[n] / k if use_grad_mean else acc[n]
                trace[n] = g + 0.5 * trace[n]
                ref[n] = ref[n] - lr * trace[n]
                acc[n] = torch.zeros_like(acc[n])
        else:
            assert all(torch.equal(params[n], before[n]) for n in params)
        for n in ref:
            assert torch.allclose(params[n].double(), ref[n], rtol=1e-5, atol=1e-6), (i, n)
    assert int(state.gradient_step) == 7


def test_multisteps_skip_fn_changes_nothing():
    gen = torch.Generator().manual_seed(4)
    skip_all = lambda updates, step, params: (torch.tensor(True), ())  # noqa: E731
    tx = ftopt.MultiSteps(ftopt.adam(1e-2), 1, should_skip_update_fn=skip_all)
    params = _tree(gen)
    state = tx.init(params)
    u, new_state = tx.update(_tree(gen), state, params)
    assert all(torch.equal(x, torch.full_like(x, -0.0)) for x in ftopt.tree.leaves(u))
    for a, b in zip(ftopt.tree.leaves(new_state), ftopt.tree.leaves(state)):
        assert torch.equal(a, b)


def _adam_reference(ref, mu, nu, grads, t, lr, b1):
    """One float64 Adam step (b2 = 0.999, eps = 1e-8), written from the formula."""
    for n in ref:
        g = grads[n].double()
        mu[n] = b1 * mu[n] + (1 - b1) * g
        nu[n] = 0.999 * nu[n] + 0.001 * g * g
        m_hat, v_hat = mu[n] / (1 - b1 ** t), nu[n] / (1 - 0.999 ** t)
        ref[n] = ref[n] - lr * m_hat / (v_hat.sqrt() + 1e-8)


@pytest.mark.parametrize("how", ["update", "step", "donated step"])
def test_inject_hyperparams_matches_float64_adam_and_changes_without_recompiling(how):
    """Values changed in the state between steps take effect on the next step: a number
    assigned (known on the host: kernel arguments, nothing compiled), then in-place
    changes (read on the device: at most one kernel variant that reads its scalars
    from a buffer, compiled once, then nothing more)."""
    gen = torch.Generator().manual_seed(5)
    tx = ftopt.inject_hyperparams(ftopt.adam)(learning_rate=1e-2, b1=0.9)
    params = _tree(gen)
    state = tx.init(params)
    assert set(state.hyperparams) == {"learning_rate", "b1"}
    ref = {n: v.double() for n, v in params.items()}
    mu = {n: torch.zeros_like(v) for n, v in ref.items()}
    nu = {n: torch.zeros_like(v) for n, v in ref.items()}
    modules = {}
    lr, b1 = 1e-2, 0.9
    for t in range(1, 23):
        modules[t] = len(kernel_files._MODULES)
        if t == 8:
            lr = 3e-2
            state.hyperparams["learning_rate"] = lr  # a number: known on the host
        if t == 13:
            lr = 5e-3
            state.hyperparams["learning_rate"].fill_(lr)  # in place: read on the device
        if t == 17:
            lr, b1 = 2e-2, 0.8
            state.hyperparams["learning_rate"].fill_(lr)
            state.hyperparams["b1"].fill_(b1)
        grads = _tree(gen)
        if how == "update":
            u, state = tx.update(grads, state, params, backend="fused")  # inner update fuses
            params = ftopt.apply_updates(params, u)
        else:
            params, state = ftopt.step(tx, params, grads, state, backend="fused",
                                       donate=how == "donated step")
        _adam_reference(ref, mu, nu, grads, t, lr, b1)
        for n in ref:
            assert torch.allclose(params[n].double(), ref[n], rtol=1e-5, atol=1e-6), (t, n)
    assert modules[13] == modules[2], "a hyperparameter known on the host compiled a kernel"
    assert modules[14] <= modules[13] + 1
    assert len(kernel_files._MODULES) == modules[14], "changing a hyperparameter compiled a kernel"
    assert int(state.count) == 22


@pytest.mark.parametrize("backend, donate", [("auto", False), ("fused", False),
                                             ("fused", True)])
def test_inject_hyperparams_schedules_follow_the_count(backend, donate):
    sched = ftopt.linear_schedule(1.0, 0.0, 4)
    tx = ftopt.inject_hyperparams(ftopt.sgd)(learning_rate=sched)
    params = {"w": torch.ones(3, device=DEVICE)}
    state = tx.init(params)
    seen = []
    for _ in range(5):
        seen.append(float(state.hyperparams["learning_rate"]))
        params, state = ftopt.step(tx, params, {"w": torch.ones(3, device=DEVICE)}, state,
                                   donate=donate, backend=backend)
    assert seen == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert torch.allclose(params["w"].cpu(), torch.full((3,), 1.0 - 2.5))


# ---- ftopt.step of inject_hyperparams: the inner transform's fused step


def _close(a: dict, b: dict) -> bool:
    return all(torch.allclose(a[n], b[n], rtol=1e-6, atol=1e-7) for n in a)


@pytest.mark.parametrize("donate", [False, True])
def test_inject_step_is_the_plain_chains_kernel(donate, kernel_launches):
    gen = torch.Generator().manual_seed(6)
    plain = ftopt.adam(1e-2, b1=0.8)
    tx = ftopt.inject_hyperparams(ftopt.adam)(learning_rate=1e-2, b1=0.8)
    params = _tree(gen)
    p_plain, s_plain = {n: v.clone() for n, v in params.items()}, plain.init(params)
    p_eager, s_eager = {n: v.clone() for n, v in params.items()}, tx.init(params)
    state = tx.init(params)
    for t in range(6):
        grads = _tree(gen)
        p_plain, s_plain = ftopt.step(plain, p_plain, grads, s_plain, backend="fused")
        modules, launches = len(kernel_files._MODULES), len(kernel_launches)
        before = (params, state.count, state.inner_state[0].mu)
        params, state = ftopt.step(tx, params, grads, state, donate=donate, backend="fused")
        assert len(kernel_files._MODULES) == modules, "not the plain chain's kernel"
        assert len(kernel_launches) == launches + 1  # one main kernel, as the plain chain
        if donate:  # written in place: the same tensor objects
            assert all(params[n] is before[0][n] for n in params)
            assert state.count is before[1]
            assert all(state.inner_state[0].mu[n] is before[2][n] for n in params)
        p_eager, s_eager = ftopt.step(tx, p_eager, grads, s_eager, backend="eager")
        assert _close(params, p_plain) and _close(params, p_eager), t
        assert _close(state.inner_state[0].nu, s_eager.inner_state[0].nu), t
    assert int(state.count) == int(s_eager.count) == 6


def test_inject_step_reads_nothing_from_the_device(monkeypatch):
    """Known values are kernel arguments; an in-place change is read on the device: no
    step reads a device value on the host (the first step may learn the counts)."""
    gen = torch.Generator().manual_seed(7)
    tx = ftopt.inject_hyperparams(ftopt.adam)(learning_rate=1e-2,
                                              b1=ftopt.linear_schedule(0.9, 0.8, 5))
    params = _tree(gen)
    state = tx.init(params)
    params, state = ftopt.step(tx, params, _tree(gen), state, backend="fused")
    grads = [_tree(gen) for _ in range(4)]

    def refuse(self, *args, **kwargs):
        raise AssertionError("a host read of a device value")

    with monkeypatch.context() as m:
        for name in ("item", "__float__", "__int__", "__bool__", "tolist"):
            m.setattr(torch.Tensor, name, refuse)
        for i, g in enumerate(grads):
            if i == 1:
                state.hyperparams["learning_rate"] = 2e-2
            if i == 2:
                state.hyperparams["learning_rate"].fill_(3e-2)
            params, state = ftopt.step(tx, params, g, state, donate=i % 2 == 1,
                                       backend="fused")
    assert int(state.count) == 5
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(3e-2)


@pytest.mark.parametrize("donate", [False, True])
def test_inject_step_skip_zeros_is_exact(donate):
    """SPEC §3 through the wrapper: where the raw gradient is zero, params and states keep
    their bits; elsewhere the bits of the same optimizer without skip_zeros."""
    gen = torch.Generator().manual_seed(8)
    skip = ftopt.inject_hyperparams(ftopt.adamw)(learning_rate=1e-2, weight_decay=0.1,
                                                 skip_zeros=True)
    plain = ftopt.inject_hyperparams(ftopt.adamw)(learning_rate=1e-2, weight_decay=0.1)
    params = _tree(gen)
    p_ref, s_ref = {n: v.clone() for n, v in params.items()}, plain.init(params)
    state = skip.init(params)
    for t in range(4):
        grads = _tree(gen)
        zero = {n: torch.rand(g.shape, generator=gen).to(DEVICE) < 0.4 for n, g in grads.items()}
        grads = {n: torch.where(zero[n], torch.zeros_like(g), g) for n, g in grads.items()}
        old = ({n: v.clone() for n, v in params.items()},
               {n: v.clone() for n, v in state.inner_state[0].mu.items()},
               {n: v.clone() for n, v in state.inner_state[0].nu.items()})
        params, state = ftopt.step(skip, params, grads, state, donate=donate, backend="fused")
        p_ref, s_ref = ftopt.step(plain, p_ref, grads, s_ref, backend="fused")
        new = (params, state.inner_state[0].mu, state.inner_state[0].nu)
        for before, after in zip(old, new):
            for n, z in zero.items():
                assert torch.equal(after[n][z], before[n][z]), (t, n)
        if t == 0:  # from the same state: every other element has the plain step's bits
            for n, z in zero.items():
                assert torch.equal(params[n][~z], p_ref[n][~z]), n
                assert torch.equal(new[1][n][~z], s_ref.inner_state[0].mu[n][~z]), n
    assert int(state.count) == 4


def test_inject_step_checkpoint_round_trip(tmp_path):
    gen = torch.Generator().manual_seed(9)
    tx = ftopt.inject_hyperparams(ftopt.adam)(learning_rate=ftopt.linear_schedule(
        1e-2, 1e-3, 6), b1=0.85)
    params = _tree(gen)
    state = tx.init(params)
    for _ in range(3):
        params, state = ftopt.step(tx, params, _tree(gen), state, backend="fused")
    state.hyperparams["b1"].fill_(0.8)
    torch.save((params, state), tmp_path / "ckpt.pt")
    loaded_params, loaded = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert isinstance(loaded, ftopt.InjectHyperparamsState)
    for _ in range(3):
        grads = _tree(gen)
        params, state = ftopt.step(tx, params, grads, state, backend="fused")
        loaded_params, loaded = ftopt.step(tx, loaded_params, grads, loaded, donate=True,
                                           backend="fused")
    assert _close(params, loaded_params)
    assert int(loaded.count) == int(state.count) == 6
    for k in ("learning_rate", "b1"):
        assert float(loaded.hyperparams[k]) == float(state.hyperparams[k])
    assert float(state.hyperparams["b1"]) == pytest.approx(0.8)


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("bad, error, words", [
    ({"learning_rate": torch.ones(2)}, ValueError, ["'learning_rate'", "0-d", "(2,)"]),
    ({"learning_rate": "big"}, TypeError, ["'learning_rate'", "number", "str"]),
    ({"b1": None}, ValueError, ["no 'learning_rate'"]),
])
def test_inject_step_bad_hyperparams_change_nothing(donate, bad, error, words):
    gen = torch.Generator().manual_seed(10)
    tx = ftopt.inject_hyperparams(ftopt.adam)(learning_rate=1e-2, b1=0.9)
    params = _tree(gen)
    state = tx.init(params)
    params, state = ftopt.step(tx, params, _tree(gen), state, backend="fused")
    hyper = {k: v for k, v in {**state.hyperparams, **bad}.items() if v is not None}
    if "b1" in bad:
        hyper = {"b1": state.hyperparams["b1"]}
    state = state._replace(hyperparams=hyper)
    kept = [t.clone() for t in ftopt.tree.leaves((params, state)) if isinstance(
        t, torch.Tensor)]
    with pytest.raises(error) as err:
        ftopt.step(tx, params, _tree(gen), state, donate=donate, backend="fused")
    assert all(w in str(err.value) for w in words), str(err.value)
    now = [t for t in ftopt.tree.leaves((params, state)) if isinstance(t, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(kept, now))


def test_inject_explain_shows_the_fused_inner_step():
    tx = ftopt.inject_hyperparams(ftopt.adam)(learning_rate=1e-2)
    params = {"w": torch.zeros(3, device=DEVICE)}
    text = ftopt.explain(tx, params, backend="fused", file=_Null())
    assert "inject_hyperparams" in text and "path: fused" in text, text
    assert "scale_by_adam" in text


class _Null:
    def write(self, text: str) -> int:
        return len(text)
