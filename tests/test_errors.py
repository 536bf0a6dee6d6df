"""Clear errors for bad input.

Every error names the pytree path of the offending leaf (e.g. ``['layer']['w']``) and what
was expected there, and nothing the caller passed is modified, not even through
``step(donate=True)``: the check happens before any write.
"""

from __future__ import annotations

import math

import pytest
import torch
from registry import TRANSFORMS, by_trait, names, standalone, stateful

import ftopt

SEED = 99


def _params(gen=None):
    gen = gen or torch.Generator().manual_seed(SEED)
    return {"layer": {"w": torch.randn(5, 4, generator=gen), "b": torch.randn(4, generator=gen)},
            "out": [torch.randn(3, generator=gen), torch.randn(2, 2, generator=gen)]}


def _like(tree, seed):
    gen = torch.Generator().manual_seed(seed)
    return ftopt.tree.map(lambda x: torch.randn(x.shape, generator=gen), tree)


# Every registry entry as a standalone optimizer, and chains the registry does not build.
TXS = {e.name: (lambda e=e: standalone(e)) for e in TRANSFORMS}
COMPOSITES = {
    "adam_8bit_skip": lambda: ftopt.quantize_states(ftopt.adam(1e-2, skip_zeros=True), bits=8,
                                                    min_size=16),
    "clip_chain": lambda: ftopt.chain(ftopt.clip_by_global_norm(1.0), ftopt.adam(1e-2)),
    "named_chain_adam_lr": lambda: ftopt.named_chain(("adam", ftopt.scale_by_adam()),
                                                     ("lr", ftopt.scale_by_learning_rate(0.1))),
    "masked_adam": lambda: ftopt.masked(ftopt.adam(1e-2), lambda p: ftopt.tree.map(
        lambda x: x.ndim == 2, p)),
}
assert not set(TXS) & set(COMPOSITES)
TXS.update(COMPOSITES)
# Optimizers with per-element state (state trees that can mismatch the params').
STATEFUL = sorted([*names(stateful()), "adam_8bit_skip"])
ALIASES = sorted({e.exported for e in by_trait(kind="alias")})

# Known gaps, keyed by (test, registry name): expected failures (strict, so a fix shows).
KNOWN: dict[tuple[str, str], str] = {}


def _cases(test: str, names: list[str], *rest) -> list:
    """``pytest.param(name, *rest)`` for each name, marked when ``KNOWN`` lists it."""
    return [pytest.param(n, *rest, marks=[pytest.mark.xfail(strict=True, reason=KNOWN[test, n])]
                         if (test, n) in KNOWN else []) for n in names]


pytestmark = pytest.mark.usefixtures("one_thread")


def _bits(x):
    return x.detach().contiguous().reshape(-1).view(torch.uint8)


class Snapshot:
    def __init__(self, *trees):
        self.items = [(x, x.detach().clone(), x._version)
                      for t in trees for x in ftopt.tree.leaves(t) if isinstance(x, torch.Tensor)]

    def check(self):
        for leaf, clone, version in self.items:
            assert leaf._version == version
            assert leaf.dtype == clone.dtype and leaf.shape == clone.shape
            assert torch.equal(_bits(leaf), _bits(clone))


def _raises(exc, fragments, fn, *trees):
    snap = Snapshot(*trees)
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in error message: {msg!r}"
    assert len(msg) < 600, f"error message too long: {msg!r}"
    snap.check()
    return msg


def _all_entry_points(tx, params, grads, state, exc, fragments, step_fragments=None):
    """update, step(donate=False) and step(donate=True) all raise and modify nothing.

    ``step_fragments``: what the message of ``step`` with the default backend must hold,
    where its planner validates the state itself (default: ``fragments``).
    """
    trees = (params, grads, state)
    auto = fragments if step_fragments is None else step_fragments
    _raises(exc, fragments, lambda: tx.update(grads, state, params), *trees)
    _raises(exc, auto, lambda: ftopt.step(tx, params, grads, state), *trees)
    _raises(exc, auto, lambda: ftopt.step(tx, params, grads, state, donate=True), *trees)
    _raises(exc, fragments, lambda: ftopt.step(tx, params, grads, state, donate=True,
                                               backend="eager"), *trees)
    _raises(exc, fragments, lambda: ftopt.step(tx, params, grads, state, backend="eager"),
            *trees)


