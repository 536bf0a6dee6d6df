"""Donated steps over the same tensors reuse their bound kernel launches.

``PreparedStep.launch`` binds each group's main launch once (``launch.bind_main``) and
then only passes the step's scalars; the bound arguments must stay what ``run_main``
would pass, also when the gradients move to new memory (their address table is
replaced), the count tensors change or a switch picks another kernel variant. On a CPU
the interpreter has no compiled launcher to bind, so these tests stand one in: a
runner that launches the interpreted kernel with the bound arguments.
"""

from __future__ import annotations

import pytest
import torch
from step_checks import fresh_generator

import ftopt
from ftopt.lowering import execute, launch
from ftopt.lowering.plan import plan_chain

# (the bound_calls fixture: tests/conftest.py)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tree(gen, sizes):
    return {f"w{i}": torch.randn(n, generator=gen).to(DEVICE) for i, n in enumerate(sizes)}


@pytest.mark.parametrize("name,bits", [("adamw", 32), ("lion", 32), ("adam", 8)])
def test_bound_launches_equal_fresh_launches(name, bits, bound_calls):
    gen = fresh_generator()
    sizes = [3000, 70, 5000] if bits == 8 else [300, 70, 5]
    tx = getattr(ftopt, name)(1e-2, state_bits=bits, skip_zeros=True)
    params = _tree(gen, sizes)
    state = tx.init(params)
    ref_p = {k: v.clone() for k, v in params.items()}
    ref_s = ftopt.tree.map(lambda t: t.clone(), state)
    grads = _tree(gen, sizes)
    for i in range(5):
        if i == 3:
            grads = _tree(gen, sizes)  # new gradient tensors: a new address table
        else:
            for g in grads.values():
                g.copy_(torch.randn(g.shape, generator=gen))
        grads["w0"][:7] = 0.0
        params, state = ftopt.step(tx, params, grads, state, backend="fused", donate=True)
        ref_p, ref_s = ftopt.step(tx, ref_p, grads, ref_s, backend="fused")
        for k in params:
            assert torch.equal(params[k], ref_p[k]), (i, k)
        for a, b in zip(ftopt.tree.leaves(state), ftopt.tree.leaves(ref_s)):
            assert torch.equal(a, b), i
    # Steps 2, 3 (new grads: the same bound launches, new table), 4 and 5 ran bound.
    assert len(bound_calls) >= 3


def test_a_switch_rebinds(bound_calls, monkeypatch):
    gen = fresh_generator()
    tx = ftopt.adam(1e-2, state_bits=8, skip_zeros=True)
    params = _tree(gen, [5000])
    state = tx.init(params)
    grads = _tree(gen, [5000])
    params, state = ftopt.step(tx, params, grads, state, backend="fused", donate=True)
    prepared = execute.PreparedStep
    seen = []
    real = prepared.launch

    def spy(self, scalars, pairs, *rest):
        real(self, scalars, pairs, *rest)
        seen.append(self._bound[3] if self._bound else None)

    monkeypatch.setattr(prepared, "launch", spy)
    params, state = ftopt.step(tx, params, grads, state, backend="fused", donate=True)
    monkeypatch.setattr(launch, "SKIP_TILES", not launch.SKIP_TILES)
    params, state = ftopt.step(tx, params, grads, state, backend="fused", donate=True)
    assert seen[0] != seen[1] and seen[1] == launch.switches()


def test_no_binding_when_a_step_has_reductions(bound_calls):
    gen = fresh_generator()
    tx = ftopt.chain(ftopt.clip_by_global_norm(1.0), ftopt.adam(1e-2))
    params = _tree(gen, [300, 40])
    state = tx.init(params)
    for _ in range(3):
        grads = _tree(gen, [300, 40])
        params, state = ftopt.step(tx, params, grads, state, backend="fused", donate=True)
    assert bound_calls == []


def _same(a, b) -> bool:
    return a is b or (not isinstance(a, torch.Tensor) and a == b)


def test_bound_launches_hold_addresses_and_keep_their_tensors(bound_calls, monkeypatch):
    """A bound launch passes each tensor argument as its address on a GPU (the launcher
    takes an int as it is; the interpreter reads tensors) and keeps the tensor, so the
    memory stays its; new gradient tensors replace the table's address and tensor."""
    interpreting = launch.tiles.INTERPRETING
    t = torch.zeros(4)
    monkeypatch.setattr(launch.tiles, "INTERPRETING", False)
    assert launch.bound_arg(t) == t.data_ptr() and launch.bound_arg(7) == 7
    assert launch.bound_arg(1.5) == 1.5 and launch.bound_arg(None) is None
    monkeypatch.setattr(launch.tiles, "INTERPRETING", True)
    assert launch.bound_arg(t) is t
    monkeypatch.setattr(launch.tiles, "INTERPRETING", interpreting)
    gen = fresh_generator()
    sizes = [3000, 70, 5000]
    tx = ftopt.adam(1e-2, state_bits=8, skip_zeros=True)
    params = _tree(gen, sizes)
    state = tx.init(params)
    old, kept = None, []
    for i in range(4):
        grads = _tree(gen, sizes)  # (new gradient tensors every step, none freed)
        kept.append(grads)
        params, state = ftopt.step(tx, params, grads, state, backend="fused", donate=True)
        prepared = plan_chain(tx).prepared
        bound = [b for entry in prepared._bound_by.values() for b in entry[2]]
        if i == 0:
            continue
        assert bound
        for b in bound:
            assert len(b.tensors) == len(b.before) + len(b.after)
            assert all([_same(launch.bound_arg(x), y)
                        for x, y in zip(b.tensors, b.before + b.after)])
            assert b.tensors[b.grad_at] is b.group.addresses["g"]
        table = bound[0].tensors[bound[0].grad_at]
        assert table is not old  # (a new table each step, held by the launch)
        old = table
