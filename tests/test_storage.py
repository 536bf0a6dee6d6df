"""Cached fused steps never act on memory the caller no longer holds, and donated
params must not share memory.

A donated fused step keeps address tables from one call to the next, and a non-donated
one reuses its last call's tables. Replacing a tensor's storage (``p.data = ...``, as
``Module.to``, ``Module.half`` and ``load_state_dict(assign=True)`` do) keeps the tensor
object: the next step must see the new storage, or name what no longer fits.
"""

from __future__ import annotations

import pytest
import torch

import ftopt

BACKENDS = ["eager", "fused"]
# The fused path runs on the GPU where there is one (the interpreter otherwise).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape, gen):
    return torch.randn(*shape, generator=gen).to(DEVICE)


def _tree(gen, shapes):
    return {k: _randn(*s, gen=gen) for k, s in shapes.items()}


SHAPES = {"w": (64, 8), "b": (8,), "e": (40, 16)}


def _twin(tx, gen, donate):
    """(params, state) stepped twice fused, and a clone stepped twice eagerly."""
    params = _tree(gen, SHAPES)
    reference = {k: v.clone() for k, v in params.items()}
    state, ref_state = tx.init(params), tx.init(reference)
    for _ in range(2):
        grads = _tree(gen, SHAPES)
        params, state = ftopt.step(tx, params, grads, state, backend="fused", donate=donate)
        reference, ref_state = ftopt.step(tx, reference, grads, ref_state, backend="eager")
    return params, state, reference, ref_state


def _close(a, b):
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("donate", [True, False])
@pytest.mark.parametrize("bits", [32, 8])
@pytest.mark.usefixtures("tensor_checks")
def test_a_param_whose_storage_was_replaced_is_updated_there(donate, bits):
    gen = torch.Generator().manual_seed(1)
    tx = ftopt.adamw(1e-2, weight_decay=0.1, state_bits=bits)
    if bits == 8:
        tx = ftopt.quantize_states(ftopt.adamw(1e-2, weight_decay=0.1), bits=8, min_size=256)
    params, state, reference, ref_state = _twin(tx, gen, donate)
    old = params["w"]
    old_storage = old.clone()
    new_data = _randn(64, 8, gen=gen)
    params["w"].data = new_data.clone()
    reference["w"] = new_data.clone()
    grads = _tree(gen, SHAPES)
    params, state = ftopt.step(tx, params, grads, state, backend="fused", donate=donate)
    reference, ref_state = ftopt.step(tx, reference, grads, ref_state, backend="eager")
    for k in SHAPES:
        assert _close(params[k], reference[k]), k
    if donate:
        assert params["w"] is old
    assert not torch.equal(params["w"], new_data)  # it moved
    assert not torch.equal(params["w"], old_storage)


@pytest.mark.parametrize("donate", [True, False])
@pytest.mark.usefixtures("tensor_checks")
def test_a_state_whose_storage_was_replaced_is_read_there(donate):
    gen = torch.Generator().manual_seed(2)
    tx = ftopt.adam(1e-2)
    params, state, reference, ref_state = _twin(tx, gen, donate)
    fresh = torch.rand(64, 8, generator=gen).to(DEVICE)
    state[0].nu["w"].data = fresh.clone()
    ref_state[0].nu["w"].copy_(fresh)
    grads = _tree(gen, SHAPES)
    params, state = ftopt.step(tx, params, grads, state, backend="fused", donate=donate)
    reference, ref_state = ftopt.step(tx, reference, grads, ref_state, backend="eager")
    for k in SHAPES:
        assert _close(params[k], reference[k]), k
        assert _close(state[0].nu[k], ref_state[0].nu[k]), k


@pytest.mark.usefixtures("tensor_checks")
def test_a_state_leaf_swapped_in_its_dict_is_used():
    gen = torch.Generator().manual_seed(3)
    tx = ftopt.adam(1e-2)
    params, state, reference, ref_state = _twin(tx, gen, True)
    swapped = state[0].mu["e"].clone() * 0.5
    state[0].mu["e"] = swapped
    ref_state[0].mu["e"].mul_(0.5)
    grads = _tree(gen, SHAPES)
    params, state = ftopt.step(tx, params, grads, state, backend="fused", donate=True)
    reference, ref_state = ftopt.step(tx, reference, grads, ref_state, backend="eager")
    assert state[0].mu["e"] is swapped
    for k in SHAPES:
        assert _close(params[k], reference[k]), k


