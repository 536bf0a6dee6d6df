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


def test_this_torch_checks_in_one_call(monkeypatch):
    """torch's C++ guards are what runs on the supported torch versions where the native
    check is not built (the Python passes cost ~4x more host time per step with new
    gradient tensors)."""
    monkeypatch.setattr(checks, "USE_NATIVE", False)
    check = checks.TensorCheck(_tensors(torch.Generator().manual_seed(0)), DEVICE)
    assert check.guard is not None and check.table is None


def test_native_check_is_used_once_built(native_checks):
    check = checks.TensorCheck(_tensors(torch.Generator().manual_seed(0)), DEVICE)
    assert check.table is not None and check.guard is None


@pytest.mark.usefixtures("tensor_checks")
def test_pointers_and_fit():
    """``pointers`` reads every pointer of tensors that fit; ``fit`` (donated steps) holds
    the first ``n_fixed`` to the recorded memory and reports new trailing pointers only
    until they are recorded."""
    gen = torch.Generator().manual_seed(3)
    fixed, grads = _tensors(gen), _tensors(gen)
    check = checks.TensorCheck(fixed + grads, DEVICE, n_fixed=len(fixed))
    assert check.fit(fixed + grads) is True
    assert check.fit(tuple(fixed), grads) is True
    assert check.fit(fixed[:2], tuple(fixed[2:] + grads[:1]), grads[1:]) is True
    new = _tensors(gen)
    found = check.fit(fixed + new)
    assert found == [t.data_ptr() for t in new]
    assert check.fit(fixed + new) == found  # not recorded yet
    check.record(found)
    assert check.fit(fixed + new) is True
    assert check.fit(fixed + grads) == [t.data_ptr() for t in grads]
    moved = [fixed[0].clone(), *fixed[1:]]  # same layout, other memory
    assert check.fit(moved + new) is None
    assert check.fit(fixed + new[:-1]) is None
    assert check.fit(fixed + [*new[:-1], None]) is None
    assert check.fit(fixed, new[:-1], [None]) is None
    assert check.fit([*fixed[:-1], torch.randn(7, device=DEVICE)] + new) is None
    plain = checks.TensorCheck(grads, DEVICE)
    assert plain.pointers(new) == [t.data_ptr() for t in new]
    assert plain.pointers([new[1], *new[1:]]) is None


def test_fused_step_upgrades_to_the_native_check_once_built(native_checks, monkeypatch):
    """A check built before the native module loaded moves to it at its next fit."""
    monkeypatch.setattr(checks, "_native_table", lambda *a, start: None)
    gen = torch.Generator().manual_seed(4)
    fixed, grads = _tensors(gen), _tensors(gen)
    check = checks.TensorCheck(fixed + grads, DEVICE, n_fixed=len(fixed))
    assert check.table is None
    monkeypatch.undo()
    new = _tensors(gen)
    assert check.fit(fixed + new) == [t.data_ptr() for t in new]
    assert check.table is not None and check.guard is None
    assert check.fit(fixed + grads) is True  # the recorded pointers carried over
    assert check.fit(fixed + new) == [t.data_ptr() for t in new]


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
    assert check.grad_free is (tensor_checks != "python")


def test_built_from_non_contiguous_tensors_wants_contiguous_ones():
    t = torch.randn(4, 6, device=DEVICE).t()
    check = checks.TensorCheck([t], DEVICE)
    assert check.guard is None and check.table is None
    assert not check.check([t]) and check.check([t.contiguous()])


def test_native_grads_reads_as_the_grad_getter(native_checks):
    """``grads``: each tensor's ``.grad`` object (``None`` where it has none), for tensors
    and ``nn.Parameter``; anything else is refused."""
    params = [torch.nn.Parameter(torch.randn(3)), torch.randn(2, requires_grad=True),
              torch.nn.Parameter(torch.randn(4, 2))]
    params[0].grad = torch.randn(3)
    params[2].grad = torch.randn(4, 2)
    got = native_checks.grads(params)
    assert len(got) == 3 and got[1] is None
    assert got[0] is params[0].grad and got[2] is params[2].grad
    assert native_checks.grads(()) == []
    with pytest.raises(TypeError, match="expected tensors"):
        native_checks.grads([params[0], 3.0])
