"""A device Triton cannot run kernels on (an old GPU, no C compiler): found once, before
the first fused call there; ``auto`` then runs eagerly with one warning, ``fused`` raises
the reason, ``explain`` prints it, and nothing passed in is touched."""

from __future__ import annotations

import warnings

import optree
import pytest
import torch
from step_checks import fresh_generator

import ftopt
from ftopt.lowering import devices, plan, tiles

FAKE_GPU = torch.device("cuda", 5)


@pytest.fixture
def fresh(monkeypatch):
    """No reason kept from another test; a fake CUDA device that is not captured."""
    devices.forget()
    monkeypatch.setattr(devices, "_capturing", lambda device: False)
    yield
    devices.forget()


def _no_probe(device):
    raise AssertionError("the probe ran where the capability already refused the device")


@pytest.mark.parametrize("capability", [(6, 1), (6, 0), (5, 2)])
def test_old_nvidia_gpus_are_refused_before_any_compile(monkeypatch, fresh, capability):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(devices, "_capability", lambda device: capability)
    monkeypatch.setattr(devices, "_probe", _no_probe)
    reason = devices._reason(FAKE_GPU)
    assert reason is not None
    assert f"{capability[0]}.{capability[1]}" in reason and "7.0" in reason
    assert "cuda:5" in reason


@pytest.mark.parametrize("capability", [(7, 0), (7, 5), (9, 0)])
def test_supported_gpus_are_probed(monkeypatch, fresh, capability):
    probed = []
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(devices, "_capability", lambda device: capability)
    monkeypatch.setattr(devices, "_probe", lambda d: probed.append(d))
    assert devices._reason(FAKE_GPU) is None
    assert probed == [FAKE_GPU]


def test_a_probe_that_fails_names_the_error(monkeypatch, fresh):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(devices, "_capability", lambda device: (8, 0))

    def no_compiler(device):
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment "
                           "variable.\nsecond line")

    monkeypatch.setattr(devices, "_probe", no_compiler)
    reason = devices._reason(FAKE_GPU)
    assert "RuntimeError: Failed to find C compiler" in reason
    assert "second line" not in reason
    assert "cuda:5" in reason


def test_rocm_devices_skip_the_nvidia_capability(monkeypatch, fresh):
    monkeypatch.setattr(torch.version, "hip", "6.2")
    monkeypatch.setattr(devices, "_capability", lambda device: (1, 0))
    monkeypatch.setattr(devices, "_probe", lambda device: None)
    assert devices._reason(FAKE_GPU) is None


def test_found_once_per_device_and_warned_once(monkeypatch, fresh):
    calls = []
    monkeypatch.setattr(tiles, "INTERPRETING", False)
    monkeypatch.setattr(devices, "_reason",
                        lambda device: calls.append(device) or f"{device} is too old")
    with pytest.warns(RuntimeWarning, match="fused steps are off on cuda:5.*too old"):
        assert devices.unsupported(FAKE_GPU) == "cuda:5 is too old"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert devices.unsupported(FAKE_GPU) == "cuda:5 is too old"
    assert calls == [FAKE_GPU]
    with pytest.warns(RuntimeWarning, match="cuda:6"):
        devices.unsupported(torch.device("cuda", 6))
    assert len(calls) == 2


def test_nothing_is_found_while_a_graph_is_captured(monkeypatch, fresh):
    monkeypatch.setattr(tiles, "INTERPRETING", False)
    monkeypatch.setattr(devices, "_capturing", lambda device: True)
    monkeypatch.setattr(devices, "_reason", lambda device: "should not be asked")
    assert devices.unsupported(FAKE_GPU) is None
    assert str(FAKE_GPU) not in devices._FOUND  # asked again after the capture


def test_the_cpu_and_the_interpreter_are_never_probed(monkeypatch, fresh):
    monkeypatch.setattr(devices, "_reason", lambda device: "should not be asked")
    assert devices.unsupported(torch.device("cpu")) is None
    monkeypatch.setattr(tiles, "INTERPRETING", True)
    assert devices.unsupported(FAKE_GPU) is None


def _tree(g: torch.Generator, device: torch.device):
    params = {"w": torch.randn(40, 3, generator=g), "b": torch.randn(3, generator=g)}
    grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
    return ({k: v.to(device) for k, v in params.items()},
            {k: v.to(device) for k, v in grads.items()})


@pytest.mark.parametrize("donate", [False, True])
def test_fused_raises_the_device_reason_and_touches_nothing(monkeypatch, donate):
    g = fresh_generator()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    monkeypatch.setattr(plan, "device_unsupported",
                        lambda device: f"{device} cannot run Triton's kernels (test)")
    params, grads = _tree(g, device)
    tx = ftopt.adamw(1e-2, weight_decay=0.1)
    state = tx.init(params)
    for _ in range(2):  # a state that is not the initial one
        params, state = ftopt.step(tx, params, grads, state, backend="eager")
    before = {k: v.clone() for k, v in params.items()}
    state_before = [t.clone() for t in optree.tree_leaves(state, namespace="ftopt")
                    if isinstance(t, torch.Tensor)]
    with pytest.raises(RuntimeError, match=r"cannot fuse: (cpu|cuda:0) cannot run Triton"):
        ftopt.step(tx, params, grads, state, donate=donate, backend="fused")
    for k, v in params.items():
        assert torch.equal(v, before[k])
    after = [t for t in optree.tree_leaves(state, namespace="ftopt") if isinstance(t, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(after, state_before))
    text = ftopt.explain(tx, params, grads, backend="fused", file=_Discard())
    assert f"{params['w'].device} cannot run Triton's kernels (test)" in text
    # The control: without the device's reason the same step fuses and moves the params.
    monkeypatch.setattr(plan, "device_unsupported", lambda device: None)
    new, _ = ftopt.step(tx, params, grads, state, backend="fused")
    assert not torch.equal(new["w"], before["w"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="auto fuses only on a GPU")
def test_auto_runs_eagerly_where_the_device_cannot(monkeypatch):
    g = fresh_generator()
    params, grads = _tree(g, torch.device("cuda"))
    tx = ftopt.adam(1e-2)
    state = tx.init(params)
    monkeypatch.setattr(plan, "device_unsupported", lambda device: "no kernels here (test)")
    auto, auto_state = ftopt.step(tx, params, grads, state, backend="auto")
    eager, eager_state = ftopt.step(tx, params, grads, state, backend="eager")
    for a, b in zip(optree.tree_leaves((auto, auto_state), namespace="ftopt"),
                    optree.tree_leaves((eager, eager_state), namespace="ftopt")):
        assert torch.equal(a, b)


class _Discard:
    def write(self, text):
        return len(text)

    def flush(self):
        pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_this_gpu_runs_the_probe():
    devices.forget()
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_sync_debug_mode("error")  # the check must not synchronise
    try:
        assert devices._reason(device) is None
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(devices._probe(device).item()) == devices._PROBE_VALUE
