"""Stateful schedules in ``inject_hyperparams`` (optax's ``StatefulSchedule``,
``inject_stateful_hyperparams``, ``WrappedSchedule``): the values each step uses against
the same values set by hand in the plain wrapper, bit for bit; the fused step inside a
chain; checkpoints that continue exactly; the refusals."""

from __future__ import annotations

import io

import pytest
import torch
from step_checks import fresh_generator

import ftopt
from ftopt.combine import update_keywords
from ftopt.lowering import kernel_files

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class HalveOnRise:
    """A stateful schedule reading the loss: ``lr`` halved after each step whose loss
    is above the best so far."""

    update_keywords = ("value",)

    def __init__(self, lr: float):
        self.lr = lr

    def init(self) -> dict:
        return {"best": torch.tensor(float("inf")), "scale": torch.tensor(1.0)}

    def __call__(self, state: dict, **extra) -> torch.Tensor:
        return self.lr * state["scale"]

    def update(self, state: dict, value=None, **extra) -> dict:
        value = torch.as_tensor(value, dtype=torch.float32, device=state["best"].device)
        rise = value > state["best"]
        return {"best": torch.minimum(state["best"], value),
                "scale": torch.where(rise, state["scale"] * 0.5, state["scale"])}


def _tree(gen) -> dict:
    return {"w": torch.randn(6, 5, generator=gen).to(DEVICE),
            "b": torch.randn(7, generator=gen).to(DEVICE)}


def _bits_equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[n].view(torch.int32), b[n].view(torch.int32)) for n in a)


def _fp32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


@pytest.mark.parametrize("call", ["update", "step"])
def test_a_stateful_schedule_follows_the_loss(call):
    """Each step's learning rate is the schedule's value at its state and the step's loss,
    then its state moves on: the same params, bit for bit, as the plain wrapper with those
    values set by hand."""
    gen = fresh_generator()
    lr = 0.05
    tx = ftopt.inject_hyperparams(ftopt.adam)(learning_rate=HalveOnRise(lr), b1=0.8)
    ref = ftopt.inject_hyperparams(ftopt.adam)(learning_rate=lr, b1=0.8)
    params = _tree(gen)
    state, r_params, r_state = tx.init(params), dict(params), ref.init(params)
    assert isinstance(state, ftopt.InjectStatefulHyperparamsState)
    assert float(state.hyperparams["learning_rate"]) == _fp32(lr)
    losses = torch.rand(20, generator=gen).tolist()
    best, scale = float("inf"), 1.0
    for i, loss in enumerate(losses):
        grads = _tree(gen)
        # (a tensor on the device, as the schedule's value; both steps eager, as a step
        # with the loss keyword runs: a fused step may round otherwise on a GPU)
        r_state.hyperparams["learning_rate"] = torch.tensor(_fp32(lr) * scale, device=DEVICE)
        if call == "update":
            u, state = tx.update(grads, state, params, value=loss, backend="eager")
            params = ftopt.apply_updates(params, u)
        else:
            params, state = ftopt.step(tx, params, grads, state, value=loss, backend="eager")
        r_params, r_state = ftopt.step(ref, r_params, grads, r_state, backend="eager")
        assert _bits_equal(params, r_params), i
        assert float(state.hyperparams["learning_rate"]) == _fp32(lr) * scale, i
        loss32 = _fp32(loss)
        scale, best = (scale * 0.5 if loss32 > best else scale), min(best, loss32)
        assert float(state.hyperparams_states["learning_rate"]["best"]) == best
        assert float(state.hyperparams_states["learning_rate"]["scale"]) == scale
    assert scale < 1.0  # (the control: the rate did change)
    assert int(state.count) == len(losses)


@pytest.mark.parametrize("backend", ["eager", "fused"])
@pytest.mark.parametrize("donate", [False, True])
def test_a_wrapped_schedule_is_the_plain_schedule(backend, donate):
    """``WrappedSchedule`` (its own count) in ``inject_stateful_hyperparams`` gives the
    plain wrapper's steps bit for bit; the fused step runs the inner chain's kernel."""
    gen = fresh_generator()
    sched = ftopt.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 30, 1e-4)
    plain = ftopt.inject_hyperparams(ftopt.adam)(learning_rate=sched)
    wrapped = ftopt.inject_stateful_hyperparams(ftopt.adam)(
        learning_rate=ftopt.WrappedSchedule(sched))
    params = _tree(gen)
    p1, s1 = {n: v.clone() for n, v in params.items()}, plain.init(params)
    p2, s2 = {n: v.clone() for n, v in params.items()}, wrapped.init(params)
    assert isinstance(s2, ftopt.InjectStatefulHyperparamsState)
    assert isinstance(s2.hyperparams_states["learning_rate"], ftopt.WrappedScheduleState)
    assert s2.hyperparams_states["learning_rate"].count.device == params["w"].device
    for i in range(12):
        grads = _tree(gen)
        p1, s1 = ftopt.step(plain, p1, grads, s1, backend=backend)
        p2, s2 = ftopt.step(wrapped, p2, grads, s2, backend=backend, donate=donate)
        assert _bits_equal(p1, p2), i
    assert int(s2.hyperparams_states["learning_rate"].count) == 12


