"""optax's tree utilities (``incremental_update``, ``periodic_update``, ``global_norm``)
against float64 math written from optax's formulas, on fresh random trees: dtypes kept,
inputs untouched, bad input refused naming the path."""

from __future__ import annotations

import pytest
import torch

import ftopt

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tree(gen, dtype=torch.float32):
    return {"w": torch.randn(7, 5, generator=gen).to(DEVICE, dtype),
            "b": [torch.randn(5, generator=gen).to(DEVICE, dtype),
                  torch.randn((), generator=gen).to(DEVICE, dtype)]}


def _leaves(t):
    return ftopt.tree.leaves(t)


def _copy(t):
    return ftopt.tree.map(lambda x: x.clone(), t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("tensor_step", [False, True])
def test_incremental_update_is_polyak_averaging(dtype, tensor_step):
    gen = torch.Generator().manual_seed(1)
    new, old = _tree(gen, dtype), _tree(gen, dtype)
    new0, old0 = _copy(new), _copy(old)
    tau = 0.0137
    step = torch.tensor(tau, device=DEVICE) if tensor_step else tau
    out = ftopt.incremental_update(new, old, step)
    for o, a, b in zip(_leaves(out), _leaves(new), _leaves(old)):
        assert o.dtype == dtype and o.shape == a.shape
        want = tau * a.double() + (1 - tau) * b.double()
        # one rounding to the leaf's dtype (fp32 math below fp64)
        tol = max(torch.finfo(dtype).eps, 2 * torch.finfo(torch.float32).eps)
        assert ((o.double() - want).abs() <= tol * want.abs() + 1e-30).all()
        assert not torch.equal(o, b)  # the target moved
    for a, b in zip(_leaves(new) + _leaves(old), _leaves(new0) + _leaves(old0)):
        assert torch.equal(a, b)  # inputs untouched
    same = ftopt.incremental_update(new, old, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(_leaves(same), _leaves(new)))
    kept = ftopt.incremental_update(new, old, 0.0)
    assert all(torch.equal(a, b) for a, b in zip(_leaves(kept), _leaves(old)))


def test_incremental_update_keeps_the_targets_dtype_and_copies_integer_buffers():
    gen = torch.Generator().manual_seed(2)
    online = {"w": torch.randn(16, generator=gen), "n": torch.tensor(41)}
    target = {"w": torch.randn(16, generator=gen).bfloat16(), "n": torch.tensor(3)}
    out = ftopt.incremental_update(online, target, 0.25)
    assert out["w"].dtype == torch.bfloat16
    want = (0.25 * online["w"].double() + 0.75 * target["w"].double())
    assert ((out["w"].double() - want).abs() <= 2 ** -8 * want.abs()).all()
    assert out["n"].item() == 41 and out["n"] is not online["n"]


@pytest.mark.parametrize("tensor_steps", [False, True])
def test_periodic_update_refreshes_every_period(tensor_steps):
    gen = torch.Generator().manual_seed(3)
    new, old = _tree(gen), _tree(gen)
    for steps in range(0, 9):
        s = torch.tensor(steps, device=DEVICE) if tensor_steps else steps
        out = ftopt.periodic_update(new, old, s, 3)
        want = new if steps % 3 == 0 else old
        for a, b in zip(_leaves(out), _leaves(want)):
            assert torch.equal(a, b)
        if not tensor_steps:
            assert out is want  # the host's choice: the tree itself


def test_global_norm_is_the_norm_of_every_element():
    gen = torch.Generator().manual_seed(4)
    t = _tree(gen)
    t["h"] = torch.randn(33, generator=gen).to(DEVICE, torch.bfloat16)
    want = torch.cat([x.double().reshape(-1) for x in _leaves(t)]).norm()
    got = ftopt.global_norm(t)
    assert got.ndim == 0 and got.dtype == torch.float32
    assert abs(got.double() - want) <= 4e-7 * want
    assert ftopt.global_norm({}).item() == 0.0
    assert ftopt.global_norm({"a": None}).item() == 0.0


def test_bad_input_names_the_path_and_changes_nothing():
    gen = torch.Generator().manual_seed(5)
    new, old = _tree(gen), _tree(gen)
    old0 = _copy(old)
    bad_shape = {"w": old["w"], "b": [old["b"][0][:4], old["b"][1]]}
    with pytest.raises(ValueError, match=r"\['b'\]\[0\].*shape \(5,\).*\(4,\)"):
        ftopt.incremental_update(new, bad_shape, 0.5)
    with pytest.raises(ValueError, match="old_tensors"):
        ftopt.incremental_update(new, {"w": old["w"]}, 0.5)
    with pytest.raises(ValueError, match="step_size"):
        ftopt.incremental_update(new, old, float("nan"))
    with pytest.raises(ValueError, match="step_size"):
        ftopt.incremental_update(new, old, torch.ones(2))
    with pytest.raises(TypeError, match=r"\['w'\].*same dtype"):
        ftopt.periodic_update(new, {**old, "w": old["w"].double()}, 3, 3)
    with pytest.raises(ValueError, match="update_period"):
        ftopt.periodic_update(new, old, 3, 0)
    with pytest.raises(ValueError, match="steps"):
        ftopt.periodic_update(new, old, torch.tensor(3.0), 3)
    with pytest.raises(TypeError, match=r"global_norm at \['n'\]"):
        ftopt.global_norm({"n": torch.tensor(3)})
    for a, b in zip(_leaves(old), _leaves(old0)):
        assert torch.equal(a, b)
