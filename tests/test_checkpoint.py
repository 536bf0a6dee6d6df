"""Checkpointing (SPEC §1): a state saved with ``torch.save`` and loaded with
``torch.load(weights_only=True)`` (through a BytesIO) continues the trajectory
bit-identically, for every entry of the test registry (``tests/registry.py``) and chains of
several transforms, 32-bit and 8-bit states, scheduled hyperparameters, ``named_chain``,
``masked`` and ``partition`` states, with and without ``skip_zeros``.
"""

from __future__ import annotations

import collections
import io

import pytest
import torch
from registry import BY_NAME, TRANSFORMS, standalone

import ftopt

SEED = 31337


def _sched():
    return ftopt.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 12, 1e-4)


def _is_matrix(p):
    return ftopt.tree.map(lambda x: x.ndim >= 2, p)


# Per-suite choices for registry entries (keyed by registry name): scheduled learning
# rates and masks, so that counts and masked states go through the checkpoint.
OVERRIDES = {
    "sgd[momentum]": lambda: {"nesterov": True},
    "adamw": lambda: {"learning_rate": _sched(), "weight_decay": 0.1, "mask": "ndim"},
    "lion": lambda: {"learning_rate": _sched()},
    "rmsprop[momentum]": lambda: {"initial_scale": 0.1},
    "adagrad": lambda: {"learning_rate": _sched()},
    "lamb": lambda: {"learning_rate": _sched(), "weight_decay": 0.01},
    "ademamix": lambda: {"learning_rate": _sched(), "b3": ftopt.ademamix_b3_warmup(0.9, 0.999, 8),
                         "alpha": ftopt.ademamix_alpha_warmup(5.0, 8), "weight_decay": 0.01},
}


def _registry_tx(e):
    return lambda sz, sb: standalone(e, skip_zeros=sz, state_bits=sb,
                                     **OVERRIDES.get(e.name, dict)())


# Every registry entry as a standalone optimizer, and chains of several transforms.
TXS = {e.name: _registry_tx(e) for e in TRANSFORMS}
COMPOSITES = {
    "sgd_sched": lambda sz, sb: ftopt.sgd(_sched(), skip_zeros=sz, state_bits=sb),
    "adam_sched": lambda sz, sb: ftopt.adam(_sched(), skip_zeros=sz, state_bits=sb),
    "named_chain_sched": lambda sz, sb: ftopt.quantize_states(ftopt.named_chain(
        ("clip", ftopt.clip_by_global_norm(1.0)), ("adam", ftopt.scale_by_adam()),
        ("decay", ftopt.add_decayed_weights(0.01)), ("lr", ftopt.scale_by_learning_rate(_sched())),
        *([("skip", ftopt.skip_zeros())] if sz else [])), bits=sb),
    "masked_sched": lambda sz, sb: ftopt.quantize_states(ftopt.chain(
        ftopt.masked(ftopt.scale_by_adam(), _is_matrix), ftopt.masked(ftopt.trace(0.9), {
            "big": False, "w": True, "b": True, "s": False}),
        ftopt.scale_by_learning_rate(_sched()), *([ftopt.skip_zeros()] if sz else [])), bits=sb),
    "partition_sched": lambda sz, sb: ftopt.quantize_states(ftopt.partition(
        {"adam": ftopt.adamw(_sched(), skip_zeros=sz),
         "lion": ftopt.lion(1e-3, skip_zeros=sz),
         "frozen": ftopt.set_to_zero()},
        {"big": "adam", "w": "lion", "b": "adam", "s": "frozen"}), bits=sb),
    "bnb_lamb": lambda sz, sb: ftopt.quantize_states(ftopt.chain(
        ftopt.scale_by_adam(), ftopt.clip_by_param_norm_ratio(1.0),
        ftopt.add_decayed_weights(0.01), ftopt.scale_by_learning_rate(1e-2),
        *([ftopt.skip_zeros()] if sz else [])), bits=sb),
}
assert not set(TXS) & set(COMPOSITES)
TXS.update(COMPOSITES)


pytestmark = pytest.mark.usefixtures("one_thread")


STEPS_BEFORE = 2
STEPS_AFTER = 2