def test_a_stateful_wrapper_inside_a_chain_fuses(kernel_launches):
    """After a clip in a chain, the fused step walks into the wrapper (its inner state is
    field 3 of its state): the plain-schedule chain's kernels, its step bit for bit."""
    gen = fresh_generator()
    sched = ftopt.linear_schedule(1e-2, 1e-3, 10)

    def make(lr):
        return ftopt.chain(ftopt.clip_by_global_norm(1.0),
                           ftopt.inject_hyperparams(ftopt.adam)(learning_rate=lr),
                           ftopt.skip_zeros())

    plain, wrapped = make(sched), make(ftopt.WrappedSchedule(sched))
    params = _tree(gen)
    p1, s1 = dict(params), plain.init(params)
    p2, s2 = dict(params), wrapped.init(params)
    p3, s3 = dict(params), wrapped.init(params)
    for i in range(8):
        grads = _tree(gen)
        grads["b"][::2] = 0.0
        l0 = len(kernel_launches)
        p1, s1 = ftopt.step(plain, p1, grads, s1, backend="fused")
        modules, l1 = len(kernel_files._MODULES), len(kernel_launches)
        p2, s2 = ftopt.step(wrapped, p2, grads, s2, backend="fused")
        assert len(kernel_files._MODULES) == modules, "not the plain chain's kernels"
        assert len(kernel_launches) - l1 == l1 - l0 > 0
        p3, s3 = ftopt.step(wrapped, p3, grads, s3, backend="eager")
        assert _bits_equal(p1, p2), i
        assert all(torch.allclose(p2[n], p3[n], rtol=1e-6, atol=1e-7) for n in p2), i
        assert torch.equal(p2["b"][::2], params["b"][::2])  # skip_zeros through it
    assert not torch.equal(p2["b"][1::2], params["b"][1::2])
    assert int(s2[1].hyperparams_states["learning_rate"].count) == 8


@pytest.mark.parametrize("which", ["schedule", "stateful"])
def test_a_checkpoint_continues_bit_for_bit(which):
    """Saved and loaded (``weights_only``) after 4 steps, the state steps on exactly as
    the one never saved: the loaded counts are read once, so the schedules are called
    with the same host numbers."""
    gen = fresh_generator()
    if which == "schedule":
        tx = ftopt.inject_hyperparams(ftopt.adam)(
            learning_rate=ftopt.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 50, 1e-4))
    else:
        tx = ftopt.inject_hyperparams(ftopt.adam)(
            learning_rate=HalveOnRise(1e-2),
            b1=ftopt.WrappedSchedule(ftopt.linear_schedule(0.9, 0.7, 9)))
    params = _tree(gen)
    state = tx.init(params)
    grads = [_tree(gen) for _ in range(9)]
    losses = torch.rand(9, generator=gen).tolist()
    extra = (lambda i: {}) if which == "schedule" else (lambda i: {"value": losses[i]})
    for i in range(4):
        params, state = ftopt.step(tx, params, grads[i], state, **extra(i))
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    resumed = {n: v.clone() for n, v in params.items()}
    for i in range(4, 9):
        params, state = ftopt.step(tx, params, grads[i], state, **extra(i))
        resumed, loaded = ftopt.step(tx, resumed, grads[i], loaded, **extra(i))
        assert _bits_equal(params, resumed), i
        assert torch.equal(state.hyperparams["learning_rate"],
                           loaded.hyperparams["learning_rate"])


def test_the_schedule_s_keywords_are_the_wrapper_s():
    tx = ftopt.inject_hyperparams(ftopt.adam)(learning_rate=HalveOnRise(1e-2))
    assert update_keywords(tx) == {"value"}
    tx.init(_tree(fresh_generator()))
    assert update_keywords(tx) == {"value"}


def _snapshot(state) -> list:
    return [t.clone() for t in ftopt.tree.leaves(state) if isinstance(t, torch.Tensor)]


def test_refusals_name_the_hyperparameter_and_leave_the_state():
    gen = fresh_generator()
    tx = ftopt.inject_hyperparams(ftopt.adam)(learning_rate=HalveOnRise(1e-2))
    params = _tree(gen)
    state = tx.init(params)
    grads = _tree(gen)
    before = _snapshot(state)
    plain_state = ftopt.inject_hyperparams(ftopt.adam)(learning_rate=1e-2).init(params)
    with pytest.raises(ValueError, match="InjectStatefulHyperparamsState"):
        tx.update(grads, plain_state, params, value=1.0)
    broken = state._replace(hyperparams_states={})
    with pytest.raises(ValueError, match="'learning_rate'"):
        tx.update(grads, broken, params, value=1.0)

    class Vector(HalveOnRise):
        def __call__(self, state, **extra):
            return torch.full((3,), self.lr)

    bad = ftopt.inject_hyperparams(ftopt.adam)(learning_rate=Vector(1e-2))
    with pytest.raises(ValueError, match="'learning_rate'.*0-d"):
        bad.init(params)
    with pytest.raises(TypeError, match="must be callable"):
        ftopt.WrappedSchedule(0.1)
    after = _snapshot(state)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    u, new = tx.update(grads, state, params, value=1.0)  # (the control: it does step)
    assert not torch.equal(new.inner_state[0].mu["w"], state.inner_state[0].mu["w"])
