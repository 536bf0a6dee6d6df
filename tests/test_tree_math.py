"""``ftopt.tree``'s optax ``optax.tree`` functions (arithmetic, reductions, casting,
random): optax's tree_math / casting / random tests ported, against float64 (and
complex128) numpy hand computations on fresh random trees; None leaves; nested dict /
list / tuple / NamedTuple trees; errors naming the argument and path; reductions as 0-d
tensors on the leaves' device with no host read (meta tensors, which cannot be read);
purity; and the existing ftopt.tree helpers unchanged."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import pytest
import torch

import ftopt

T = ftopt.tree
F64 = torch.float64


class Pair(NamedTuple):
    w: object
    b: object


def _np(x):
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(_np(x)) for x in T.leaves(tree)] or [np.zeros(0)])


def _check(got, expected, **tol):
    assert T.structure(got) == T.structure(expected)
    for x, y in zip(T.leaves(got), T.leaves(expected)):
        np.testing.assert_allclose(_np(x), _np(y), **(tol or {"rtol": 1e-12}))


@pytest.fixture
def data():
    rng = np.random.RandomState(0)
    t = torch.from_numpy
    return {
        "tree_a": (t(rng.randn(20, 10) + 1j * rng.randn(20, 10)), t(rng.randn(20))),
        "tree_b": (t(rng.randn(20, 10)), t(rng.randn(20))),
        "tree_a_dict": (1.0, {"k1": 1.0, "k2": (1.0, 1.0)}, 1.0),
        "tree_b_dict": (1.0, {"k1": 2.0, "k2": (3.0, 4.0)}, 5.0),
        "array_a": t(rng.randn(20) + 1j * rng.randn(20)),
        "array_b": t(rng.randn(20)),
        "nested": {"p": Pair(t(rng.randn(3, 4)), [t(rng.randn(5)), None]),
                   "q": (torch.tensor(rng.randn(), dtype=F64), None)},
        "nested2": {"p": Pair(t(rng.randn(3, 4)), [t(rng.randn(5)), None]),
                    "q": (torch.tensor(rng.randn(), dtype=F64), None)},
    }


@pytest.mark.parametrize("op,ref", [
    (T.add, np.add), (T.sub, np.subtract), (T.mul, np.multiply), (T.div, np.divide)])
@pytest.mark.parametrize("x,y", [("array_a", "array_b"), ("tree_a", "tree_b"),
                                 ("nested", "nested2")])
def test_binary_ops(data, op, ref, x, y):
    a, b = data[x], data[y]
    snapshot = T.map(torch.clone, (a, b))
    got = op(a, b)
    _check(got, T.map(lambda u, v: ref(_np(u), _np(v)), a, b))
    assert T.structure(got) == T.structure(a)  # None leaves stay empty subtrees
    assert all(torch.equal(u, v) for u, v in zip(T.leaves((a, b)), T.leaves(snapshot)))


def test_scale_and_add_scale(data):
    a, b = data["tree_a"], data["tree_b"]
    _check(T.scale(0.5, a), tuple(0.5 * _np(x) for x in a))
    _check(T.add_scale(a, 0.5, b), tuple(_np(x) + 0.5 * _np(y) for x, y in zip(a, b)))
    _check(T.add_scale(data["nested"], -1.5, data["nested2"]),
           T.map(lambda u, v: _np(u) - 1.5 * _np(v), data["nested"], data["nested2"]))
    assert T.add_scale(3, 0.1, 2) == pytest.approx(3.2)  # optax's dtype test
    # A Python scalar neither widens nor narrows the leaves (float32 stays float32).
    x = torch.ones(3)
    assert T.add_scale({"x": x}, 0.1, {"x": x})["x"].dtype == torch.float32


def test_add_many_trees(data):
    tree = T.map(torch.as_tensor, data["tree_a_dict"])
    _check(T.add(tree, tree, tree), T.scale(3.0, tree))
    with pytest.raises(ValueError, match=r"other_trees\[0\] does not match .*tree_x.*"
                                         r"\['k2'\]"):
        T.add(tree, tree, (1.0, {"k1": 1.0, "k3": (1.0, 1.0)}, 1.0))


def test_structure_errors_name_argument_and_path(data):
    with pytest.raises(ValueError, match=r"tree_y does not match the structure of "
                                         r"tree_x: missing \['b'\]"):
        T.sub({"a": torch.ones(2), "b": torch.ones(2)}, {"a": torch.ones(2)})
    with pytest.raises(ValueError, match=r"tree_y .*tree_x.*length 2 at \['p'\]\[1\]"):
        T.mul(data["nested"], {"p": Pair(torch.ones(3, 4), [torch.ones(5), None, 1.0]),
                               "q": (torch.ones(()), None)})
    with pytest.raises(ValueError, match=r"tree_y .*\['q'\]"):
        T.vdot(data["nested"], {"p": data["nested"]["p"], "q": (1.0, 2.0)})
    with pytest.raises(ValueError, match=r"shapes at \['w'\]: \(3,\) and \(4,\)"):
        T.vdot({"w": torch.ones(3)}, {"w": torch.ones(4)})
    with pytest.raises(ValueError, match=r"moments does not match .*updates"):
        T.update_moment({"a": torch.ones(2)}, {"b": torch.ones(2)}, 0.9, 2)
    with pytest.raises(ValueError, match=r"b does not match the structure of a"):
        T.allclose([torch.ones(1)], [torch.ones(1), torch.ones(1)])
    with pytest.raises(ValueError, match=r"other_tree does not match .* of tree"):
        T.cast_like({"a": torch.ones(1)}, {"c": torch.ones(1)})


def test_vdot(data):
    a, b = data["array_a"], data["array_b"]
    np.testing.assert_allclose(_np(T.vdot(a, b)), np.vdot(_np(a), _np(b)), rtol=1e-12)
    assert float(T.vdot(data["tree_a_dict"], data["tree_b_dict"])) == 15.0
    ta, tb = data["tree_a"], data["tree_b"]
    expected = sum(np.vdot(_np(x), _np(y)) for x, y in zip(ta, tb))
    np.testing.assert_allclose(_np(T.vdot(ta, tb)), expected, rtol=1e-12)
    # x is conjugated (jnp.vdot); optax's docstring example (ints: int64 here, int32 in JAX).
    z = torch.tensor([1 + 2j])
    assert T.vdot(z, z).item() == 5
    got = T.vdot({"a": torch.tensor([1, 2]), "b": torch.tensor([1, 2])},
                 {"a": torch.tensor([-1, -1]), "b": torch.tensor([1, 1])})
    assert got.item() == 0 and got.dtype == torch.int64 and got.shape == ()
    # Mixed dtypes promote per pair and across leaves: float32 with float64 -> float64.
    mixed = T.vdot({"a": torch.ones(3), "b": torch.ones(2, dtype=F64)},
                   {"a": torch.ones(3, dtype=F64), "b": torch.ones(2)})
    assert mixed.dtype == F64 and mixed.item() == 5.0


def test_sum(data):
    np.testing.assert_allclose(_np(T.sum(data["array_a"])), _np(data["array_a"]).sum())
    ta = data["tree_a"]
    expected = _np(ta[0]).sum() + _np(ta[1]).sum()
    np.testing.assert_allclose(_np(T.sum(ta)), expected, rtol=1e-12)
    np.testing.assert_allclose(_np(T.sum(ta, associative_reduction=True)), expected,
                               rtol=1e-12)
    many = [torch.tensor(float(i)) for i in range(7)]
    assert T.sum(many, associative_reduction=True).item() == 21.0
    nested = data["nested"]
    np.testing.assert_allclose(_np(T.sum(nested)), _flat(nested).sum(), rtol=1e-12)


KEYS = ["array_a", "tree_a", "tree_a_dict", "tree_b", "tree_b_dict", "nested"]


@pytest.mark.parametrize("key", KEYS)
def test_max_min_size(data, key):
    tree = data[key]
    values = _flat(tree)
    if np.iscomplexobj(values):  # torch orders no complex numbers
        tree = T.real(tree)
        values = values.real
    assert T.max(tree).item() == values.max()
    assert T.min(tree).item() == values.min()
    assert T.size(data[key]) == values.size and isinstance(T.size(tree), int)


def test_min_empty_leaf_skipped():
    assert T.min([torch.ones(2, 3), torch.zeros(4, 0, 5)]).item() == 1.0


@pytest.mark.parametrize("expected", [0, 10000, -10000, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.float32])
@pytest.mark.parametrize("which", [T.min, T.max])
def test_max_min_empty_dtype(expected, dtype, which):
    got = which([expected, torch.zeros(0, dtype=dtype)])
    assert got.item() == expected and got.dtype == torch.float32


def test_max_min_integer_trees_are_float_and_empty_trees_are_inf():
    got = T.max({"a": torch.tensor([3, -7], dtype=torch.int32)})
    assert got.dtype == torch.float32 and got.item() == 3.0  # optax folds from -inf
    assert T.max({}).item() == -math.inf and T.min([None]).item() == math.inf
    assert T.max({"a": torch.tensor([1.0, 2.0], dtype=torch.bfloat16)}).dtype == \
        torch.bfloat16


def test_allclose():
    assert T.allclose(1, 1) and T.allclose(1, 1 + 1e-7) and not T.allclose(1, 2)
    a = {"x": torch.tensor([1.0, math.nan]), "y": [torch.ones(2)]}
    assert not T.allclose(a, a) and T.allclose(a, a, equal_nan=True)
    assert not T.allclose({"x": torch.ones(2)}, {"x": torch.ones(2) + 1e-3})
    assert T.allclose({"x": torch.ones(2)}, {"x": torch.ones(2) + 1e-3}, atol=2e-3)
    assert T.allclose({}, {}).dtype == torch.bool


def test_conj_real(data):
    for key in ("array_a", "tree_a"):
        tree = data[key]
        conj, real = T.conj(tree), T.real(tree)
        _check(conj, T.map(lambda x: np.conj(_np(x)), tree))
        _check(real, T.map(lambda x: np.real(_np(x)), tree))
        assert not any(x.is_conj() for x in T.leaves(conj))
        for x in T.leaves(real):  # copies: writing them leaves the input alone
            x.add_(1.0)
        _check(T.real(tree), T.map(lambda x: np.real(_np(x)), tree))


@pytest.mark.parametrize("key", ["array_a", "tree_a", "array_b", "tree_b_dict", "nested"])
def test_norms(data, key):
    tree, values = data[key], _flat(data[key])
    tol = {"rtol": 1e-6 if key == "tree_b_dict" else 1e-12}  # Python floats: float32
    l2 = np.sqrt(np.sum(np.abs(values) ** 2))
    np.testing.assert_allclose(_np(T.norm(tree)), l2, **tol)
    np.testing.assert_allclose(_np(T.norm(tree, ord=2, squared=True)), l2 ** 2, **tol)
    np.testing.assert_allclose(_np(T.norm(tree, ord=1)), np.abs(values).sum(), **tol)
    np.testing.assert_allclose(_np(T.norm(tree, ord=1, squared=True)),
                               np.abs(values).sum() ** 2, **tol)
    for inf in (math.inf, "inf", "infinity"):
        np.testing.assert_allclose(_np(T.norm(tree, ord=inf)), np.abs(values).max(),
                                   **tol)
    assert T.norm(tree).shape == ()
    with pytest.raises(ValueError, match="unsupported ord 3"):
        T.norm(tree, ord=3)


def test_like_constructors(data):
    tree = data["nested"]
    for got, value in ((T.zeros_like(tree), 0.0), (T.ones_like(tree), 1.0),
                       (T.full_like(tree, 2.5), 2.5), (T.full_like(tree, torch.tensor(-4.0)),
                                                       -4.0)):
        _check(got, T.map(lambda x, v=value: np.full(x.shape, v), tree))
        assert all(x.dtype == F64 for x in T.leaves(got))
    assert all(x.dtype == torch.float16
               for x in T.leaves(T.ones_like(tree, dtype=torch.float16)))
    assert T.full_like([torch.ones(2)], 7, dtype=torch.int32)[0].tolist() == [7, 7]
    assert T.ones_like(data["tree_a_dict"])[1]["k2"][0].item() == 1.0  # number leaves


def test_clip_where_batch_shape(data):
    tree = T.map(torch.as_tensor, data["tree_a_dict"])
    _check(T.clip(tree, min_value=0, max_value=0.5), T.scale(0.5, tree))
    _check(T.clip(tree, max_value=0.5), T.scale(0.5, tree))
    _check(T.clip(tree, min_value=2.0), T.scale(2.0, tree))
    nested = data["nested"]
    _check(T.clip(nested, -0.3, 0.4), T.map(lambda x: np.clip(_np(x), -0.3, 0.4), nested))
    assert T.clip(nested) == nested
    a, b = data["nested"], data["nested2"]
    _check(T.where(True, a, b), a)
    _check(T.where(torch.tensor(False), a, b), b)
    mask = torch.tensor([True, False, True, False, True])
    got = T.where(mask, [a["p"].b[0]], [b["p"].b[0]])[0]
    np.testing.assert_array_equal(_np(got), np.where(_np(mask), _np(a["p"].b[0]),
                                                     _np(b["p"].b[0])))
    batched = T.batch_shape(nested, (2, 3))
    assert batched["p"].w.shape == (2, 3, 3, 4) and batched["q"][0].shape == (2, 3)
    np.testing.assert_array_equal(_np(batched["p"].w[1, 2]), _np(nested["p"].w))


def test_update_moments():
    gen = torch.Generator().manual_seed(3)
    g = {"a": torch.randn(4, generator=gen, dtype=F64), "b": [None, torch.randn(
        2, 3, generator=gen, dtype=F64)]}
    m = {"a": torch.rand(4, generator=gen, dtype=F64), "b": [torch.ones(1), torch.rand(
        2, 3, generator=gen, dtype=F64)]}
    for order in (1, 2, 3):
        got = T.update_moment(g, m, 0.9, order)
        assert got["b"][0] is None
        np.testing.assert_allclose(_np(got["a"]), 0.1 * _np(g["a"]) ** order
                                   + 0.9 * _np(m["a"]), rtol=1e-12)
        per = T.update_moment_per_elem_norm(g, m, 0.9, order)
        np.testing.assert_allclose(_np(per["b"][1]), 0.1 * _np(g["b"][1]) ** order
                                   + 0.9 * _np(m["b"][1]), rtol=1e-12)
    z = torch.randn(5, generator=gen, dtype=torch.complex128)
    t = torch.rand(5, generator=gen, dtype=F64)
    for order in (1, 2, 3):
        np.testing.assert_allclose(
            _np(T.update_moment_per_elem_norm(z, t, 0.8, order)),
            0.2 * np.abs(_np(z)) ** order + 0.8 * _np(t), rtol=1e-12)
    inf = T.update_infinity_moment(g, m, 0.9, 1e-3)
    assert inf["b"][0] is None
    np.testing.assert_allclose(_np(inf["a"]), np.maximum(np.abs(_np(g["a"])) + 1e-3,
                                                         0.9 * _np(m["a"])), rtol=1e-12)


def test_update_infinity_moment_optax_cases():
    values, d = torch.tensor([5.0, 7.0]), 0.9
    fn = T.update_infinity_moment
    torch.testing.assert_close(fn(values, values, decay=d, eps=0.0), values)
    torch.testing.assert_close(fn(torch.zeros(2), values, decay=d, eps=0.0), d * values)
    torch.testing.assert_close(fn(-values, torch.zeros(2), decay=d, eps=0.0), values)
    torch.testing.assert_close(fn(torch.zeros(2), torch.zeros(2), decay=d, eps=1e-2),
                               torch.full((2,), 1e-2))


@pytest.mark.parametrize("op", [
    lambda m: T.add_scale(None, 1, m), lambda m: T.update_moment(None, m, 1, 1),
    lambda m: T.update_infinity_moment(None, m, 1, 1),
    lambda m: T.update_moment_per_elem_norm(None, m, 1, 1)])
def test_none_arguments(op):
    assert op(torch.tensor([1.0, 2.0, 3.0])) is None


def test_bias_correction():
    m = torch.logspace(-10, 10, 21, dtype=torch.bfloat16)
    for decay in (0.9, 0.99, 0.999, 0.9995):
        for count in (1, 10, 100, 1000):
            out = T.bias_correction(m, decay, count)
            assert out.dtype == torch.bfloat16 and torch.isfinite(out).all(), (decay, count)
    gen = torch.Generator().manual_seed(4)
    tree = {"mu": [torch.randn(6, generator=gen, dtype=F64)], "none": None}
    count = torch.tensor(7, dtype=torch.int32)  # an ftopt step count, never read
    got = T.bias_correction(tree, torch.tensor(0.9, dtype=F64), count)
    np.testing.assert_allclose(_np(got["mu"][0]), _np(tree["mu"][0]) / (1 - 0.9 ** 7),
                               rtol=1e-12)
    assert got["none"] is None


@pytest.mark.parametrize("tree", [{}, (), [], None, {"key": [None, [None]]}])
def test_empty_tree_reduce(tree):
    assert T.sum(tree).item() == 0 and T.vdot(tree, tree).item() == 0
    assert T.size(tree) == 0 and T.norm(tree).item() == 0.0 and T.allclose(tree, tree)


def test_reductions_stay_on_device_without_host_reads():
    """Meta tensors have no values: any host read raises, and results stay meta."""
    tree = {"a": torch.empty(3, 2, device="meta"), "b": [torch.empty(
        4, device="meta", dtype=torch.complex64), None]}
    real = {"a": tree["a"], "b": [torch.empty(4, device="meta"), None]}
    for out in (T.sum(tree), T.vdot(tree, tree), T.norm(tree), T.norm(tree, ord=1),
                T.norm(tree, ord=math.inf, squared=True), T.max(real), T.min(real),
                T.allclose(real, real)):
        assert out.device.type == "meta" and out.shape == ()
    count = torch.empty((), dtype=torch.int32, device="meta")
    assert T.bias_correction(tree, 0.9, count)["a"].device.type == "meta"


@pytest.mark.parametrize("dtype,b,c,new_b,new_c", [
    (torch.float32, [1.3, 2.001, 3.6], [-3.3], [1.3, 2.001, 3.6], [-3.3]),
    (torch.float32, [1.3, 2.001, 3.6], [-3], [1.3, 2.001, 3.6], [-3.0]),
    (torch.int32, [1.3, 2.001, 3.6], [-3.3], [1, 2, 3], [-3]),
    (torch.int32, [1.3, 2.001, 3.6], [-3], [1, 2, 3], [-3]),
    (None, [1.123, 2.33], [0.0], [1.123, 2.33], [0.0]),
    (None, [1, 2, 3], [0.0], [1, 2, 3], [0.0]),
])
def test_cast(dtype, b, c, new_b, new_c):
    def build(x, y):
        return {"a": {"b": torch.tensor(x)}, "c": torch.tensor(y)}

    got, want = T.cast(build(b, c), dtype=dtype), T.cast(build(new_b, new_c), dtype)
    for x, y in zip(T.leaves(got), T.leaves(want)):
        assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("dtype,b,c", [
    (torch.float16, [1.3, 2.001, 3.6], [-3]), (torch.bfloat16, [1.3, 2.001, 3.6], [-3.3]),
    (torch.float32, [1.3, 2.001, 3.6], [-3.3]), (torch.int32, [1.3, 2.001, 3.6], [-3])])
def test_cast_like(dtype, b, c):
    tree = {"a": {"b": torch.tensor(b, dtype=F64)}, "c": torch.tensor(c), "s": 1.5}
    target = {"a": {"b": torch.tensor(b).to(dtype)}, "c": torch.tensor(c).to(dtype),
              "s": 2.0}
    got = T.cast_like(tree, target)
    assert got["s"] == 1.5  # a target leaf without dtype leaves the leaf alone
    for x, y in zip(T.leaves([got["a"], got["c"]]), T.leaves([target["a"], target["c"]])):
        assert x.dtype == dtype and torch.equal(x, y)


def test_dtype():
    bf, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    assert T.dtype({"a": {"b": torch.ones((), dtype=f32)}, "c": torch.ones(())}) == f32
    mixed = {"a": {"b": torch.ones((), dtype=bf)}, "c": torch.ones((), dtype=f32)}
    with pytest.raises(ValueError, match=r"expected dtype torch.bfloat16 at \['c'\]"):
        T.dtype(mixed)
    assert T.dtype(mixed, "lowest") == bf and T.dtype(mixed, "highest") == f32
    both16 = {"a": {"b": torch.ones((), dtype=bf)}, "c": torch.ones((), dtype=f16)}
    assert T.dtype(both16, "promote") == f32
    for handler in ("lowest", "highest"):
        with pytest.raises(ValueError, match="neither promotes to the other"):
            T.dtype(both16, handler)
    ints = [torch.ones(1, dtype=torch.uint8), torch.ones(1, dtype=torch.int8)]
    assert T.dtype(ints, "promote") == torch.int16
    with pytest.raises(ValueError, match="invalid mixed_dtype_handler"):
        T.dtype(mixed, "widest")
    for empty in ({}, [], (), None):
        assert T.dtype(empty) == torch.get_default_dtype()


def _rademacher(gen, shape, dtype):
    return (2 * torch.randint(0, 2, shape, generator=gen, device=gen.device) - 1).to(dtype)


def _bits(gen, shape, dtype):
    return torch.randint(0, 2 ** 31 - 1, shape, generator=gen, device=gen.device).to(dtype)


def _variable(kind):
    if kind == "real":
        return torch.tensor([1.0, 2.0])
    if kind == "complex":
        return torch.tensor([1.0 + 2j, 3.0 + 5j])
    return {"k1": torch.tensor(1.0), "k2": (torch.tensor(2.0), torch.tensor(3.0)),
            "k3": torch.tensor([4.0, 5.0]), "none": None}


@pytest.mark.parametrize("sampler,dtype", [
    (None, None), (None, torch.bfloat16), (None, torch.float32),
    (_rademacher, torch.int32), (_bits, torch.int64)])
@pytest.mark.parametrize("kind", ["real", "complex", "tree"])
def test_random_like(sampler, dtype, kind):
    target = _variable(kind)
    kwargs = {} if sampler is None else {"sampler": sampler}
    got = T.random_like(0, target, dtype=dtype, **kwargs)
    assert T.structure(got) == T.structure(target)
    # The flat counterpart: one generator seeded 0, leaves drawn in leaf order.
    gen = torch.Generator().manual_seed(0)
    draw = sampler or (lambda g, s, d: torch.randn(s, generator=g, dtype=d))
    for x, leaf in zip(T.leaves(got), T.leaves(target)):
        want = draw(gen, tuple(leaf.shape), dtype or leaf.dtype)
        assert x.dtype == (dtype or leaf.dtype) and torch.equal(x, want)
    again = T.random_like(0, target, dtype=dtype, **kwargs)
    assert all(torch.equal(x, y) for x, y in zip(T.leaves(got), T.leaves(again)))


def test_random_like_generator_advances_and_seeds_differ():
    target = {"a": torch.zeros(50), "b": [torch.zeros(3, 4)]}
    gen = torch.Generator().manual_seed(5)
    first, second = T.random_like(gen, target), T.random_like(gen, target)
    assert not torch.equal(first["a"], second["a"])
    assert torch.equal(T.random_like(5, target)["a"], first["a"])
    assert not torch.equal(T.random_like(6, target)["a"], first["a"])
    with pytest.raises(TypeError, match="torch.Generator or an int seed"):
        T.random_like(1.5, target)


def test_existing_helpers_unchanged():
    tree = {"b": [torch.ones(2), None], "a": Pair(torch.zeros(1), torch.ones(()))}
    assert T.path_str(("layer", 0)) == "['layer'][0]" and T.path_str(()) == "<root>"
    paths, leaves, spec = T.flatten_with_paths(tree)
    assert paths == ["['a'][0]", "['a'][1]", "['b'][0]"] and spec == T.structure(tree)
    z = T.zeros_like(tree, dtype=torch.float16)
    assert z["b"][1] is None and z["a"].w.dtype == torch.float16
    with pytest.raises(ValueError, match=r"grads does not match the params tree: missing "
                                         r"\['b'\]"):
        T.flatten_like(spec, {"a": Pair(1, 2)}, "grads", paths)
    assert sum([1, 2]) == 3 and max(1, 2) == 2  # builtins are not shadowed here
