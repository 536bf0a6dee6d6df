"""Schedule-Free (``ftopt.schedule_free`` and its aliases) beyond the registry suites: its
running scalars on the fused paths (full, donated in place, cached non-donated), the eval
params against optax's formula in float64, ``state_dtype`` for z, and bad running state."""

from __future__ import annotations

import pytest
import torch

import ftopt
from ftopt.schedule_free import ScheduleFreeState

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = {"w": (9, 7), "b": (13,), "s": ()}

pytestmark = pytest.mark.usefixtures("one_thread")


def _tree(gen, dtype=torch.float32):
    return {k: torch.randn(s, generator=gen).to(dtype).to(DEVICE) for k, s in SHAPES.items()}


def _sf(state) -> ScheduleFreeState:
    return state[1]


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _make():
    return ftopt.schedule_free_adamw(0.05, warmup_steps=3, b1=0.8, b2=0.95,
                                     weight_decay=0.1)


@pytest.mark.parametrize("donate", [False, True])
def test_fused_steps_match_eager(donate):
    """Six fused steps (the donated ones reuse the prepared tables from the second on)
    equal the eager steps; the running scalars are the same values, and a donated step
    writes them into the given tensors."""
    tx = _make()
    gen = torch.Generator().manual_seed(3)
    params_e = _tree(gen)
    params_f = {k: v.clone() for k, v in params_e.items()}
    state_e, state_f = tx.init(params_e), tx.init(params_f)
    held = _sf(state_f).weight_sum
    for _ in range(6):
        grads = _tree(gen)
        params_e, state_e = ftopt.step(tx, params_e, grads, state_e, backend="eager")
        params_f, state_f = ftopt.step(tx, params_f, grads, state_f, backend="fused",
                                       donate=donate)
        for k in SHAPES:
            assert _rel(params_f[k], params_e[k]) <= 1e-6, k
        for name in ("weight_sum", "max_lr", "b1"):
            a, b = getattr(_sf(state_f), name), getattr(_sf(state_e), name)
            assert a.shape == () and a.dtype == torch.float32 and a.device == b.device
            assert torch.allclose(a.cpu(), b.cpu(), rtol=1e-6, atol=0), name
        assert int(_sf(state_f).count) == int(_sf(state_e).count)
    assert (_sf(state_f).weight_sum is held) == donate
    # warmup 0.05·min(t, 3)/3: max_lr = 0.05 from step 3; Σw = Σ max_lr².
    expected = sum((0.05 * min(t, 3) / 3) ** 2 for t in range(1, 7))
    assert abs(float(_sf(state_f).weight_sum) - expected) <= 1e-6 * expected
    assert float(_sf(state_f).max_lr) == pytest.approx(0.05, rel=1e-7)


def test_fused_update_runs_one_kernel_with_the_base():
    """``explain`` plans the base chain and the Schedule-Free stage as one fused group."""
    tx = _make()
    params = _tree(torch.Generator().manual_seed(4))
    text = ftopt.explain(tx, params)
    assert "schedule_free" in text and "has no elementwise rule" not in text


def test_eval_params_against_float64():
    """x = (y − (1−b1)·z)/b1 in float64 (optax's formula), from a state several steps on."""
    tx = ftopt.schedule_free_sgd(0.3, b1=0.7, weight_decay=0.05)
    gen = torch.Generator().manual_seed(5)
    params = _tree(gen)
    state = tx.init(params)
    for _ in range(4):
        params, state = ftopt.step(tx, params, _tree(gen), state)
    x = ftopt.schedule_free_eval_params(state, params)
    for k in SHAPES:
        y, z = params[k].double(), _sf(state).z[k].double()
        want = (y - (1 - 0.7) * z) / 0.7
        assert x[k].dtype == params[k].dtype
        assert (x[k].double() - want).abs().max() <= 1e-6 * max(1.0, want.abs().max())
    # The first step from init: z = y, so x = y.
    fresh = tx.init(params)
    assert all(torch.equal(a, b) for a, b in zip(
        ftopt.tree.leaves(ftopt.schedule_free_eval_params(fresh, params)),
        ftopt.tree.leaves(params)))


