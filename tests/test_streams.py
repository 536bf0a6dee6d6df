"""The second stream a carve's spanned group launches on (``ftopt.lowering.streams``)."""

from __future__ import annotations

import pytest
import torch

from ftopt.lowering import streams, tiles

CUDA = torch.cuda.is_available()


def test_no_second_stream_on_a_cpu_or_when_off(monkeypatch):
    """Launches run in turn on a CPU, and with FTOPT_CARVE_STREAM=0 on any device."""
    assert streams.fork(torch.device("cpu")) is None
    streams.join(torch.device("cpu"), None)  # (nothing to join)
    with streams.on(None):
        pass
    monkeypatch.setattr(streams, "ON", False)
    assert streams.fork(torch.device("cuda")) is None


def test_dependent_launches_on_nvidia_gpus_from_compute_capability_9(monkeypatch):
    """Programmatic dependent launches where ``streams.PDL`` asks for them (the deferred
    kernels, or every main kernel), on a device that has them: NVIDIA, sm_90 on."""
    capable = (CUDA and torch.version.hip is None
               and torch.cuda.get_device_capability()[0] >= 9 and not tiles.INTERPRETING)
    for pdl, deferred, expected in [("0", True, False), ("defer", True, capable),
                                    ("defer", False, False), ("all", False, capable),
                                    ("all", True, capable)]:
        monkeypatch.setattr(streams, "PDL", pdl)
        assert not streams.dependent(torch.device("cpu"), deferred)
        if CUDA:
            assert streams.dependent(torch.device("cuda", 0), deferred) == expected


@pytest.mark.skipif(not CUDA, reason="streams of a CUDA device")
def test_the_second_stream_waits_for_the_work_before_it_and_is_joined():
    """Work launched on the second stream sees what the caller's stream wrote before the
    fork; after the join the caller's stream sees what it wrote (the control: before the
    join it does not)."""
    device = torch.device("cuda")
    here = torch.cuda.current_stream()
    x = torch.zeros(1 << 20, device=device)
    y = torch.zeros_like(x)
    # (each kernel once first: a first launch loads its module, which may wait for the
    # device)
    torch.cuda._sleep(1)
    x.fill_(2.0)
    y.copy_(x * 3.0)
    y[:1].clone()
    y.zero_()
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # (the fork must wait for this and the fill)
    x.fill_(2.0)
    side = streams.fork(device)
    assert side is not None and side != here
    assert streams.fork(device) == side  # (one a device)
    assert streams.handle(side) == side.cuda_stream  # (what bound launches name)
    with streams.on(side):
        assert torch.cuda.current_stream() == side
        torch.cuda._sleep(100_000_000)
        y.copy_(x * 3.0)
    early = y[:1].clone()  # on the caller's stream, not yet joined
    streams.join(device, side)
    late = y.clone()
    torch.cuda.synchronize()
    assert torch.equal(late, torch.full_like(x, 6.0))
    assert early.item() != 6.0  # (the control: without the join it ran ahead)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
def test_no_second_stream_while_a_graph_is_captured():
    x = torch.zeros(8, device="cuda")
    capture = torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture):
        x.add_(1.0)  # (warm-up outside the capture)
    torch.cuda.current_stream().wait_stream(capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        side = streams.fork(x.device)
        x.add_(1.0)
    assert side is None
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 2.0))