@pytest.mark.parametrize("donate", [True, False])
@pytest.mark.usefixtures("tensor_checks")
def test_a_gradient_whose_storage_was_replaced_is_read_there(donate):
    gen = torch.Generator().manual_seed(4)
    tx = ftopt.adam(1e-2)
    params, state, reference, ref_state = _twin(tx, gen, donate)
    grads = _tree(gen, SHAPES)
    ftopt.step(tx, {k: v.clone() for k, v in params.items()}, grads,
               tx.init(params), backend="fused", donate=donate)  # cached with these grads
    params, state = ftopt.step(tx, params, grads, state, backend="fused", donate=donate)
    reference, ref_state = ftopt.step(tx, reference, grads, ref_state, backend="eager")
    grads["w"].data = _randn(64, 8, gen=gen)
    params, state = ftopt.step(tx, params, grads, state, backend="fused", donate=donate)
    reference, ref_state = ftopt.step(tx, reference, grads, ref_state, backend="eager")
    for k in SHAPES:
        assert _close(params[k], reference[k]), k


@pytest.mark.parametrize("donate", [True, False])
@pytest.mark.parametrize("bad", [(8, 64), (3,)])
@pytest.mark.usefixtures("tensor_checks")
def test_a_gradient_reshaped_in_place_is_an_error_naming_it(donate, bad):
    gen = torch.Generator().manual_seed(5)
    tx = ftopt.adam(1e-2)
    params, state, _, _ = _twin(tx, gen, donate)
    grads = _tree(gen, SHAPES)
    params, state = ftopt.step(tx, params, grads, state, backend="fused", donate=donate)
    before = {k: v.clone() for k, v in params.items()}
    before_state = [t.clone() for t in ftopt.tree.leaves(state)]
    grads["w"].data = _randn(*bad, gen=gen)
    with pytest.raises(ValueError, match=r"\['w'\]"):
        ftopt.step(tx, params, grads, state, backend="fused", donate=donate)
    for k in SHAPES:
        assert torch.equal(params[k], before[k]), k
    assert all(torch.equal(a, b) for a, b in zip(ftopt.tree.leaves(state), before_state))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_same_tensor_twice_is_refused_when_donated(backend):
    t = torch.randn(16, device=DEVICE)
    params = {"a": t, "b": t}
    grads = {"a": torch.randn(16, device=DEVICE), "b": torch.randn(16, device=DEVICE)}
    tx = ftopt.sgd(0.1)
    state = tx.init(params)
    kept = t.clone()
    with pytest.raises(ValueError, match=r"\['a'\] and \['b'\] share memory"):
        ftopt.step(tx, params, grads, state, backend=backend, donate=True)
    assert torch.equal(t, kept)


@pytest.mark.parametrize("backend", BACKENDS)
def test_overlapping_views_are_refused_when_donated(backend):
    base = torch.randn(40, device=DEVICE)
    params = {"a": base[:24], "b": base[16:]}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    tx = ftopt.adam(1e-2)
    state = tx.init(params)
    kept = base.clone()
    with pytest.raises(ValueError, match="share memory"):
        ftopt.step(tx, params, grads, state, backend=backend, donate=True)
    assert torch.equal(base, kept)
    # Views that do not overlap are fine.
    params = {"a": base[:16], "b": base[16:]}
    state = tx.init(params)
    ftopt.step(tx, params, {k: torch.randn_like(v) for k, v in params.items()}, state,
               backend=backend, donate=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_params_stay_correct_when_not_donated(backend):
    t = torch.randn(16, device=DEVICE)
    params = {"a": t, "b": t}
    grads = {"a": torch.randn(16, device=DEVICE), "b": torch.randn(16, device=DEVICE)}
    tx = ftopt.adam(1e-2)
    new, _ = ftopt.step(tx, params, grads, tx.init(params), backend=backend)
    for k in params:
        alone = {k: t.clone()}
        want, _ = ftopt.step(tx, alone, {k: grads[k]}, tx.init(alone), backend="eager")
        assert _close(new[k], want[k]), k