def test_eval_params_needs_a_schedule_free_state():
    params = _tree(torch.Generator().manual_seed(6))
    with pytest.raises(ValueError, match="ScheduleFreeState"):
        ftopt.schedule_free_eval_params(ftopt.adam(0.1).init(params), params)


def test_state_dtype_stores_z():
    params = _tree(torch.Generator().manual_seed(7))
    tx = ftopt.schedule_free(ftopt.sgd(0.1), 0.1, state_dtype=torch.bfloat16)
    state = tx.init(params)
    assert all(z.dtype == torch.bfloat16 for z in ftopt.tree.leaves(_sf(state).z))
    grads = _tree(torch.Generator().manual_seed(8))
    new_params, new_state = ftopt.step(tx, params, grads, state, backend="eager")
    assert all(z.dtype == torch.bfloat16 for z in ftopt.tree.leaves(_sf(new_state).z))
    assert all(p.dtype == torch.float32 for p in ftopt.tree.leaves(new_params))


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_bad_running_scalar_raises_and_writes_nothing(backend):
    tx = _make()
    gen = torch.Generator().manual_seed(9)
    params, grads = _tree(gen), _tree(gen)
    state = tx.init(params)
    bad = state[:1] + (_sf(state)._replace(weight_sum=torch.zeros(2, device=DEVICE)),)
    before = [t.clone() for t in ftopt.tree.leaves((params, bad))]
    with pytest.raises(ValueError, match=r"schedule_free: state.weight_sum must be a 0-d "
                                         r"float32 tensor, got a torch.float32 tensor of "
                                         r"shape \(2,\)"):
        ftopt.step(tx, params, grads, bad, backend=backend, donate=True)
    after = ftopt.tree.leaves((params, bad))
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_b1_out_of_range_raises():
    with pytest.raises(ValueError, match="b1"):
        ftopt.schedule_free_sgd(0.1, b1=0.0)
    with pytest.raises(TypeError, match="b1"):
        ftopt.schedule_free(ftopt.sgd(0.1), 0.1, b1=torch.tensor(0.9))


def test_donated_step_makes_no_scalar_fills_and_keeps_b1():
    """The per-step device work besides the kernel is the running scalars' ops: the host
    numbers among the kernel's scalars are filled on the device once and kept while they
    stay the same (no ``full`` per number and step), and b1, which never changes, is not
    copied (the new state holds the old tensor)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    tx = ftopt.schedule_free_sgd(0.1, b1=0.8, weight_decay=0.01)
    gen = torch.Generator().manual_seed(9)
    params, grads = _tree(gen), _tree(gen)
    state = tx.init(params)
    for _ in range(2):
        params, state = ftopt.step(tx, params, grads, state, backend="fused", donate=True)
    b1 = _sf(state).b1
    with Calls() as calls:
        params, state = ftopt.step(tx, params, grads, state, backend="fused", donate=True)
    assert "aten.full.default" not in calls.names and calls.names.count("aten.stack.default") == 1
    assert _sf(state).b1 is b1 and float(b1) == pytest.approx(0.8)
    new_params, new_state = ftopt.step(tx, params, grads, state, backend="eager")
    assert _sf(new_state).b1 is b1 and float(_sf(new_state).weight_sum) > float(
        _sf(state).weight_sum)


def test_explain_counts_the_running_scalars_ops():
    import re

    tx = ftopt.schedule_free_sgd(0.1)
    params = _tree(torch.Generator().manual_seed(10))
    text = ftopt.explain(tx, params, donate=True, backend="fused", file=None)
    found = re.search(r"running scalars: (\d+) torch ops", text)
    assert found and 5 <= int(found.group(1)) <= 16, text
    assert "running scalars" not in ftopt.explain(ftopt.sgd(0.1), params, file=None)
