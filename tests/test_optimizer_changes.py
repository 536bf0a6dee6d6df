"""``ftopt.Optimizer`` checks and copies a group's hyperparameters only where they changed
(:class:`ftopt.group_run.GroupRun`, compared by identity): every change between steps
must still reach the next step, with no rebuilt transform and no recompiled kernel. The
reference is AdamW written out in float64 from the values each step had. Small sizes:
the fused kernels run in the Triton interpreter on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import ftopt
from ftopt.lowering import codegen, execute

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPES = [(6, 5), (5,), (3, 4), (4,)]  # groups: 0 the matrices, 1 the vectors


def _setup(joined: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    start = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
    params = [torch.nn.Parameter(p.float().to(DEVICE)) for p in start]
    if joined:
        groups = [{"params": [params[0], params[2]], "weight_decay": 0.1},
                  {"params": [params[1], params[3]], "weight_decay": 0.0, "lr": 2e-2}]
    else:
        groups = [{"params": params, "weight_decay": 0.1}]
    opt = ftopt.Optimizer(groups, ftopt.adamw, lr=1e-2, backend="fused")
    return gen, start, params, opt


def _reference(start, grads, values) -> list:
    """AdamW in float64; ``values[t][i]``: (lr, b1, b2, wd) of param ``i`` at step t+1,
    or ``None`` where it had no gradient (and no step)."""
    p = [s.clone() for s in start]
    mu = [torch.zeros_like(s) for s in start]
    nu = [torch.zeros_like(s) for s in start]
    counts = [0] * len(start)
    for g, vals in zip(grads, values):
        for i, v in enumerate(vals):
            if v is None:
                continue
            lr, b1, b2, wd = v
            counts[i] += 1
            t = counts[i]
            mu[i] = b1 * mu[i] + (1 - b1) * g[i]
            nu[i] = b2 * nu[i] + (1 - b2) * g[i] ** 2
            u = (mu[i] / (1 - b1 ** t)) / ((nu[i] / (1 - b2 ** t)).sqrt() + 1e-8)
            p[i] = p[i] - lr * (u + wd * p[i])
    return p


def _values(opt, params) -> list:
    out = [None] * len(params)
    for group in opt.param_groups:
        b1, b2 = group["betas"]
        for p in group["params"]:
            i = next(k for k, q in enumerate(params) if q is p)
            if p.grad is not None:
                out[i] = (float(group["lr"]), float(b1), float(b2),
                          float(group["weight_decay"]))
    return out


def _step(opt, params, gen, grads, values, skip=()):
    g = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
    for i, p in enumerate(params):
        p.grad = None if i in skip else g[i].float().to(DEVICE)
    grads.append([x.float().double() for x in g])
    values.append(_values(opt, params))
    opt.step()


@pytest.mark.parametrize("joined", [False, True], ids=["one group", "two groups"])
def test_changes_between_steps_reach_the_next_step(joined, monkeypatch):
    gen, start, params, opt = _setup(joined, 1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.7 ** s)
    grads, values = [], []
    _step(opt, params, gen, grads, values)
    sched.step()
    txs = [run.tx for run in opt._runs]
    found = []
    real = codegen.compile_source
    monkeypatch.setattr(codegen, "compile_source",
                        lambda *a: (found.append(a[1]), real(*a))[1])
    # The scheduler writes every group's lr as a new float: the next step takes it.
    _step(opt, params, gen, grads, values)
    sched.step()
    last = len(opt.param_groups) - 1
    # One group's weight decay, then its betas as a new tuple, then as a list changed in
    # place (a value that can change in place is copied on every step).
    opt.param_groups[last]["weight_decay"] = 0.25
    _step(opt, params, gen, grads, values)
    opt.param_groups[last]["betas"] = (0.8, 0.95)
    _step(opt, params, gen, grads, values)
    opt.param_groups[0]["betas"] = [0.85, 0.99]
    _step(opt, params, gen, grads, values)
    opt.param_groups[0]["betas"][1] = 0.9
    _step(opt, params, gen, grads, values)
    # Nothing changed: the values held stay in force.
    _step(opt, params, gen, grads, values)
    assert [run.tx for run in opt._runs] == txs and found == []
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(1e-2 * 0.7 ** 2)
    # A tensor lr is the caller's: copied on every step (its host value unknown, the
    # scalars come from the device), also after the caller changed it in place; then a
    # number again (its host value known once more).
    lr = torch.tensor(0.03, dtype=torch.float64)
    opt.param_groups[0]["lr"] = lr
    _step(opt, params, gen, grads, values)
    lr.fill_(0.015)
    _step(opt, params, gen, grads, values)
    opt.param_groups[0]["lr"] = 0.02
    _step(opt, params, gen, grads, values)
    _step(opt, params, gen, grads, values)
    assert [run.tx for run in opt._runs] == txs
    want = _reference(start, grads, values)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.detach().cpu().double(), w, rtol=1e-5, atol=1e-6)


def test_a_change_while_a_group_has_no_gradients_applies_when_it_steps_again():
    gen, start, params, opt = _setup(True, 2)
    grads, values = [], []
    _step(opt, params, gen, grads, values)
    opt.param_groups[1]["lr"] = 0.05  # the group has no gradient at the next step
    _step(opt, params, gen, grads, values, skip={1, 3})
    _step(opt, params, gen, grads, values)
    opt.param_groups[1]["weight_decay"] = 0.3
    opt.param_groups[0]["lr"] = 0.04  # both groups changed, one has no gradient
    _step(opt, params, gen, grads, values, skip={0, 2})
    _step(opt, params, gen, grads, values)
    want = _reference(start, grads, values)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.detach().cpu().double(), w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad, message", [(-1.0, "lr must be >= 0"),
                                          (float("nan"), "lr must be a finite number")])
def test_a_bad_value_after_a_good_step_raises_and_changes_nothing(bad, message):
    gen, start, params, opt = _setup(True, 3)
    grads, values = [], []
    _step(opt, params, gen, grads, values)
    before = [p.detach().clone() for p in params]
    state = {i: {k: v.clone() for k, v in s.items()}
             for i, s in opt.state_dict()["state"].items()}
    opt.param_groups[1]["lr"] = bad
    for p in params:
        p.grad = torch.randn_like(p)
    with pytest.raises(ValueError, match=f"param group 1: {message}"):
        opt.step()
    with pytest.raises(ValueError, match=f"param group 1: {message}"):
        opt.step()  # still checked: a value that failed is not taken as seen
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    for i, s in opt.state_dict()["state"].items():
        assert all(torch.equal(v, state[i][k]) for k, v in s.items())
    opt.param_groups[1]["lr"] = 2e-2
    _step(opt, params, gen, grads, values)
    want = _reference(start, grads, values)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.detach().cpu().double(), w, rtol=1e-5, atol=1e-6)


def test_a_param_swapped_in_a_group_is_stepped():
    """The group's params tree is rebuilt where its params change (compared by
    identity): the new tensor is stepped, the old one is left alone."""
    gen, start, params, opt = _setup(False, 4)
    grads, values = [], []
    _step(opt, params, gen, grads, values)
    old = params[1]
    new = torch.nn.Parameter(old.detach().clone())
    opt.param_groups[0]["params"][1] = new
    params[1] = new
    kept = old.detach().clone()
    _step(opt, params, gen, grads, values)
    assert torch.equal(old.detach(), kept)
    want = _reference(start, grads, values)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.detach().cpu().double(), w, rtol=1e-5, atol=1e-6)


def test_step_hooks_profiler_range_and_grad_mode_as_torch(monkeypatch):
    """``step`` keeps torch's hooks: pre-hooks may replace the arguments (they see the
    optimizer first), post-hooks run after, the profiler sees torch's range name, and
    the step runs with gradients off."""
    _, _, params, opt = _setup(False, 5)
    for p in params:
        p.grad = torch.randn_like(p)
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(("pre", args[0] is o)))
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append(("post", len(args))))
    handle = register_optimizer_step_pre_hook(
        lambda o, args, kwargs: (args, {"closure": lambda: 7.0}))
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            assert opt.step() == 7.0
    finally:
        handle.remove()
    assert seen == [("pre", True), ("post", 1)]
    assert "Optimizer.step#Optimizer.step" in {e.name for e in prof.events()}
    # Gradients off in step (on for the closure), and back on after it, also after an
    # error.
    modes = []

    def closure():
        modes.append(torch.is_grad_enabled())
        return 0.0

    real = execute.PreparedStep.launch  # (the kernels' launch: the step's own work)
    monkeypatch.setattr(execute.PreparedStep, "launch", lambda *a: (
        modes.append(torch.is_grad_enabled()), real(*a))[1])
    opt.step(closure)
    assert modes == [True, False] and torch.is_grad_enabled()
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="lr must be >= 0"):
        opt.step()
    assert torch.is_grad_enabled()


def test_a_changed_fixed_hyperparameter_rebuilds_only_its_group():
    """``nesterov`` (not a live value) set in one group, with a new lr in both: that group's
    transform is rebuilt around its state, the other keeps its own; the steps equal the
    eager path's given the same changes, and differ from steps without the change."""
    runs = []
    for backend, nesterov in (("fused", True), ("eager", True), ("fused", False)):
        gen, _, params, opt = _setup(True, 6)
        opt = ftopt.Optimizer(opt.param_groups, ftopt.adamw, lr=1e-2, backend=backend)
        txs = [run.tx for run in opt._runs]
        for step in range(4):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(DEVICE)
            if step == 2:
                opt.param_groups[1]["nesterov"] = nesterov
                for group in opt.param_groups:
                    group["lr"] = group["lr"] * 0.5
            opt.step()
        assert opt._runs[0].tx is txs[0]
        assert (opt._runs[1].tx is not txs[1]) == nesterov
        runs.append([p.detach().clone() for p in params])
    for p, q in zip(runs[0], runs[1]):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert torch.equal(runs[0][0], runs[2][0])  # group 0: the same either way
    assert not torch.allclose(runs[0][1], runs[2][1], rtol=1e-6, atol=1e-7)