def _data(seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = {"big": (64, 80), "w": (7, 5), "b": (33,), "s": ()}
    params = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}

    def grads():
        g = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
        for k in ("big", "w"):
            g[k][torch.rand(g[k].shape, generator=gen) < 0.2] = 0.0
        g["big"][:8] = 0.0  # whole blocks of zeros
        return g

    return params, [grads() for _ in range(STEPS_BEFORE + STEPS_AFTER)]


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _bits(x):
    return x.detach().contiguous().reshape(-1).view(torch.uint8)


def _assert_identical(a, b, what):
    assert ftopt.tree.structure(a) == ftopt.tree.structure(b), what
    la, lb = ftopt.tree.leaves(a), ftopt.tree.leaves(b)
    for i, (x, y) in enumerate(zip(la, lb)):
        assert type(x) is type(y) and x.dtype == y.dtype and x.shape == y.shape, (what, i)
        assert x.device == y.device
        assert torch.equal(_bits(x), _bits(y)), f"{what}: leaf {i} differs"


def _same_types(a, b):
    """The loaded state has the same container classes (NamedTuples, OrderedDict) as saved."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        return
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same_types(a[k], b[k])
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same_types(x, y)




def _has_8bit_case(name: str) -> bool:
    """8-bit states where they exist: composites, aliases (their ``state_bits`` keyword) and
    entries with 8-bit slots; for the others ``quantize_states`` changes nothing."""
    e = BY_NAME.get(name)
    return e is None or e.kind == "alias" or e.quantizable


CASES = [(n, b, s) for n in sorted(TXS) for b in (32, 8) for s in (False, True)
         if b == 32 or _has_8bit_case(n)]


@pytest.mark.parametrize("name,bits,skip", CASES,
                         ids=[f"{n}-{b}bit-{'skip' if s else 'noskip'}" for n, b, s in CASES])
def test_roundtrip_continues_bit_identically(name, bits, skip):
    params, grads_seq = _data(SEED)
    tx = TXS[name](skip, bits)
    state = tx.init(params)
    p = params
    for g in grads_seq[:STEPS_BEFORE]:
        p, state = ftopt.step(tx, p, g, state)

    loaded = _roundtrip({"params": p, "state": state})
    _same_types(loaded["state"], state)
    _assert_identical(loaded["state"], state, "loaded state")
    _assert_identical(loaded["params"], p, "loaded params")
    if bits == 8 and (BY_NAME[name].quantizable if name in BY_NAME else name != "sgd_sched"):
        assert any(x.dtype == torch.uint8 for x in ftopt.tree.leaves(loaded["state"]))

    # A fresh transform object (as after a restart) continues from the loaded state.
    tx2 = TXS[name](skip, bits)
    lp, lstate = loaded["params"], loaded["state"]
    for g in grads_seq[STEPS_BEFORE:]:
        p, state = ftopt.step(tx, p, g, state)
        lp, lstate = ftopt.step(tx2, lp, g, lstate)
        _assert_identical(lp, p, "params after resuming")
        _assert_identical(lstate, state, "state after resuming")
    assert not torch.equal(p["b"], params["b"]) or not BY_NAME[name].moves


@pytest.mark.parametrize("name", ["adam_sched", "lamb", "ademamix", "named_chain_sched",
                                  "partition_sched", "masked_sched"])
@pytest.mark.parametrize("bits", [32, 8])
def test_roundtrip_via_update_and_donated_step(name, bits):
    """Resuming through ``update`` + ``apply_updates`` and through a donated step gives the
    same bits as the uninterrupted run (the count is read from the loaded tensor)."""
    params, grads_seq = _data(SEED + 1)
    tx = TXS[name](True, bits)
    state = tx.init(params)
    p = params
    for g in grads_seq[:STEPS_BEFORE]:
        u, state = tx.update(g, state, p)
        p = ftopt.apply_updates(p, u)
    saved = _roundtrip(state)

    ref_p, ref_state = p, state
    for g in grads_seq[STEPS_BEFORE:]:
        u, ref_state = tx.update(g, ref_state, ref_p)
        ref_p = ftopt.apply_updates(ref_p, u)

    lp, lstate = _roundtrip(p), saved
    for g in grads_seq[STEPS_BEFORE:]:
        u, lstate = tx.update(g, lstate, lp)
        lp = ftopt.apply_updates(lp, u)
    _assert_identical(lp, ref_p, "update path")
    _assert_identical(lstate, ref_state, "update path state")

    dp, dstate = _roundtrip(p), _roundtrip(state)
    ids = [id(x) for x in ftopt.tree.leaves(dstate)]
    for g in grads_seq[STEPS_BEFORE:]:
        dp, dstate = ftopt.step(tx, dp, g, dstate, donate=True, backend="eager")
    assert [id(x) for x in ftopt.tree.leaves(dstate)] == ids
    _assert_identical(dp, ref_p, "donated path")
    _assert_identical(dstate, ref_state, "donated path state")


def test_counts_and_schedules_resume_at_the_saved_step():
    """The learning rate after resuming is the schedule's value at the saved count."""
    sched = ftopt.linear_schedule(1.0, 0.0, 10)
    tx = ftopt.sgd(sched)
    p = {"w": torch.zeros(3)}
    g = {"w": torch.ones(3)}
    state = tx.init(p)
    for _ in range(4):
        p, state = ftopt.step(tx, p, g, state)
    loaded = _roundtrip(state)
    (count_state,) = loaded
    assert count_state.count.dtype == state[0].count.dtype
    assert int(count_state.count) == 4
    u, new = tx.update(g, loaded, p)
    torch.testing.assert_close(u["w"], torch.full((3,), -0.6))  # lr at count 4 is 0.6
    assert int(new[0].count) == 5


