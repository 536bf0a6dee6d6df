"""``inject_hyperparams`` inside other transforms (after a clip in a chain, in
``partition`` branches) under ``ftopt.step``: the same kernels as the plain chain, the
hyperparameters read from the state (a number assigned there compiles nothing), and the
fused step equal to the eager one (which runs the wrapper's own ``update``)."""

from __future__ import annotations

import optree
import pytest
import torch

import ftopt
from ftopt.lowering import kernel_files
from tests.step_checks import assert_trees_close

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

pytestmark = pytest.mark.usefixtures("one_thread")


def _tree(gen) -> dict:
    return {"w": torch.randn(4, 3, generator=gen).to(DEVICE),
            "v": torch.randn(2, 5, generator=gen).to(DEVICE),
            "b": torch.randn(5, generator=gen).to(DEVICE)}


def _labels(params: dict) -> dict:
    return {k: "matrix" if p.dim() == 2 else "vector" for k, p in params.items()}


def _clipped(injected: bool):
    adamw = ftopt.inject_hyperparams(ftopt.adamw) if injected else ftopt.adamw
    return ftopt.chain(ftopt.clip_by_global_norm(1.0),
                       adamw(learning_rate=1e-2, weight_decay=0.1))


def _split(injected: bool):
    wrap = ftopt.inject_hyperparams if injected else (lambda factory: factory)
    # (Injected, a schedule is a value in the state: the rule's hyperparameter is a
    # tensor, as a plain chain's constant is a number, and has no step count.)
    sched = ftopt.linear_schedule(1e-2, 1e-3, 4) if injected else 1e-2
    return ftopt.partition({"matrix": wrap(ftopt.adamw)(learning_rate=sched, b1=0.8),
                            "vector": wrap(ftopt.sgd)(learning_rate=0.1, momentum=0.9)},
                           _labels)


def _hyperparams(state, case: str) -> list[dict]:
    """The wrappers' hyperparameter dicts in ``state``."""
    if case == "clipped":
        return [state[1].hyperparams]
    return [state.inner_states[k].inner_state.hyperparams for k in ("matrix", "vector")]


def _tensors(state):
    """``state`` with an assigned number as the 0-d fp32 tensor a step makes of it (a
    donated eager step writes into the caller's state and leaves the number there)."""
    return optree.tree_map(lambda x: torch.tensor(x, dtype=torch.float32, device=DEVICE)
                           if isinstance(x, float) else x, state, namespace="ftopt")


CASES = {"clipped": _clipped, "split": _split}
STEPS = 5


def _run(tx, case: str, backend: str, donate: bool, launches=None, assign: bool = True):
    """``STEPS`` steps; before step 3 a number is assigned to every wrapper's
    ``learning_rate`` (``assign``). Returns params, state and the kernels compiled and
    launched per step."""
    gen = torch.Generator().manual_seed(0)
    params = _tree(gen)
    state = tx.init(params)
    compiled, launched = [], []
    for t in range(STEPS):
        if t == 3 and assign and case in CASES:
            for hyper in _hyperparams(state, case):
                hyper["learning_rate"] = 3e-2
        modules, count = len(kernel_files._MODULES), len(launches or ())
        params, state = ftopt.step(tx, params, _tree(gen), state, donate=donate,
                                   backend=backend)
        compiled.append(len(kernel_files._MODULES) - modules)
        launched.append(len(launches or ()) - count)
    return params, state, compiled, launched


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_nested_inject_fuses_as_the_plain_chain(case, donate, kernel_launches):
    plain = CASES[case](False)
    _, _, _, plain_launched = _run(plain, "plain", "fused", donate, kernel_launches)
    tx = CASES[case](True)
    params, state, compiled, launched = _run(tx, case, "fused", donate, kernel_launches)
    assert launched == plain_launched and launched[0] > 0
    assert compiled == [0] * STEPS, "not the plain chain's kernels, or a recompile"
    eager = _run(tx, case, "eager", donate)
    assert_trees_close((params, _tensors(state)), (eager[0], _tensors(eager[1])), rtol=1e-5,
                       atol=1e-6)
    # The assigned number stays; a schedule sets its value again on each step (1e-3 at 5).
    expected = [3e-2] if case == "clipped" else [1e-3, 3e-2]
    assert [float(h["learning_rate"]) for h in _hyperparams(state, case)] == pytest.approx(
        expected)
    counts = [state[1].count] if case == "clipped" else [
        state.inner_states[k].inner_state.count for k in ("matrix", "vector")]
    assert [int(c) for c in counts] == [STEPS] * len(counts)


def test_nested_inject_assigned_value_takes_effect():
    """The assigned rate is the one the kernel uses: the same as a plain chain built
    with it from step 3 on."""
    gen = torch.Generator().manual_seed(1)
    params, grads = _tree(gen), [_tree(gen) for _ in range(2)]
    tx = _clipped(True)
    state = tx.init(params)
    p = dict(params)
    p, state = ftopt.step(tx, p, grads[0], state, backend="fused")
    state[1].hyperparams["learning_rate"] = 5e-2
    p, state = ftopt.step(tx, p, grads[1], state, backend="fused")
    ref_lr1 = ftopt.chain(ftopt.clip_by_global_norm(1.0),
                          ftopt.adamw(learning_rate=1e-2, weight_decay=0.1))
    ref_lr2 = ftopt.chain(ftopt.clip_by_global_norm(1.0),
                          ftopt.adamw(learning_rate=5e-2, weight_decay=0.1))
    q, ref_state = ftopt.step(ref_lr1, dict(params), grads[0], ref_lr1.init(params),
                              backend="eager")
    q, _ = ftopt.step(ref_lr2, q, grads[1], ref_state, backend="eager")
    assert_trees_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("donate", [False, True])
def test_nested_inject_bad_value_changes_nothing(donate):
    gen = torch.Generator().manual_seed(2)
    tx = _clipped(True)
    params = _tree(gen)
    state = tx.init(params)
    params, state = ftopt.step(tx, params, _tree(gen), state, backend="fused")
    state[1].hyperparams["learning_rate"] = "fast"
    before = {k: v.clone() for k, v in params.items()}
    mu = {k: v.clone() for k, v in state[1].inner_state[0].mu.items()}
    with pytest.raises(TypeError, match=r"state.hyperparams\['learning_rate'\]"):
        ftopt.step(tx, params, _tree(gen), state, donate=donate, backend="fused")
    assert all(torch.equal(params[k], before[k]) for k in params)
    assert all(torch.equal(state[1].inner_state[0].mu[k], mu[k]) for k in mu)
    assert int(state[1].count) == 1


def _optimizer_run(backend: str) -> dict:
    gen = torch.Generator().manual_seed(3)
    params = {k: torch.nn.Parameter(v) for k, v in _tree(gen).items()}
    opt = ftopt.Optimizer(params.items(), _split(True), backend=backend)
    for _ in range(4):
        for p, g in zip(params.values(), _tree(gen).values()):
            p.grad = g
        opt.step()
    return {k: p.detach() for k, p in params.items()}


def test_nested_inject_through_the_optimizer():
    assert_trees_close(_optimizer_run("fused"), _optimizer_run("eager"), rtol=1e-5,
                       atol=1e-6)
