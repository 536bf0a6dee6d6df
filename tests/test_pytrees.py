"""Pytree handling: params as dicts, nested dict/list/tuple, NamedTuples,
``dict(model.named_parameters())``; ``None`` gradient leaves; empty trees; 0-d and empty
(numel 0) tensors; for every entry of the test registry (``tests/registry.py``) and for
chains of aliases inside ``masked``/``partition``/``named_chain``.

The reference for "the same math" is always ftopt itself on a simpler tree holding the
same leaves (a flat list in optree order, or the tree without the leaf under test), so
these tests check the tree plumbing, not the optimizer math (test_aliases_vs_reference
does that).
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import pytest
import torch
from registry import BY_NAME, TRANSFORMS, standalone

import ftopt
from ftopt.chunked import entry as chunked_entry

SEED = 777


def _rank_label(p):
    return ftopt.tree.map(lambda x: "mat" if x.ndim >= 2 else "vec", p)


def _is_matrix(p):
    return ftopt.tree.map(lambda x: x.ndim >= 2, p)


# Every registry entry as a standalone optimizer (its default hyperparameters), and
# chains of several transforms / options the registry's defaults do not pick.
TXS = {e.name: (lambda e=e: standalone(e)) for e in TRANSFORMS}
COMPOSITES = {
    "adamw_masked_decay": lambda: ftopt.adamw(1e-2, weight_decay=0.1, mask=_is_matrix),
    "adam_skip_zeros": lambda: ftopt.adam(1e-2, skip_zeros=True),
    "lamb_8bit": lambda: ftopt.quantize_states(ftopt.lamb(1e-2), bits=8, min_size=8),
    "clip_global": lambda: ftopt.chain(ftopt.clip_by_global_norm(0.5), ftopt.adam(1e-2)),
    "masked_adam": lambda: ftopt.chain(ftopt.masked(ftopt.scale_by_adam(), _is_matrix),
                                       ftopt.scale_by_learning_rate(0.1)),
    "partition_aliases": lambda: ftopt.partition(
        {"mat": ftopt.lamb(1e-2, weight_decay=0.1), "vec": ftopt.sgd(0.1, momentum=0.9)},
        _rank_label),
    "named_chain_clip": lambda: ftopt.named_chain(
        ("clip", ftopt.clip_by_global_norm(1.0)), ("adam", ftopt.scale_by_adam()),
        ("decay", ftopt.add_decayed_weights(0.1)), ("lr", ftopt.scale_by_learning_rate(0.1))),
}
assert not set(TXS) & set(COMPOSITES)
TXS.update(COMPOSITES)


def _moves(name: str) -> bool:
    """Whether the optimizer changes params at all (not ``set_to_zero``)."""
    return name in COMPOSITES or BY_NAME[name].moves


def _steps(name: str, calls: int) -> int:
    """How far the step counts advance in ``calls`` calls from ``init``."""
    return calls if name in COMPOSITES else BY_NAME[name].steps_after(calls)


def _bookkeeping(name: str) -> bool:
    return name not in COMPOSITES and BY_NAME[name].bookkeeping


def _has_state_at(name: str, missing: str) -> bool:
    """Whether the optimizer keeps per-element state for the leaf at ``missing`` of
    :func:`_none_case` (masks: ``masked`` leaves out vectors such as ``['c'][1]``)."""
    if name in COMPOSITES:
        return not (name == "masked_adam" and missing == "['c'][1]")
    e = BY_NAME[name]
    return e.stateful and not (e.name == "masked" and missing == "['c'][1]")


def _counts(state) -> list:
    """The step counts (``count`` fields) of a state; the other leaves are per-element
    state or, for ``apply_if_finite``, its non-finite bookkeeping."""
    found = []

    def walk(x):
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            for f in x._fields:
                (found.append if f == "count" else walk)(getattr(x, f))
        elif isinstance(x, (tuple, list)):
            for v in x:
                walk(v)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
    walk(state)
    return found


pytestmark = pytest.mark.usefixtures("one_thread")


class Layer(NamedTuple):
    weight: torch.Tensor
    bias: torch.Tensor


class Model(NamedTuple):
    encoder: Layer
    extra: dict


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(gen, *shape):
    return torch.randn(shape, generator=gen)


def _grads_like(params, gen, zero_frac=0.2):
    def one(p):
        g = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        g[torch.rand(p.shape, generator=gen) < zero_frac] = 0.0
        return g

    return ftopt.tree.map(one, params)


def _structures(gen):
    return {
        "dict": {"w": _randn(gen, 5, 4), "b": _randn(gen, 4)},
        "nested": {"layer": {"w": _randn(gen, 5, 4), "b": _randn(gen, 4)},
                   "blocks": [_randn(gen, 3, 3), (_randn(gen, 2), _randn(gen, 2, 2))],
                   "scale": _randn(gen)},
        "list": [_randn(gen, 4, 3), _randn(gen, 3)],
        "tuple": (_randn(gen, 4, 3), (_randn(gen, 3),)),
        "namedtuple": Model(Layer(_randn(gen, 4, 3), _randn(gen, 3)),
                            {"gain": _randn(gen, 3, 2)}),
        "ordered_dict": collections.OrderedDict(z=_randn(gen, 3, 2), a=_randn(gen, 2)),
    }


def _same_structure(a, b):
    assert ftopt.tree.structure(a) == ftopt.tree.structure(b)
    assert type(a) is type(b)


def _run(tx, params, grads_seq, use_step):
    state = tx.init(params)
    p = params
    for g in grads_seq:
        if use_step:
            p, state = ftopt.step(tx, p, g, state)
        else:
            u, state = tx.update(g, state, p)
            _same_structure(u, g)
            p = ftopt.apply_updates(p, u)
    return p, state


@pytest.mark.parametrize("name", sorted(TXS))
@pytest.mark.parametrize("kind", ["dict", "nested", "list", "tuple", "namedtuple",
                                  "ordered_dict"])
def test_tree_kinds_equal_flat_list(name, kind):
    """Any tree gives the same numbers as the flat list of its leaves, structure kept."""
    gen = _gen(SEED)
    params = _structures(gen)[kind]
    grads_seq = [_grads_like(params, gen) for _ in range(3)]
    # The flat twin: masks/labels are functions of the tree, so they apply to both.
    flat_params = ftopt.tree.leaves(params)
    flat_grads = [ftopt.tree.leaves(g) for g in grads_seq]
    for use_step in (False, True):
        tx = TXS[name]()
        p, state = _run(tx, params, grads_seq, use_step)
        _same_structure(p, params)
        fp, fstate = _run(tx, flat_params, flat_grads, use_step)
        for a, b, orig in zip(ftopt.tree.leaves(p), fp, flat_params):
            assert a.dtype == orig.dtype and a.shape == orig.shape
            assert torch.equal(a, b)
        assert len(ftopt.tree.leaves(state)) == len(ftopt.tree.leaves(fstate))
        for a, b in zip(ftopt.tree.leaves(state), ftopt.tree.leaves(fstate)):
            assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(ftopt.tree.leaves(p), flat_params)) \
        or not _moves(name)


@pytest.mark.parametrize("name", ["adam", "lamb", "partition_aliases", "named_chain_clip",
                                  "adamw_masked_decay"])
def test_named_parameters_dict(name):
    """``dict(model.named_parameters())`` with ``.grad`` leaves, as a functional step and as
    a donated in-place step on the module's own parameters."""
    torch.manual_seed(SEED + 1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(16, 4)
    model(x).pow(2).mean().backward()
    params = dict(model.named_parameters())
    grads = {k: v.grad for k, v in params.items()}
    plain = {k: v.detach().clone() for k, v in params.items()}

    tx = TXS[name]()
    ref_p, ref_state = _run(tx, plain, [grads], use_step=False)

    with torch.no_grad():
        state = tx.init(params)
        new_p, new_state = ftopt.step(tx, params, grads, state)
    assert list(new_p) == list(params)
    for k in params:
        assert torch.equal(new_p[k], ref_p[k])
        assert torch.equal(params[k].detach(), plain[k])  # not donated: untouched

    # Donated: the module's parameters are updated in place and returned.
    state = tx.init(params)
    objects = {k: v for k, v in params.items()}
    out_p, _ = ftopt.step(tx, params, grads, state, donate=True, backend="eager")
    for k, v in model.named_parameters():
        assert out_p[k] is objects[k] and isinstance(out_p[k], torch.nn.Parameter)
        assert torch.equal(v.detach(), ref_p[k])
        assert v.requires_grad


def _none_case(gen):
    params = {"a": _randn(gen, 6, 5), "b": _randn(gen, 5), "c": [_randn(gen, 4, 4), _randn(gen, 3)]}
    return params


@pytest.mark.parametrize("name", sorted(TXS))
@pytest.mark.parametrize("missing", ["['a']", "['c'][1]"])
def test_none_gradient_leaf(name, missing):
    """A ``None`` grad: update ``None``/zero, param and that leaf's state untouched, the other
    leaves exactly as if the leaf were not in the tree at all."""
    gen = _gen(SEED + 2)
    params = _none_case(gen)
    grads = _grads_like(params, gen, zero_frac=0.0)
    grads2 = _grads_like(params, gen, zero_frac=0.0)
    if missing == "['a']":
        grads["a"] = grads2["a"] = None
        drop = lambda t: {"b": t["b"], "c": t["c"]}  # noqa: E731
        get = lambda t: t["a"]  # noqa: E731
    else:
        grads["c"][1] = grads2["c"][1] = None
        drop = lambda t: {"a": t["a"], "b": t["b"], "c": [t["c"][0]]}  # noqa: E731
        get = lambda t: t["c"][1]  # noqa: E731

    tx = TXS[name]()
    state0 = tx.init(params)
    # Give the leaf's state non-initial values first (one full step), then step with None.
    full = _grads_like(params, gen, zero_frac=0.0)
    u, state1 = tx.update(full, state0, params)
    p1 = ftopt.apply_updates(params, u)

    u, state2 = tx.update(grads, state1, p1)
    assert get(u) is None or torch.count_nonzero(get(u)) == 0
    p2 = ftopt.apply_updates(p1, u)
    assert torch.equal(get(p2), get(p1))
    assert get(p2).dtype == get(p1).dtype
    u, state3 = tx.update(grads2, state2, p2)
    p3 = ftopt.apply_updates(p2, u)
    assert torch.equal(get(p3), get(p1))

    # The leaf's state is bit-identical (state leaves under its path); counts advance.
    before = _states_at(state1, missing)
    after = _states_at(state3, missing)
    assert len(before) == len(after)
    if _has_state_at(name, missing):
        assert before, "expected per-element state for this leaf"
    for b, a in zip(before, after):
        assert torch.equal(a, b) and a.dtype == b.dtype
    for b, a in zip(_counts(state1), _counts(state3)):
        assert int(a) == int(b) + _steps(name, 3) - _steps(name, 1)

    # The other leaves, from a fresh state: the same as the tree without that leaf.
    fresh_tx = TXS[name]()
    fp, fstate = _run(fresh_tx, params, [grads, grads2], use_step=False)
    assert torch.equal(get(fp), get(params))
    if _positional(name):
        # Draws by tree position (add_noise): the leaf keeps its position with a None
        # gradient, so the others are as with a gradient there (dropping it shifts them).
        filled = [_fill_like(g, full) for g in (grads, grads2)]
        sp, _ = _run(TXS[name](), params, filled, use_step=False)
        sp = drop(sp)
    else:
        sp, _ = _run(TXS[name](), drop(params), [drop(grads), drop(grads2)], use_step=False)
    for a, b in zip(ftopt.tree.leaves(drop(fp)), ftopt.tree.leaves(sp)):
        assert torch.equal(a, b)
    assert not torch.equal(fp["b"], params["b"]) or not _moves(name)

    # ftopt.step agrees with update + apply_updates.
    q, st = ftopt.step(tx, p1, grads, state1)
    q, st = ftopt.step(tx, q, grads2, st)
    for a, b in zip(ftopt.tree.leaves(q), ftopt.tree.leaves(p3)):
        assert torch.equal(a, b)
    for a, b in zip(ftopt.tree.leaves(st), ftopt.tree.leaves(state3)):
        assert torch.equal(a, b)


def _positional(name: str) -> bool:
    return name in BY_NAME and BY_NAME[name].positional


def _fill_like(grads, full):
    """``grads`` with each ``None`` leaf taken from ``full``."""
    spec = ftopt.tree.structure(full)
    return spec.unflatten([f if g is None else g for g, f in zip(
        spec.flatten_up_to(grads), ftopt.tree.leaves(full))])


@pytest.mark.parametrize("name", sorted(TXS))
@pytest.mark.parametrize("use_step", [False, True])
def test_none_param_leaf(name, use_step):
    """A frozen param held as ``None`` (an empty subtree, as optax reads it; its gradient
    ``None`` too): its update and param stay ``None``, and the other leaves step exactly as
    in the tree without it (masks, labels and dimension numbers built from the params
    must give it nothing)."""
    gen = _gen(SEED + 5)
    params = _none_case(gen)
    grads_seq = [_grads_like(params, gen, zero_frac=0.0) for _ in range(2)]
    frozen_params = {"frozen": None, **params}
    frozen_grads = [{"frozen": None, **g} for g in grads_seq]
    fp, _ = _run(TXS[name](), frozen_params, frozen_grads, use_step)
    assert fp["frozen"] is None
    sp, _ = _run(TXS[name](), params, grads_seq, use_step)
    for a, b in zip(ftopt.tree.leaves({k: v for k, v in fp.items() if k != "frozen"}),
                    ftopt.tree.leaves(sp)):
        assert torch.equal(a, b)
    assert not torch.equal(sp["b"], params["b"]) or not _moves(name)


def _states_at(state, path: str) -> list:
    """The state tensors stored under the params path ``path`` (e.g. ``['c'][1]``)."""
    paths, leaves, _ = ftopt.tree.flatten_with_paths(state)
    return [leaf for p, leaf in zip(paths, leaves) if path in p]


@pytest.mark.parametrize("name", sorted(TXS))
def test_all_none_gradients(name):
    gen = _gen(SEED + 3)
    params = _none_case(gen)
    tx = TXS[name]()
    state = tx.init(params)
    grads = {"a": None, "b": None, "c": [None, None]}
    u, new_state = tx.update(grads, state, params)
    for leaf_u in [u["a"], u["b"], *u["c"]]:
        assert leaf_u is None or torch.count_nonzero(leaf_u) == 0
    p = ftopt.apply_updates(params, u)
    q, st = ftopt.step(tx, params, grads, state)
    for a, b, c in zip(ftopt.tree.leaves(p), ftopt.tree.leaves(params), ftopt.tree.leaves(q)):
        assert torch.equal(a, b) and torch.equal(c, b)
    for a, b in zip(_counts(state), _counts(new_state)):
        assert int(b) == int(a) + _steps(name, 1)

    def others(s):  # per-element state (and 0-d bookkeeping, which may move, left out)
        return [x for x in ftopt.tree.leaves(s) if not any(x is c for c in _counts(s))
                and not (_bookkeeping(name) and x.ndim == 0)]

    assert len(others(state)) == len(others(new_state))
    for a, b in zip(others(state), others(new_state)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", sorted(TXS))
@pytest.mark.parametrize("empty", [{}, [], ()], ids=["dict", "list", "tuple"])
def test_empty_tree(name, empty):
    tx = TXS[name]()
    state = tx.init(empty)
    u, new_state = tx.update(empty, state, empty)
    assert u == empty and type(u) is type(empty)
    p = ftopt.apply_updates(empty, u)
    assert p == empty and type(p) is type(empty)
    p, st = ftopt.step(tx, empty, empty, state)
    assert p == empty and type(p) is type(empty)
    # Counts (if any) advance; nothing else exists but 0-d bookkeeping (registry trait).
    assert _bookkeeping(name) or len(ftopt.tree.leaves(state)) == len(_counts(state))
    for a, b, c in zip(_counts(state), _counts(new_state), _counts(st)):
        assert a.ndim == 0 and int(b) == int(a) + _steps(name, 1) and int(c) == int(b)
    p, st = ftopt.step(tx, empty, empty, state, donate=True)
    assert p == empty
    for a, b in zip(_counts(state), _counts(st)):
        assert a is b and int(a) == _steps(name, 1)  # donated counts advance in place


@pytest.mark.parametrize("name", sorted(TXS))
def test_zero_dim_and_empty_leaves(name):
    """0-d leaves behave like 1-element leaves; numel-0 leaves get empty updates and do not
    disturb the others (norms, global norms)."""
    gen = _gen(SEED + 4)
    params = {"s": _randn(gen), "e": torch.zeros(0, 3), "v": _randn(gen, 6), "m": _randn(gen, 3, 4)}
    grads_seq = [_grads_like(params, gen, zero_frac=0.0) for _ in range(3)]
    tx = TXS[name]()
    p, state = _run(tx, params, grads_seq, use_step=False)
    ps, states = _run(TXS[name](), params, grads_seq, use_step=True)
    assert p["s"].shape == () and p["e"].shape == (0, 3)
    for k in params:
        assert p[k].dtype == params[k].dtype and torch.equal(p[k], ps[k])
    assert not torch.equal(p["s"], params["s"]) or not _moves(name)

    # 0-d as a 1-element vector: the same numbers.
    as_vec = {**params, "s": params["s"].reshape(1)}
    vseq = [{**g, "s": g["s"].reshape(1)} for g in grads_seq]
    pv, _ = _run(TXS[name](), as_vec, vseq, use_step=False)
    assert torch.equal(pv["s"].reshape(()), p["s"])

    # Without the empty leaf: identical results for the others (draws by tree position
    # shift when a leaf is dropped: see the None-gradient test for those).
    if _positional(name):
        return
    no_e = {k: v for k, v in params.items() if k != "e"}
    pn, _ = _run(TXS[name](), no_e, [{k: v for k, v in g.items() if k != "e"} for g in grads_seq],
                 use_step=False)
    for k in no_e:
        assert torch.equal(pn[k], p[k]), k


@pytest.mark.parametrize("path", ["whole_leaves", "chunked"])
@pytest.mark.parametrize("name", sorted(e.name for e in TRANSFORMS))
def test_zero_dim_leaves_with_tensor_hyperparameters(name, path, monkeypatch):
    """0-d leaves step as 1-element leaves with the same numbers when the hyperparameters
    are 0-d tensors (whose per-step scalars are float64): on the whole-leaf eager path
    (every accelerator, autograd, ``torch.func``) and on the CPU's chunked one. A 0-d leaf
    must not be computed in float64 where a 1-D one is computed in fp32."""
    if path == "whole_leaves":
        monkeypatch.setattr(chunked_entry, "evaluate", lambda *a, **k: None)
        monkeypatch.setattr(chunked_entry, "step", lambda *a, **k: None)
    e = BY_NAME[name]
    gen = _gen(SEED + 6)
    params = {**{f"s{i}": _randn(gen) for i in range(12)}, "m": _randn(gen, 3, 4)}
    grads_seq = [_grads_like(params, gen, zero_frac=0.0) for _ in range(3)]
    as_vec = {k: v.reshape(1) if v.ndim == 0 else v for k, v in params.items()}
    vseq = [{k: v.reshape(1) if v.ndim == 0 else v for k, v in g.items()} for g in grads_seq]
    with torch.no_grad():
        p, _ = _run(standalone(e, **e.defaults(tensors=True)), params, grads_seq, False)
        pv, _ = _run(standalone(e, **e.defaults(tensors=True)), as_vec, vseq, False)
    for k, v in params.items():
        assert p[k].shape == v.shape and p[k].dtype == v.dtype, k
        assert torch.equal(pv[k].reshape(v.shape), p[k]), (
            f"{k}: {p[k].tolist()} as a 0-d leaf, {pv[k].tolist()} as a 1-element leaf")


def test_empty_leaf_with_8bit_state():
    """8-bit state on a numel-0 leaf and on a 0-d leaf (min_size=0): no crash, no NaN."""
    gen = _gen(SEED + 5)
    params = {"e": torch.zeros(0, 3), "s": _randn(gen), "v": _randn(gen, 300)}
    tx = ftopt.quantize_states(ftopt.adam(1e-2), bits=8, min_size=0)
    grads_seq = [_grads_like(params, gen, zero_frac=0.1) for _ in range(3)]
    p, state = _run(tx, params, grads_seq, use_step=False)
    assert p["e"].shape == (0, 3)
    assert torch.isfinite(p["v"]).all() and torch.isfinite(p["s"])
    assert state[0].mu["v"].codes.dtype == torch.uint8  # 8-bit state really used


def test_mixed_none_and_masked_label_functions_see_params():
    """masked/partition get their mask/labels from the params, so a ``None`` grad does not
    shift which transform a leaf gets."""
    gen = _gen(SEED + 6)
    params = {"a": _randn(gen, 4, 4), "b": _randn(gen, 4), "c": _randn(gen, 2, 2)}
    tx = ftopt.partition({"mat": ftopt.sgd(1.0), "vec": ftopt.sgd(100.0)}, _rank_label)
    state = tx.init(params)
    g = {"a": None, "b": torch.ones(4), "c": torch.ones(2, 2)}
    u, _ = tx.update(g, state, params)
    assert u["a"] is None or torch.count_nonzero(u["a"]) == 0
    assert torch.equal(u["b"], torch.full((4,), -100.0))
    assert torch.equal(u["c"], torch.full((2, 2), -1.0))
