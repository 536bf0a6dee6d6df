"""``conditionally_transform`` and ``conditionally_mask`` (optax's semantics) against the
inner transform stepped by hand on the chosen calls."""

from __future__ import annotations

import pytest
import torch

import ftopt


def _tree(gen):
    return {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen)}


def _equal(a, b) -> bool:
    la, lb = ftopt.tree.leaves(a), ftopt.tree.leaves(b)
    return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))


CONDITIONS = {
    "tensor": lambda step: step % 3 != 1,  # decided on the device
    "host": lambda step: int(step) % 3 != 1,  # a Python bool
}


@pytest.mark.parametrize("how", sorted(CONDITIONS))
@pytest.mark.parametrize("wrapper", ["conditionally_transform", "conditionally_mask"])
def test_runs_inner_on_the_chosen_calls_only(wrapper, how):
    gen = torch.Generator().manual_seed(1)
    params = _tree(gen)
    inner = ftopt.adam(1e-2)
    tx = getattr(ftopt, wrapper)(inner, CONDITIONS[how])
    state = tx.init(params)
    ref_state = inner.init(params)
    chosen = []
    for i in range(7):
        g = _tree(gen)
        u, state = tx.update(g, state, params)
        if i % 3 != 1:
            want, ref_state = inner.update(g, ref_state, params)
        elif wrapper == "conditionally_transform":
            want = g  # passed through
        else:
            want = ftopt.tree.map(lambda x: torch.full_like(x, -0.0), g)
        chosen.append(i % 3 != 1)
        assert _equal(u, want), i
        assert _equal(state.inner_state, ref_state), i
        assert int(state.step) == i + 1
    assert chosen.count(False) == 2  # (the control: some calls were not chosen)


def test_mask_keeps_params_bit_identical_on_skipped_calls():
    params = {"w": torch.tensor([-0.0, 1.5, -2.0])}
    tx = ftopt.chain(ftopt.conditionally_mask(ftopt.sgd(0.1), lambda step: step > 0))
    state = tx.init(params)
    p1, state = ftopt.step(tx, params, {"w": torch.ones(3)}, state)
    assert torch.equal(p1["w"].view(torch.int32), params["w"].view(torch.int32))
    p2, state = ftopt.step(tx, p1, {"w": torch.ones(3)}, state)
    assert not torch.equal(p2["w"], p1["w"])


def test_a_device_condition_needs_no_host_read(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    params = _tree(gen)
    tx = ftopt.conditionally_mask(ftopt.adam(1e-2), lambda step: step % 2 == 0)
    state = tx.init(params)
    g = _tree(gen)

    def forbid(*_args, **_kwargs):
        raise AssertionError("a branch on a tensor's value")

    # (the inner step may read its own CPU scalars; nothing may branch on the flag)
    for attr in ("__bool__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, attr, forbid)
    u, state = tx.update(g, state, params)
    u2, state2 = tx.update(g, state, params)
    monkeypatch.undo()
    assert not torch.equal(u["w"], torch.zeros_like(u["w"])) and int(state2.step) == 2
    assert torch.equal(u2["w"], torch.full_like(g["w"], -0.0))


def test_forward_extra_args_passes_the_callers_keywords_only():
    seen = []

    def fn(step, **kwargs):
        seen.append(sorted(kwargs))
        return True

    params = {"w": torch.ones(2)}
    for forward, want in ((True, ["loss"]), (False, [])):
        seen.clear()
        tx = ftopt.chain(ftopt.conditionally_transform(ftopt.sgd(0.1), fn, forward),
                         ftopt.skip_zeros())
        tx.update({"w": torch.tensor([0.0, 1.0])}, tx.init(params), params, loss=1.5)
        assert seen == [want]


def test_skip_zeros_through_the_wrapper():
    params = {"w": torch.randn(6, generator=torch.Generator().manual_seed(3))}
    tx = ftopt.chain(ftopt.conditionally_transform(ftopt.adam(1e-2), lambda s: s >= 0),
                     ftopt.skip_zeros())
    state = tx.init(params)
    g = {"w": torch.tensor([0.0, 1.0, -0.0, 2.0, 0.0, -1.0])}
    p, new_state = ftopt.step(tx, params, g, state)
    zero = g["w"] == 0
    assert torch.equal(p["w"][zero], params["w"][zero])
    assert not torch.equal(p["w"][~zero], params["w"][~zero])
    mu_old, mu_new = state[0].inner_state[0].mu["w"], new_state[0].inner_state[0].mu["w"]
    assert torch.equal(mu_new[zero], mu_old[zero]) and not torch.equal(mu_new, mu_old)


def test_errors():
    with pytest.raises(TypeError, match="conditionally_mask: should_transform_fn"):
        ftopt.conditionally_mask(ftopt.sgd(0.1), True)
    with pytest.raises(TypeError, match="conditionally_transform: inner"):
        ftopt.conditionally_transform(lambda: None, lambda s: True)
    tx = ftopt.conditionally_transform(ftopt.sgd(0.1), lambda s: s.float())
    params = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match="bool"):
        tx.update(params, tx.init(params), params)
    other = ftopt.conditionally_mask(ftopt.sgd(0.1), lambda s: True)
    with pytest.raises(ValueError, match="ConditionallyMaskState"):
        other.update(params, tx.init(params), params)