# ------------------------------------------------------------------ tree mismatches


@pytest.mark.parametrize("name", sorted(TXS))
def test_grads_missing_key(name):
    tx = TXS[name]()
    params = _params()
    state = tx.init(params)
    grads = _like(params, 1)
    del grads["layer"]["w"]
    _all_entry_points(tx, params, grads, state, ValueError, ["['layer']['w']", "missing"])


@pytest.mark.parametrize("name", sorted(TXS))
def test_grads_extra_key(name):
    tx = TXS[name]()
    params = _params()
    state = tx.init(params)
    grads = _like(params, 2)
    grads["layer"]["v"] = torch.randn(3)
    _all_entry_points(tx, params, grads, state, ValueError, ["['layer']['v']", "unexpected"])


@pytest.mark.parametrize("name", sorted(TXS))
def test_grads_list_length(name):
    tx = TXS[name]()
    params = _params()
    state = tx.init(params)
    grads = _like(params, 3)
    grads["out"].append(torch.randn(2))
    _all_entry_points(tx, params, grads, state, ValueError, ["['out']", "length 2", "length 3"])


@pytest.mark.parametrize("name", sorted(TXS))
def test_grads_wrong_container(name):
    tx = TXS[name]()
    params = _params()
    state = tx.init(params)
    grads = _like(params, 4)
    grads["layer"] = [grads["layer"]["b"], grads["layer"]["w"]]
    _all_entry_points(tx, params, grads, state, ValueError, ["['layer']", "dict", "list"])


@pytest.mark.parametrize("name", [*STATEFUL, "named_chain_adam_lr", "clip_chain"])
def test_state_tree_missing_key(name):
    tx = TXS[name]()
    params = _params()
    small = {"layer": {"b": params["layer"]["b"]}, "out": params["out"]}
    state = tx.init(small)  # a state for a different (smaller) model
    grads = _like(params, 5)
    _all_entry_points(tx, params, grads, state, ValueError, ["['layer']['w']", "missing"])


@pytest.mark.parametrize("name", STATEFUL)
def test_state_tree_extra_leaf(name):
    tx = TXS[name]()
    params = _params()
    big = {**params, "out": [*params["out"], torch.randn(6)]}
    state = tx.init(big)
    grads = _like(params, 6)
    _all_entry_points(tx, params, grads, state, ValueError, ["['out']", "length"])


@pytest.mark.parametrize("name", names(by_trait(uses_params=True)))
def test_params_tree_mismatch(name):
    """Params that do not match the grads: the grads/params disagreement is named."""
    tx = TXS[name]()
    params = _params()
    state = tx.init(params)
    grads = _like(params, 7)
    wrong = {"layer": params["layer"], "out": params["out"][:1]}
    msg = _raises(ValueError, ["['out']", "length"], lambda: tx.update(grads, state, wrong),
                  params, grads, state)
    assert "length 1" in msg and "length 2" in msg


def test_apply_updates_mismatch():
    params = _params()
    upd = _like(params, 8)
    del upd["out"]
    _raises(ValueError, ["['out']", "missing"], lambda: ftopt.apply_updates(params, upd),
            params, upd)
    upd = _like(params, 9)
    upd["layer"]["b"] = torch.randn(5)
    _raises(ValueError, ["['layer']['b']", "(5,)", "(4,)"],
            lambda: ftopt.apply_updates(params, upd), params, upd)


# ---------------------------------------------------------------------- shapes


@pytest.mark.parametrize("name", sorted(TXS))
def test_grad_shape_mismatch(name):
    tx = TXS[name]()
    params = _params()
    state = tx.init(params)
    grads = _like(params, 10)
    grads["layer"]["w"] = torch.randn(4, 5)
    _all_entry_points(tx, params, grads, state, ValueError, ["['layer']['w']", "(4, 5)", "(5, 4)"])


