"""``masked`` and ``partition`` in the fused kernel (param groups), against the eager path.

Branches of a partition that are the same chain of rules with other hyperparameters (the
GPT recipe: weight decay 0.1 for matrices, 0 for biases and norms; per-group learning
rates) and ``masked`` stateless stages run as one launch per (dtype, state) group.
Small sizes: the kernels run in the Triton interpreter on the CPU.
"""

from __future__ import annotations

import pytest
import torch

import ftopt
from ftopt.lowering import codegen, launch
from tests.step_checks import assert_trees_close, run_steps

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.usefixtures("one_thread")

LABELS = {"w": "decay", "b": "no_decay", "ln": "no_decay", "v": "decay"}


def _params(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    shapes = {"w": (24, 40), "b": (40,), "ln": (40,), "v": (3, 5)}
    return {k: torch.randn(s, generator=g).to(DEVICE, dtype) for k, s in shapes.items()}


def _grads(params, step: int, zero_rows: bool = False):
    g = torch.Generator().manual_seed(100 + step)
    out = {k: torch.randn(p.shape, generator=g).to(DEVICE, p.dtype) for k, p in params.items()}
    if zero_rows:
        out["w"][::3] = 0.0
        out["b"][:7] = -0.0
    return out


def _gpt_partition(skip: bool = False, lr_decay=1e-2, lr_other=None):
    lr_other = ftopt.linear_schedule(2e-2, 1e-3, 4) if lr_other is None else lr_other
    return ftopt.partition(
        {"decay": ftopt.adamw(lr_decay, b1=0.8, weight_decay=0.1, skip_zeros=skip),
         "no_decay": ftopt.adamw(lr_other, b2=0.95, weight_decay=0.0, skip_zeros=skip)},
        LABELS)


def _masked_decay(skip: bool = False):
    parts = [ftopt.scale_by_adam(),
             ftopt.masked(ftopt.add_decayed_weights(0.1),
                          lambda p: {k: v.ndim > 1 for k, v in p.items()}),
             ftopt.scale_by_learning_rate(1e-2)]
    return ftopt.chain(*parts, ftopt.skip_zeros()) if skip else ftopt.chain(*parts)


def _run(tx, backend: str, steps: int = 3, donate: bool = False, zero_rows: bool = False,
         state=None, start: int = 0):
    return run_steps(tx, _params(), lambda p, t: _grads(p, t, zero_rows), backend, steps,
                     donate, state, start)


@pytest.mark.parametrize("make", [_gpt_partition, _masked_decay])
@pytest.mark.parametrize("donate", [False, True])
def test_fused_matches_eager(make, donate):
    tx = make()
    assert ftopt.explain(tx, _params(), backend="fused", file=None).count("path: fused") == 1
    eager = _run(tx, "eager")
    fused = _run(tx, "fused", donate=donate)
    assert_trees_close(fused, eager)  # params and every state, the same tree structure


def test_partition_matches_float64_formula():
    """Two steps of the two AdamW branches written out in float64."""
    tx = ftopt.partition({"decay": ftopt.adamw(1e-2, weight_decay=0.1),
                          "no_decay": ftopt.adamw(3e-2, b1=0.5, weight_decay=0.0)}, LABELS)
    params, _ = _run(tx, "fused", steps=2)
    for name, p0 in _params().items():
        lr, b1, wd = (1e-2, 0.9, 0.1) if LABELS[name] == "decay" else (3e-2, 0.5, 0.0)
        p, mu, nu = p0.double(), 0.0, 0.0
        for t in range(2):
            g = _grads(_params(), t)[name].double()
            mu = b1 * mu + (1 - b1) * g
            nu = 0.999 * nu + 0.001 * g * g
            u = (mu / (1 - b1 ** (t + 1))) / ((nu / (1 - 0.999 ** (t + 1))).sqrt() + 1e-8)
            p = p - lr * (u + wd * p)
        torch.testing.assert_close(params[name].double(), p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make", [_gpt_partition, _masked_decay])
def test_skip_zeros_bit_identity(make):
    skipping = _run(make(skip=True), "fused", steps=2, zero_rows=True)
    control = _run(make(skip=False), "fused", steps=2, zero_rows=True)
    start = _params()
    p_skip, p_ctrl = skipping[0], control[0]
    for name in start:
        zero = torch.zeros_like(start[name], dtype=torch.bool)
        for t in range(2):
            zero |= _grads(start, t, True)[name] == 0
        assert torch.equal(p_skip[name][zero], start[name][zero])
        # A row zero at one step only differs from the control there: compare the rows
        # whose gradients were never zero, bit for bit.
        assert torch.equal(p_skip[name][~zero], p_ctrl[name][~zero])


def test_one_launch_per_dtype_group(monkeypatch):
    calls = []
    real = launch._launch
    monkeypatch.setattr(launch, "_launch", lambda *a, **k: (calls.append(a[0]), real(*a, **k)))
    tx = _gpt_partition()
    params = _params()
    state = tx.init(params)
    params, state = ftopt.step(tx, params, _grads(params, 0), state, backend="fused")
    assert len(calls) == 1  # two branches, one kernel
    calls.clear()
    mixed = {**_params(), "b": _params()["b"].to(torch.bfloat16)}
    state = tx.init(mixed)
    ftopt.step(tx, mixed, _grads(mixed, 0), state, backend="fused")
    assert len(calls) == 2  # fp32 and bf16 params: one launch each


def test_changing_a_branch_lr_does_not_recompile(monkeypatch):
    lr = torch.tensor(1e-2, device=DEVICE)
    tx = _gpt_partition(lr_decay=lr, lr_other=3e-2)
    params = _params()
    state = tx.init(params)
    params, state = ftopt.step(tx, params, _grads(params, 0), state, donate=True,
                               backend="fused")
    compiled = []
    real = codegen.compile_source
    monkeypatch.setattr(codegen, "compile_source",
                        lambda *a: (compiled.append(a[1]), real(*a))[1])
    before = {k: v.clone() for k, v in params.items()}
    lr.fill_(0.0)  # the decay branch stands still from now on
    params, state = ftopt.step(tx, params, _grads(params, 1), state, donate=True,
                               backend="fused")
    assert compiled == []
    for name in params:
        moved = not torch.equal(params[name], before[name])
        assert moved == (LABELS[name] == "no_decay"), name


def test_eager_state_continues_on_the_fused_path():
    tx = _gpt_partition()
    _, state = _run(tx, "eager", steps=2)
    params = _run(tx, "eager", steps=2)[0]
    eager = params, state
    for t in (2, 3):
        eager = ftopt.step(tx, *[eager[0], _grads(eager[0], t)], eager[1], backend="eager")
    fused = params, state
    for t in (2, 3):
        fused = ftopt.step(tx, fused[0], _grads(fused[0], t), fused[1], backend="fused")
    assert_trees_close(fused, eager)


def test_branches_that_differ_in_their_rules_fuse():
    """(More in tests/test_masked_branches.py.)"""
    tx = ftopt.partition({"decay": ftopt.adamw(1e-2), "no_decay": ftopt.sgd(1e-2)}, LABELS)
    params = _params()
    assert "differ in their rules" in ftopt.explain(tx, params, backend="fused", file=None)
    assert_trees_close(ftopt.step(tx, params, _grads(params, 0), tx.init(params), backend="fused"),
           ftopt.step(tx, params, _grads(params, 0), tx.init(params), backend="eager"))


def test_missing_label_raises_and_changes_nothing():
    tx = _gpt_partition()
    params = _params()
    state = tx.init(params)
    bad = ftopt.partition(ftopt.combine.owner(tx).user_transforms, {**LABELS, "v": "other"})
    kept = {k: v.clone() for k, v in params.items()}
    with pytest.raises(ValueError, match="labels \\['other'\\] have no transform"):
        ftopt.step(bad, params, _grads(params, 0), state, donate=True, backend="fused")
    assert_trees_close(params, kept)
