"""``MultiSteps`` and ``inject_hyperparams`` against float64 formulas written here (optax's
semantics), over 20+ steps; the inner update may run fused (the interpreter on a CPU)."""

from __future__ import annotations

import pytest
import torch

import ftopt
from ftopt.lowering import codegen

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
        modules[t] = len(codegen._MODULES)
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
    assert len(codegen._MODULES) == modules[14], "changing a hyperparameter compiled a kernel"
    assert int(state.count) == 22


def test_inject_hyperparams_schedules_follow_the_count():
    sched = ftopt.linear_schedule(1.0, 0.0, 4)
    tx = ftopt.inject_hyperparams(ftopt.sgd)(learning_rate=sched)
    params = {"w": torch.ones(3, device=DEVICE)}
    state = tx.init(params)
    seen = []
    for _ in range(5):
        seen.append(float(state.hyperparams["learning_rate"]))
        params, state = ftopt.step(tx, params, {"w": torch.ones(3, device=DEVICE)}, state)
    assert seen == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert torch.allclose(params["w"].cpu(), torch.full((3,), 1.0 - 2.5))