# GaLore's state holds a leaf's projector and its projected moments, not the leaf's shape:
# the (4, 5) leaf's moments are (4, 2) where the (5, 4) leaf's projection is (2, 4).
_PROJECTED = ["['layer']['w']", "shape (5, 4) as (2, 4)", "(4, 2)", "init for other shapes"]


@pytest.mark.parametrize("name", _cases("test_state_shape_mismatch", STATEFUL))
def test_state_shape_mismatch(name):
    tx = TXS[name]()
    params = _params()
    other = {"layer": {"w": torch.randn(4, 5), "b": params["layer"]["b"]}, "out": params["out"]}
    state = tx.init(other)  # same tree, one leaf transposed
    grads = _like(params, 11)
    fragments = (_PROJECTED if "galore" in name
                 else ["['layer']['w']", "(4, 5)", "(5, 4)"])
    _all_entry_points(tx, params, grads, state, ValueError, fragments)


# ---------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("name,dtype", [
    *[pytest.param(*p.values, marks=p.marks, id=f"{d}-{p.values[0]}")
      for d, dtype in [("int64", torch.int64), ("int32", torch.int32), ("bool", torch.bool)]
      for p in _cases("test_bad_grad_dtype", sorted(TXS), dtype)],
    *[pytest.param(n, torch.complex64, id=f"complex64-{n}") for n in sorted(TXS)],
])
def test_bad_grad_dtype(name, dtype):
    tx = TXS[name]()
    params = _params()
    state = tx.init(params)
    grads = _like(params, 12)
    grads["out"][1] = torch.ones(2, 2, dtype=dtype)
    _all_entry_points(tx, params, grads, state, TypeError,
                      ["['out'][1]", "floating-point", str(dtype)])


@pytest.mark.parametrize("name", sorted(TXS))
@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64])
def test_bad_param_dtype(name, dtype):
    tx = TXS[name]()
    params = _params()
    state = tx.init(params)
    bad = {**params, "out": [params["out"][0], torch.ones(2, 2, dtype=dtype)]}
    grads = _like(params, 13)
    _all_entry_points(tx, bad, grads, state, TypeError,
                      ["['out'][1]", "floating-point", str(dtype)])


@pytest.mark.parametrize("name", [n for n in STATEFUL if n != "masked"])
def test_init_rejects_non_float_params(name):
    """(``masked``: its mask leaves vectors out, and a leaf out of the mask gets no state,
    so ``init`` need not look at it.)"""
    tx = TXS[name]()
    params = _params()
    bad = {**params, "layer": {**params["layer"], "b": torch.ones(4, dtype=torch.int64)}}
    _raises(TypeError, ["['layer']['b']", "floating-point", "torch.int64"],
            lambda: tx.init(bad), bad)
    bad = {**params, "out": [params["out"][0], [1.0, 2.0]]}
    _raises(TypeError, ["['out'][1][0]", "tensor", "float"], lambda: tx.init(bad), params)


def test_non_tensor_grad_leaf():
    tx = ftopt.adam(1e-2)
    params = _params()
    state = tx.init(params)
    grads = _like(params, 14)
    grads["layer"]["b"] = 1.0
    _all_entry_points(tx, params, grads, state, TypeError, ["['layer']['b']", "tensor", "float"])
    grads["layer"]["b"] = [1.0, 2.0, 3.0, 4.0]
    _all_entry_points(tx, params, grads, state, TypeError, ["['layer']['b']", "tensor", "list"])


def test_apply_updates_dtype_errors():
    params = _params()
    upd = _like(params, 15)
    bad_p = {**params, "layer": {**params["layer"], "w": torch.ones(5, 4, dtype=torch.int32)}}
    _raises(TypeError, ["['layer']['w']", "floating-point", "torch.int32"],
            lambda: ftopt.apply_updates(bad_p, upd), bad_p, upd)
    bad_u = {**upd, "out": [upd["out"][0], torch.ones(2, 2, dtype=torch.complex64)]}
    _raises(TypeError, ["['out'][1]", "floating-point", "torch.complex64"],
            lambda: ftopt.apply_updates(params, bad_u), params, bad_u)