def test_loaded_count_modified_in_place_is_honoured():
    """A count the caller rewrote in place (e.g. to rewind) is not taken from a stale mirror."""
    tx = ftopt.adam(1e-2)
    p = {"w": torch.randn(4, generator=torch.Generator().manual_seed(SEED + 2))}
    g = {"w": torch.ones(4)}
    state = tx.init(p)
    fresh_u, _ = tx.update(g, state, p)
    for _ in range(3):
        _, state = ftopt.step(tx, p, g, state)
    loaded = _roundtrip(state)
    loaded[0].count.zero_()
    loaded[0].mu["w"].zero_()
    loaded[0].nu["w"].zero_()
    u, _ = tx.update(g, loaded, p)
    assert torch.equal(u["w"], fresh_u["w"])
    # The same on the in-memory state whose count ftopt created (mirrored on the host).
    state[0].count.zero_()
    state[0].mu["w"].zero_()
    state[0].nu["w"].zero_()
    u, _ = tx.update(g, state, p)
    assert torch.equal(u["w"], fresh_u["w"])


def test_named_chain_state_is_an_ordered_dict_after_loading():
    tx = TXS["named_chain_sched"](False, 32)
    params, _ = _data(SEED + 3)
    state = tx.init(params)
    loaded = _roundtrip(state)
    assert isinstance(loaded, collections.OrderedDict)
    assert list(loaded) == ["clip", "adam", "decay", "lr"]
    assert type(loaded["adam"]).__name__ == "ScaleByAdamState"


def test_state_dict_of_every_state_class_loads_with_weights_only():
    """Each registered state NamedTuple survives weights_only loading (no pickle fallback):
    every registry entry's state, 32- and 8-bit."""
    params = {"w": torch.randn(64, 80), "b": torch.randn(3)}
    txs = [
        ftopt.scale_by_adam(), ftopt.scale_by_ademamix(), ftopt.scale_by_lion(),
        ftopt.scale_by_rms(), ftopt.scale_by_rss(), ftopt.trace(0.9),
        ftopt.scale_by_learning_rate(_sched()), ftopt.masked(ftopt.trace(0.9), _is_matrix),
        ftopt.partition({"a": ftopt.trace(0.9)}, {"w": "a", "b": "a"}), ftopt.identity(),
        ftopt.quantize_states(ftopt.chain(ftopt.scale_by_adam(), ftopt.trace(0.5)), bits=8),
    ]
    txs += [standalone(e, state_bits=bits) for e in TRANSFORMS for bits in (32, 8)]
    for tx in txs:
        state = tx.init(params)
        loaded = _roundtrip(state)
        _same_types(loaded, state)
        _assert_identical(loaded, state, repr(type(state)))
