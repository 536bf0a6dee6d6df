"""``ftopt.tree.get`` / ``get_all_with_path`` / ``set`` / ``map_params`` (optax's
``optax.tree`` state utilities): optax's state_utils tests ported onto real ftopt
optimizer states (adam, inject_hyperparams, chains, add_noise), dict-based states,
filtering by NamedTupleKey, purity, and a set learning rate driving the next step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ftopt

T = ftopt.tree
NTK = ftopt.tree.NamedTupleKey


@dataclasses.dataclass
class FakeShardSpec:
    sharding_axis: int | None


def _params():
    return {"my/fake/module": {"w": torch.zeros(1, 2), "b": torch.zeros(3, 4)},
            "my/other/fake/module": {"w": torch.zeros(1, 2), "b": torch.zeros(3, 4)}}


def _specs():
    return {"my/fake/module": {"w": FakeShardSpec(0), "b": FakeShardSpec(1)},
            "my/other/fake/module": {"w": FakeShardSpec(2), "b": FakeShardSpec(3)}}


def _scale_by_adam_with_dicts() -> ftopt.GradientTransformation:
    inner = ftopt.scale_by_adam()

    def init(params):
        s = inner.init(params)
        return {"count": s.count, "params": {"mu": s.mu, "nu": s.nu}}

    def update(updates, state, params=None):
        s = ftopt.ScaleByAdamState(state["count"], state["params"]["mu"],
                                   state["params"]["nu"])
        updates, s = inner.update(updates, s, params)
        return updates, {"count": s.count, "params": {"mu": s.mu, "nu": s.nu}}

    return ftopt.GradientTransformation(init, update)


def test_map_params_adam():
    opt = ftopt.adam(1e-4)
    state = opt.init(_params())
    got = T.map_params(opt, lambda _, spec: spec, state, _specs(),
                       transform_non_params=lambda _: FakeShardSpec(None))
    assert got == (ftopt.ScaleByAdamState(count=FakeShardSpec(None), mu=_specs(),
                                          nu=_specs()), ftopt.EmptyState())


def test_map_params_dict_based_state():
    opt = ftopt.chain(_scale_by_adam_with_dicts(), ftopt.scale(1e-3))
    state = opt.init(_params())
    got = T.map_params(opt, lambda _, spec: spec, state, _specs(),
                       transform_non_params=lambda _: FakeShardSpec(None))
    assert got == ({"count": FakeShardSpec(None),
                    "params": {"mu": _specs(), "nu": _specs()}}, ftopt.EmptyState())


def test_map_params_inject_hyperparams_and_init_function():
    opt = ftopt.inject_hyperparams(ftopt.adamw)(learning_rate=1e-3)
    params = _params()
    state = opt.init(params)
    before = T.map(torch.clone, state)
    new = T.map_params(opt.init, lambda v: v + 1, state)  # an init function works too
    assert torch.equal(new.hyperparams["learning_rate"], torch.tensor(1e-3))
    mu = T.get(new, "mu")
    assert all(torch.equal(x, torch.ones_like(x)) for x in T.leaves(mu))
    assert all(torch.equal(x, y) for x, y in zip(T.leaves(state), T.leaves(before)))


def test_map_params_to_none_and_non_params_to_none():
    params = {"a": torch.zeros(1, 2)}
    opt = ftopt.adagrad(1e-4)
    got = T.map_params(opt, lambda _: None, opt.init(params))
    assert got == (ftopt.ScaleByRssState(sum_of_squares={"a": None}), ftopt.EmptyState())
    opt = ftopt.adam(ftopt.linear_schedule(1e-2, 1e-4, 10))
    got = T.map_params(opt, lambda _: 1, opt.init(params),
                       transform_non_params=lambda _: None)
    assert got == (ftopt.ScaleByAdamState(count=None, mu={"a": 1}, nu={"a": 1}),
                   ftopt.ScaleByScheduleState(count=None))


def test_get_all_with_path():
    params = torch.tensor([1.0, 2.0, 3.0])
    assert T.get_all_with_path((), "foo") == [] and T.get_all_with_path(params, "foo") == []
    found = T.get_all_with_path(ftopt.scale_by_adam().init(params), "count")
    assert len(found) == 1 and found[0][0] == (NTK("ScaleByAdamState", "count"),)
    assert found[0][1].dtype == torch.int32 and found[0][1].item() == 0
    assert T.get_all_with_path(ftopt.adam(1.0).init(params), "apple") == []
    opt = ftopt.chain(ftopt.inject_hyperparams(ftopt.sgd)(learning_rate=1.0),
                      ftopt.chain(ftopt.adam(1.0),
                                  ftopt.inject_hyperparams(ftopt.adam)(learning_rate=1e-4)))
    found = T.get_all_with_path(opt.init(params), "learning_rate")
    hp = NTK("InjectHyperparamsState", "hyperparams")
    assert [p for p, _ in found] == [(0, hp, "learning_rate"),
                                     (1, 1, hp, "learning_rate")]
    assert [v.item() for _, v in found] == [1.0, pytest.approx(1e-4)]
    state = {"hparams": {"learning_rate": 1.0}, "learning_rate": "foo"}
    assert len(T.get_all_with_path(state, "learning_rate")) == 2
    assert T.get_all_with_path(state, "learning_rate",
                               filtering=lambda _, v: isinstance(v, float)) == [
        (("hparams", "learning_rate"), 1.0)]
    assert T.get_all_with_path({"a": {"a": 1.0}}, "a") == [
        (("a",), {"a": 1.0}), (("a", "a"), 1.0)]
    # A NamedTuple by its class name, found inside a list.
    noise = ftopt.chain(ftopt.add_noise(1.0, 0.9, 0), ftopt.scale_by_adam()).init(params)
    found = T.get_all_with_path([noise], "AddNoiseState")
    assert found == [((0, 0), noise[0])]


def test_get():
    params = torch.tensor([1.0, 2.0, 3.0])
    state = ftopt.inject_hyperparams(ftopt.sgd)(learning_rate=42.0).init(params)
    assert T.get(state, "learning_rate").item() == 42.0
    assert T.get(state, "ema") is None and T.get(state, "ema", default=7.0) == 7.0
    two = ftopt.chain(ftopt.inject_hyperparams(ftopt.sgd)(learning_rate=42.0),
                      ftopt.inject_hyperparams(ftopt.sgd)(learning_rate=42.0))
    with pytest.raises(KeyError, match=r"found 2 values for 'learning_rate'"):
        T.get(two.init(params), "learning_rate")
    d = {"hparams": {"learning_rate": 1.0}, "learning_rate": "foo"}
    with pytest.raises(KeyError):
        T.get(d, "learning_rate")
    assert T.get(d, "learning_rate", filtering=lambda _, v: isinstance(v, float)) == 1.0
    noisy = ftopt.chain(ftopt.add_noise(1.0, 0.9, 0), ftopt.scale_by_adam())
    state = noisy.init(params)

    def in_adam(path, _):
        return isinstance(path[-1], NTK) and path[-1].tuple_name == "ScaleByAdamState"

    assert T.get(state, "count", filtering=in_adam) is state[1].count
    assert T.get(state, "AddNoiseState") is state[0]


def test_get_moments_of_a_real_adam_state():
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 2, generator=gen, dtype=torch.float64),
              "b": torch.randn(4, generator=gen, dtype=torch.float64)}
    grads = T.map(lambda p: torch.randn(p.shape, generator=gen, dtype=p.dtype), params)
    opt = ftopt.adam(1e-3, b1=0.8, b2=0.95)
    _, state = ftopt.step(opt, params, grads, opt.init(params))
    mu, nu = T.get(state, "mu"), T.get(state, "nu")
    for k in params:  # one step from zero moments: (1 - b) g and (1 - b) g²
        torch.testing.assert_close(mu[k], 0.2 * grads[k], rtol=1e-12, atol=0)
        torch.testing.assert_close(nu[k], 0.05 * grads[k] ** 2, rtol=1e-12, atol=0)
    assert T.get(state, "count").item() == 1


def test_set_learning_rate_of_inject_hyperparams_drives_the_next_step():
    params = {"w": torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)}
    grads = {"w": torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)}
    opt = ftopt.inject_hyperparams(ftopt.sgd)(learning_rate=1.0)
    state = opt.init(params)
    before = T.map(torch.clone, state)
    new_state = T.set(state, learning_rate=torch.tensor(0.25))
    assert T.get(new_state, "learning_rate").item() == 0.25
    assert all(torch.equal(x, y) for x, y in zip(T.leaves(state), T.leaves(before)))
    assert T.get(state, "learning_rate").item() == 1.0  # not modified in place
    updates, _ = opt.update(grads, new_state, params)
    torch.testing.assert_close(updates["w"], -0.25 * grads["w"], rtol=0, atol=0)
    updates, _ = opt.update(grads, state, params)  # the control: the old rate
    torch.testing.assert_close(updates["w"], -1.0 * grads["w"], rtol=0, atol=0)


def test_set():
    params = torch.tensor([1.0, 2.0, 3.0])
    with pytest.raises(KeyError):
        T.set((), foo=1.0)
    with pytest.raises(KeyError, match="found no value for 'foo'"):
        T.set(params, foo=1.0)
    opt = ftopt.inject_hyperparams(ftopt.adam)(learning_rate=1.0, b1=0.9)
    state = opt.init(params)
    new = T.set(state, learning_rate=2.0, b1=3.0)
    assert T.get(new, "learning_rate") == 2.0 and T.get(new, "b1") == 3.0
    with pytest.raises(KeyError, match="'ema'"):
        T.set(state, ema=2.0)
    two = ftopt.chain(ftopt.adam(1.0), ftopt.adam(1.0)).init(params)
    found = T.get_all_with_path(T.set(two, count=2.0), "count")
    assert len(found) == 2 and all(v == 2.0 for _, v in found)
    d = {"hparams": {"learning_rate": 1.0}, "learning_rate": "foo"}
    new = T.set(d, lambda _, v: isinstance(v, float), learning_rate=0.5)
    assert T.get_all_with_path(new, "learning_rate") == [
        (("learning_rate",), "foo"), (("hparams", "learning_rate"), 0.5)]
    with pytest.raises(KeyError, match="given the filtering function"):
        T.set(d, lambda _, v: isinstance(v, int), learning_rate=0.5)
    tree = {"a": {"a": 1.0}, "b": {"a": 1}}
    assert T.set(tree, lambda _, v: isinstance(v, float), a=2.0) == {
        "a": {"a": 2.0}, "b": {"a": 1}}
    assert T.set(tree, lambda _, v: isinstance(v, dict), a={"c": 0.0}) == {
        "a": {"c": 0.0}, "b": {"a": 1}}
    assert tree == {"a": {"a": 1.0}, "b": {"a": 1}}


def test_set_a_specific_state_and_a_whole_state():
    params = torch.tensor([1.0, 2.0, 3.0])
    state = ftopt.chain(ftopt.add_noise(1.0, 0.9, 0), ftopt.scale_by_adam()).init(params)

    def in_adam(path, _):
        return isinstance(path[-1], NTK) and path[-1].tuple_name == "ScaleByAdamState"

    new = T.set(state, in_adam, count=torch.tensor(42, dtype=torch.int32))
    assert new[0].count is state[0].count and new[1].mu is state[1].mu
    assert new[1].count.item() == 42
    assert state[1].count.item() == 0
    noise = type(state[0])(count=torch.tensor(7, dtype=torch.int32))
    new = T.set(state, AddNoiseState=noise)
    assert new[0] is noise and new[1] == state[1] and new[1].mu is state[1].mu
