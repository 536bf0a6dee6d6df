"""optax's numerical helpers and small utilities in torch: ``safe_norm`` and
``safe_root_mean_squares`` (values, a zero gradient below the floor, the norm's gradient
above it), ``safe_increment`` (no wrap at the dtype's top), ``abs_sq``,
``scale_gradient`` (forward unchanged, backward scaled, under autograd and torch.func),
``stateless_with_tree_map``, ``with_extra_args_support`` and ``init_empty_state``."""

from __future__ import annotations

import pytest
import torch

import ftopt

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("ord_axis", [(None, None), (None, 1), (2, 1), ("fro", (0, 1)),
                                      (1, 0), (float("inf"), 1)])
@pytest.mark.parametrize("keepdims", [False, True])
def test_safe_norm_values_and_gradients(ord_axis, keepdims):
    ord, axis = ord_axis
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 5, generator=gen, dtype=torch.float64).to(DEVICE)
    x[1] = 0.0  # a zero row: below the floor along axis 1
    x.requires_grad_(True)
    got = ftopt.safe_norm(x, 1e-3, ord=ord, axis=axis, keepdims=keepdims)
    if ord is None and axis is None:
        plain = torch.linalg.vector_norm(x)
        plain = plain.reshape(1, 1) if keepdims else plain
    else:
        plain = torch.linalg.norm(x, ord=ord, dim=axis, keepdim=keepdims)
    want = torch.clamp(plain, min=1e-3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    got.sum().backward()
    assert torch.isfinite(x.grad).all()
    if axis == 1:  # the zero row's gradient is 0, not NaN
        assert torch.equal(x.grad[1], torch.zeros_like(x.grad[1]))
    y = x.detach().clone().requires_grad_(True)  # above the floor: the norm's gradient
    torch.clamp(plain.detach() * 0 + (torch.linalg.vector_norm(y).reshape(plain.shape)
                                      if ord is None and axis is None else
                                      torch.linalg.norm(y, ord=ord, dim=axis,
                                                        keepdim=keepdims)),
                min=1e-3).sum().backward()
    rows = [0, 2, 3] if axis == 1 else slice(None)
    torch.testing.assert_close(x.grad[rows], y.grad[rows], rtol=1e-12, atol=1e-15)


def test_safe_root_mean_squares_real_and_complex():
    x = torch.tensor([3.0, 4.0], device=DEVICE, requires_grad=True)
    r = ftopt.safe_root_mean_squares(x, 0.1)
    assert abs(float(r) - (12.5 ** 0.5)) < 1e-6
    z = torch.zeros(3, device=DEVICE, requires_grad=True)
    r = ftopt.safe_root_mean_squares(z, 0.5)
    r.backward()
    assert float(r) == 0.5 and torch.equal(z.grad, torch.zeros(3, device=DEVICE))
    c = torch.tensor([3 + 4j, 0j], device=DEVICE)
    assert abs(float(ftopt.safe_root_mean_squares(c, 0.0)) - 12.5 ** 0.5) < 1e-6
    torch.testing.assert_close(ftopt.abs_sq(c), torch.tensor([25.0, 0.0], device=DEVICE))
    assert ftopt.abs_sq(torch.tensor([-3.0])).item() == 9.0


def test_safe_increment():
    for dtype in (torch.int32, torch.int64, torch.int8, torch.float32):
        info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
        top = torch.tensor(info.max, dtype=dtype, device=DEVICE)
        assert torch.equal(ftopt.safe_increment(top), top)
        one = torch.tensor(1, dtype=dtype, device=DEVICE)
        two = ftopt.safe_increment(one)
        assert two.dtype == dtype and int(two) == 2 and int(one) == 1
    assert ftopt.safe_int32_increment is ftopt.safe_increment
    with pytest.raises(ValueError, match="safe_increment: cannot increment a count of dtype "
                                         "torch.bool"):
        ftopt.safe_increment(torch.tensor(True))
    with pytest.raises(TypeError, match="safe_increment: expected a tensor"):
        ftopt.safe_increment(3)


def test_scale_gradient():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, generator=gen).to(DEVICE).requires_grad_(True)
    tree = {"a": x, "n": 3}
    out = ftopt.scale_gradient(tree, 0.25)
    assert out["n"] == 3 and torch.equal(out["a"].detach(), x.detach())
    (out["a"] * torch.arange(6.0, device=DEVICE)).sum().backward()
    torch.testing.assert_close(x.grad, 0.25 * torch.arange(6.0, device=DEVICE))

    def f(v):
        return (ftopt.scale_gradient(v, -2.0) ** 2).sum()
    g = torch.func.grad(f)(x.detach())
    torch.testing.assert_close(g, -4.0 * x.detach())


def test_stateless_with_tree_map_and_friends():
    gen = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(3, 2, generator=gen).to(DEVICE),
              "b": torch.randn(2, generator=gen).to(DEVICE)}
    grads = {"w": torch.randn(3, 2, generator=gen).to(DEVICE), "b": None}
    seen = []

    def fn(u, p):
        seen.append(p is None)
        return u * 2 if p is None else u + p
    tx = ftopt.stateless_with_tree_map(fn)
    assert tx.init(params) == ftopt.EmptyState() == ftopt.init_empty_state(params)
    u, s = tx.update(grads, tx.init(params), params)
    assert u["b"] is None and torch.equal(u["w"], grads["w"] + params["w"])
    u, _ = tx.update(grads, s)
    assert torch.equal(u["w"], grads["w"] * 2) and seen == [False, True]
    with pytest.raises(TypeError, match="stateless_with_tree_map: expected a function"):
        ftopt.stateless_with_tree_map(3)
    adam = ftopt.adam(1e-3)
    assert ftopt.with_extra_args_support(adam) is adam
    with pytest.raises(TypeError, match="with_extra_args_support: expected a "
                                        "GradientTransformation"):
        ftopt.with_extra_args_support(ftopt.adam)
