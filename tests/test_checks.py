"""The check that new tensors fit cached fused tables (shape, dtype, layout, device)."""

from __future__ import annotations

import pytest
import torch

from ftopt.lowering import checks

# With its index, as the tensors' own device is (what the fused paths pass).
DEVICE = torch.empty(0, device="cuda" if torch.cuda.is_available() else "cpu").device


def _tensors(gen):
    return [torch.randn(3, 5, generator=gen).to(DEVICE), torch.randn(7, generator=gen).to(
        DEVICE), torch.randn(2, 1, 4, generator=gen).to(DEVICE).to(torch.bfloat16),
        torch.empty(0, 3, device=DEVICE)]


def test_this_torch_checks_in_one_call():
    """The one-call C++ check is what runs on the supported torch versions (the Python
    passes cost ~4x more host time per step with new gradient tensors)."""
    check = checks.TensorCheck(_tensors(torch.Generator().manual_seed(0)), DEVICE)
    assert check.guard is not None


@pytest.mark.usefixtures("tensor_checks")
def test_fits_and_misfits():
    gen = torch.Generator().manual_seed(1)
    built = _tensors(gen)
    check = checks.TensorCheck(built, DEVICE)
    assert check.check(built)
    assert check.check(tuple(_tensors(gen)))  # new tensors, same layout
    fresh = _tensors(gen)
    wrong = {
        "shape": torch.randn(5, 3, device=DEVICE),
        "rank": torch.randn(15, device=DEVICE),
        "dtype": fresh[0].double(),
        "half dtype": fresh[0].half(),
        "not contiguous": torch.randn(5, 3, device=DEVICE).t(),
        "device": torch.randn(3, 5, device="meta"),
        "None": None,
        "not a tensor": [[0.0] * 5] * 3,
    }
    for why, bad in wrong.items():
        assert not check.check([bad, *fresh[1:]]), why
        assert not check.check([*fresh[:3], bad]), why
    assert not check.check(fresh[:3])
    assert not check.check(fresh + fresh[:1])


def test_strict_where_the_guard_runs(tensor_checks):
    """The C++ check also compares requires_grad (callers rely on ``grad_free``)."""
    gen = torch.Generator().manual_seed(2)
    check = checks.TensorCheck(_tensors(gen), DEVICE)
    fresh = _tensors(gen)
    fresh[1].requires_grad_()
    assert check.check(fresh) is (tensor_checks == "python")
    assert check.grad_free is (tensor_checks == "guards")


def test_built_from_non_contiguous_tensors_wants_contiguous_ones():
    t = torch.randn(4, 6, device=DEVICE).t()
    check = checks.TensorCheck([t], DEVICE)
    assert check.guard is None
    assert not check.check([t]) and check.check([t.contiguous()])
