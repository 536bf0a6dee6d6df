"""``lookahead`` against a float64 formula written here (optax's semantics) over 24 steps,
``ftopt.step`` on the (fast, slow) pair, ``reset_state``, ``None`` gradients and errors.

(lookahead's params are a ``LookaheadParams`` pair, not the gradients' tree, so the
registry suites cannot drive it: ``tests/registry.py::PARAMS_WRAPPERS`` sends it here.)
"""

from __future__ import annotations

import pytest
import torch

import ftopt

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tree(gen):
    return {"w": torch.randn(4, 3, generator=gen).to(DEVICE),
            "b": torch.randn(5, generator=gen).to(DEVICE)}


@pytest.mark.parametrize("use_step", [False, True])
@pytest.mark.parametrize("reset_state", [False, True])
def test_lookahead_matches_float64_formula(reset_state, use_step):
    gen = torch.Generator().manual_seed(5)
    k, alpha, lr, decay = 3, 0.4, 0.1, 0.5
    tx = ftopt.lookahead(ftopt.sgd(lr, momentum=decay), k, alpha, reset_state=reset_state)
    pair = ftopt.LookaheadParams.init_synced(_tree(gen))
    state = tx.init(pair)
    fast = {n: v.double() for n, v in pair.fast.items()}
    slow = {n: v.double() for n, v in pair.slow.items()}
    trace = {n: torch.zeros_like(v) for n, v in fast.items()}
    for i in range(24):
        grads = _tree(gen)
        if use_step:
            pair, state = ftopt.step(tx, pair, grads, state)
        else:
            u, state = tx.update(grads, state, pair)
            pair = ftopt.apply_updates(pair, u)
        slow_before = {n: v.clone() for n, v in pair.slow.items()}
        for n in fast:  # sgd with momentum on the fast weights
            trace[n] = grads[n].double() + decay * trace[n]
            fast[n] = fast[n] - lr * trace[n]
        if (i + 1) % k == 0:
            for n in fast:
                slow[n] = slow[n] + alpha * (fast[n] - slow[n])
                fast[n] = slow[n].clone()
            if reset_state:
                trace = {n: torch.zeros_like(v) for n, v in fast.items()}
        for n in fast:
            assert torch.allclose(pair.fast[n].double(), fast[n], rtol=1e-5, atol=1e-5), (i, n)
            assert torch.allclose(pair.slow[n].double(), slow[n], rtol=1e-5, atol=1e-5), (i, n)
        if (i + 1) % k:
            assert all(torch.equal(pair.slow[n], slow_before[n]) for n in slow)
    assert int(state.steps_since_sync) == 24 % k


def test_none_gradient_moves_neither_weight():
    gen = torch.Generator().manual_seed(6)
    tx = ftopt.lookahead(ftopt.adam(1e-2), 1, 0.5)
    pair = ftopt.LookaheadParams(_tree(gen), _tree(gen))
    state = tx.init(pair)
    grads = {"w": torch.randn(4, 3, generator=gen).to(DEVICE), "b": None}
    u, state = tx.update(grads, state, pair)
    new = ftopt.apply_updates(pair, u)
    assert torch.equal(new.fast["b"], pair.fast["b"]) and torch.equal(new.slow["b"],
                                                                        pair.slow["b"])
    assert not torch.equal(new.slow["w"], pair.slow["w"])
    # sync_period 1: the fast weights land on the new slow ones.
    assert torch.allclose(new.fast["w"], new.slow["w"], atol=1e-6)


def test_errors_name_what_is_wrong():
    gen = torch.Generator().manual_seed(7)
    tx = ftopt.lookahead(ftopt.sgd(0.1), 2, 0.5)
    params = _tree(gen)
    with pytest.raises(ValueError, match="LookaheadParams"):
        tx.init(params)
    pair = ftopt.LookaheadParams.init_synced(params)
    state = tx.init(pair)
    bad = ftopt.LookaheadParams(params, {"w": params["w"]})
    with pytest.raises(ValueError, match=r"params.slow.*\['b'\]"):
        tx.update(_tree(gen), state, bad)
    grads = _tree(gen)
    grads["w"] = torch.randn(3, 4).to(DEVICE)
    with pytest.raises(ValueError, match=r"\['w'\].*\(3, 4\)"):
        tx.update(grads, state, pair)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(_tree(gen), state)
    with pytest.raises(ValueError, match="sync_period"):
        ftopt.lookahead(ftopt.sgd(0.1), 0, 0.5)
    with pytest.raises(ValueError, match="slow_step_size"):
        ftopt.lookahead(ftopt.sgd(0.1), 2, 1.5)


def test_state_round_trips_through_torch_save(tmp_path):
    gen = torch.Generator().manual_seed(8)
    tx = ftopt.lookahead(ftopt.adam(1e-2), 2, 0.5)
    pair = ftopt.LookaheadParams.init_synced(_tree(gen))
    state = tx.init(pair)
    _, state = tx.update(_tree(gen), state, pair)
    torch.save((pair, state), tmp_path / "s.pt")
    pair2, state2 = torch.load(tmp_path / "s.pt", weights_only=True)
    assert isinstance(pair2, ftopt.LookaheadParams) and int(state2.steps_since_sync) == 1
