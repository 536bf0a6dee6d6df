"""optax's ``MultiSteps`` predicates: ``skip_not_finite`` and ``skip_large_updates``."""

from __future__ import annotations

import functools
import math

import pytest
import torch

import ftopt


def _tree(gen, scale=1.0):
    return {"w": scale * torch.randn(4, 3, generator=gen),
            "b": scale * torch.randn(3, generator=gen)}


def test_skip_not_finite_counts_non_finite_elements():
    g = {"w": torch.tensor([[1.0, math.nan], [math.inf, 2.0]]), "b": torch.tensor([-math.inf]),
         "none": None, "ok": torch.ones(3, dtype=torch.bfloat16)}
    skip, info = ftopt.skip_not_finite(g, 0, None)
    assert skip.dtype == torch.bool and skip.shape == () and bool(skip)
    assert int(info["num_not_finite"]) == 3 and bool(info["should_skip"])
    skip, info = ftopt.skip_not_finite({"w": torch.ones(2)}, 0, None)
    assert not bool(skip) and int(info["num_not_finite"]) == 0
    assert not bool(ftopt.skip_not_finite({}, 0, None)[0])


def test_skip_large_updates_bounds_the_squared_norm():
    g = {"w": torch.tensor([3.0, 4.0]), "b": torch.tensor([12.0], dtype=torch.bfloat16)}
    skip, info = ftopt.skip_large_updates(g, 0, None, max_squared_norm=170.0)  # 169 < 170
    assert not bool(skip) and float(info["norm_squared"]) == 169.0
    assert bool(ftopt.skip_large_updates(g, 0, None, max_squared_norm=169.0)[0])  # not <
    assert bool(ftopt.skip_large_updates({"w": torch.tensor([math.nan])}, 0, None, 1e9)[0])
    with pytest.raises(ValueError, match="skip_large_updates: max_squared_norm"):
        ftopt.skip_large_updates(g, 0, None, math.nan)


@pytest.mark.parametrize("which", ["not_finite", "large"])
def test_multisteps_skips_the_bad_calls_and_continues_as_without_them(which):
    fn = (ftopt.skip_not_finite if which == "not_finite" else
          functools.partial(ftopt.skip_large_updates, max_squared_norm=1e4))
    gen = torch.Generator().manual_seed(7)
    params = _tree(gen)
    good = [_tree(gen) for _ in range(6)]
    bad = ({"w": torch.full((4, 3), math.nan), "b": torch.ones(3)} if which == "not_finite"
           else _tree(gen, scale=1e3))
    tx = ftopt.MultiSteps(ftopt.adam(1e-2), 2, should_skip_update_fn=fn).gradient_transformation()
    ref = ftopt.MultiSteps(ftopt.adam(1e-2), 2).gradient_transformation()
    p, s = params, tx.init(params)
    rp, rs = params, ref.init(params)
    for i, g in enumerate(good):
        if i in (1, 4):  # in the middle of a window, and at its start
            before = (p, s)
            p, s = ftopt.step(tx, p, bad, s)
            assert all(torch.equal(a, b) for a, b in zip(ftopt.tree.leaves(before),
                                                         ftopt.tree.leaves((p, s))))
        p, s = ftopt.step(tx, p, g, s)
        rp, rs = ftopt.step(ref, rp, g, rs)
        for k in p:
            assert torch.equal(p[k], rp[k]), (i, k)
    assert not torch.equal(p["w"], params["w"])


def test_a_multisteps_object_is_refused_with_its_method_named():
    multi = ftopt.MultiSteps(ftopt.adam(1e-2), 2)
    params = {"w": torch.ones(2)}
    with pytest.raises(TypeError, match=r"got MultiSteps; pass tx.gradient_transformation\(\)"):
        ftopt.step(multi, params, params, multi.init(params))