@pytest.mark.parametrize("name", STATEFUL)
def test_integer_state_leaf(name):
    tx = TXS[name]()
    params = _params()
    state = tx.init(params)
    int_params = ftopt.tree.map(lambda x: x.to(torch.int32), params)
    # Build a state whose float slots are integer tensors (e.g. a corrupted checkpoint).
    bad_state = ftopt.tree.map(lambda x: x.to(torch.int32) if x.is_floating_point() else x,
                               state)
    del int_params
    grads = _like(params, 16)
    # 8-bit slots name the dtype their absmax must have.
    fragments = ["absmax", "torch.float32", "torch.int32"] if name == "quantize_states" else [
        "floating-point", "torch.int32"]
    _all_entry_points(tx, params, grads, bad_state, TypeError, fragments)


# --------------------------------------------------------------- hyperparameters


BAD_FLOATS = [math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("value", BAD_FLOATS, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("alias", ALIASES)
def test_non_finite_learning_rate(alias, value):
    with pytest.raises(ValueError) as info:
        getattr(ftopt, alias)(value)
    msg = str(info.value)
    assert "learning_rate" in msg and "finite" in msg and str(value) in msg


@pytest.mark.parametrize("value", BAD_FLOATS, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("make,param", [
    (lambda v: ftopt.adam(1e-3, b1=v), "b1"),
    (lambda v: ftopt.adam(1e-3, b2=v), "b2"),
    (lambda v: ftopt.adam(1e-3, eps=v), "eps"),
    (lambda v: ftopt.adamw(1e-3, weight_decay=v), "weight_decay"),
    (lambda v: ftopt.lion(1e-3, b1=v), "b1"),
    (lambda v: ftopt.sgd(1e-3, momentum=v), "decay"),
    (lambda v: ftopt.rmsprop(1e-3, decay=v), "decay"),
    (lambda v: ftopt.rmsprop(1e-3, initial_scale=v), "initial_scale"),
    (lambda v: ftopt.ademamix(1e-3, b3=v), "b3"),
    (lambda v: ftopt.ademamix(1e-3, alpha=v), "alpha"),
    (lambda v: ftopt.clip_by_global_norm(v), "max_norm"),
    (lambda v: ftopt.scale(v), "step_size"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_non_finite_hyperparameters(make, param, value):
    with pytest.raises(ValueError) as info:
        make(value)
    msg = str(info.value)
    assert param in msg and "finite" in msg


@pytest.mark.parametrize("value", [None, "0.1", True, [0.1], torch.tensor([0.1, 0.2]),
                                   torch.tensor(1 + 1j)],
                         ids=["None", "str", "bool", "list", "1d-tensor", "complex-tensor"])
def test_bad_hyperparameter_types(value):
    with pytest.raises((TypeError, ValueError)) as info:
        ftopt.adam(value)
    assert "learning_rate" in str(info.value)


# ------------------------------------------------------------------- misc


@pytest.mark.parametrize("backend", ["cuda", "triton", "", None, "EAGER"])
def test_unknown_backend(backend):
    tx = ftopt.adam(1e-2)
    params = _params()
    state = tx.init(params)
    grads = _like(params, 17)
    for donate in (False, True):
        _raises(ValueError, ["backend", repr(backend), "'auto'", "'fused'", "'eager'"],
                lambda donate=donate: ftopt.step(tx, params, grads, state, donate=donate,
                                                 backend=backend), params, grads, state)


@pytest.mark.parametrize("name", ["adam", "adamw", "lamb", "sgd[momentum]", "clip_chain"])
def test_chain_state_wrong_length(name):
    tx = TXS[name]()
    params = _params()
    state = tx.init(params)
    grads = _like(params, 18)
    n = len(state)
    for bad in (state[:-1], (*state, state[-1]), list(state), None):
        got = "NoneType" if bad is None else ("list" if isinstance(bad, list) else
                                              f"length {len(bad)}")
        _all_entry_points(tx, params, grads, bad, ValueError,
                          [f"{n} transforms", f"{n} states", got], ["state"])


def test_named_chain_wrong_state():
    tx = TXS["named_chain_adam_lr"]()
    params = _params()
    state = tx.init(params)
    grads = _like(params, 19)
    bad = dict(state)
    bad["other"] = bad.pop("lr")
    _all_entry_points(tx, params, grads, bad, ValueError, ["named_chain", "'adam'", "'lr'",
                                                           "'other'"], ["'lr'"])
    _all_entry_points(tx, params, grads, tuple(state.values()), ValueError, ["named_chain"],
                      ["state"])


@pytest.mark.parametrize("src,dst", [("adam", "sgd[momentum]"), ("sgd[momentum]", "adam"),
                                     ("adamw", "lion"), ("lion", "ademamix")])
def test_state_from_another_optimizer(src, dst):
    """The same chain length but another transform's state: the expected state is named."""
    params = _params()
    state = TXS[src]().init(params)
    tx = TXS[dst]()
    grads = _like(params, 20)
    _all_entry_points(tx, params, grads, state, ValueError,
                      [type(tx.init(params)[0]).__name__, type(state[0]).__name__])


def test_masked_and_partition_wrong_state():
    params = _params()
    grads = _like(params, 21)
    m = TXS["masked_adam"]()
    _all_entry_points(m, params, grads, ftopt.adam(1e-2).init(params), ValueError,
                      ["masked", "MaskedState"])
    labels = {"layer": {"w": "a", "b": "b"}, "out": ["a", "b"]}
    part = ftopt.partition({"a": ftopt.adam(1e-2), "b": ftopt.sgd(0.1, momentum=0.9)}, labels)
    state = part.init(params)
    _all_entry_points(part, params, grads, (), ValueError, ["partition", "PartitionState"])
    bad = ftopt.PartitionState({"a": state.inner_states["a"]})
    _all_entry_points(part, params, grads, bad, ValueError, ["partition", "'b'"])
    with pytest.raises(ValueError, match="labels .*'c'.* have no transform"):
        ftopt.partition({"a": ftopt.sgd(0.1)}, {**labels, "out": ["a", "c"]}).init(params)


@pytest.mark.parametrize("alias", ALIASES)
@pytest.mark.parametrize("bits", [4, 16, 0, 7])
def test_unsupported_state_bits(alias, bits):
    with pytest.raises(ValueError) as info:
        getattr(ftopt, alias)(1e-2, state_bits=bits)
    msg = str(info.value)
    assert str(bits) in msg and "8" in msg and "32" in msg


def test_quantize_states_bad_bits():
    with pytest.raises(ValueError, match="8 or 32"):
        ftopt.quantize_states(ftopt.adam(1e-2), bits=4)


def test_needs_params():
    tx = ftopt.adamw(1e-2, weight_decay=0.1)
    params = _params()
    state = tx.init(params)
    grads = _like(params, 22)
    _raises(ValueError, ["add_decayed_weights", "params"], lambda: tx.update(grads, state),
            grads, state)
    tx = ftopt.lamb(1e-2)
    _raises(ValueError, ["params"], lambda: tx.update(grads, tx.init(params)), grads)


def test_bad_count():
    tx = ftopt.adam(1e-2)
    params = _params()
    state = tx.init(params)
    grads = _like(params, 23)
    for count in (torch.zeros(2, dtype=torch.int32), torch.tensor(0.0), 0):
        bad = (state[0]._replace(count=count), state[1])
        _all_entry_points(tx, params, grads, bad, ValueError,
                          ["scale_by_adam", "count", "0-d integer tensor"])


def test_chain_and_named_chain_construction_errors():
    with pytest.raises(TypeError, match="chain element 1"):
        ftopt.chain(ftopt.adam(1e-2), 3)
    with pytest.raises(ValueError, match="unique"):
        ftopt.named_chain(("a", ftopt.adam(1e-2)), ("a", ftopt.sgd(0.1)))
