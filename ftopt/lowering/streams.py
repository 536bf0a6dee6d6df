"""A carve's spanned group launched beside the other leaves' kernels, on a second stream.

A carve (:func:`ftopt.lowering.groups.carved`) runs a group's leaves in two launches: the
mostly all-zero leaves spanned, the others in their own mode. In turn on one stream, the
two kernels each pay a ramp-up and a drain, and the spanned one, bound by the rate at
which the device starts its many short programs, waits for the other to end. The other
leaves' kernels launch first, on the caller's stream, and the spanned group's on a second
stream ordered after the caller's work before the step, joined back into the caller's
after them: the kernels overlap. They write disjoint tensors and read nothing the other
writes (the step count, which one launch increments, is read by the next step, after the
join). H200, GPT-2 Adam, 90% of the embedding's rows zero, against no skip_zeros, whole
donated steps (``benchmarks/skip_watch_ab_gpu.py``; ``benchmarks/RESULTS.md``): in turn /
beside, bf16 states 1.237-1.238x / 1.264-1.265x, 8-bit 1.193-1.199x / 1.229-1.237x,
stochastic rounding 1.204-1.216x / 1.228-1.231x; dense gradients (no carve) unchanged.
Launching the spanned group first instead, or on a stream of higher priority, measured
no better (two runs each, 8-bit: 1.199x, 1.224x and 1.192x, 1.228x against the others
first 1.225x, 1.240x; bf16 states within 1% of one another). Nor did the largest group's
kernels first on the caller's stream (the others' small group after them): the spanned
kernel then runs at their end instead of their start, the step as long (8-bit
1.230x, 1.230x against 1.233x, 1.232x; bf16 states 1.265x against 1.257x; 2026-12-02),
nor those kernels on a third stream of the highest priority (their deferred kernel
then runs beside the spanned one, which it slows as much: the step 480-482 us against
479-482, 8-bit 1.229x against 1.226x), nor the spanned group in a few programs a
multiprocessor that stay resident beside the others' kernel (tiles.CARVE_PROGRAMS), nor
the step's small groups on the second stream too (GPT-2's 98 small fp32 leaves beside
8-bit states, 3.4 us alone: 8-bit 1.241x against 1.244x, bf16 states 1.258x both;
2026-12-02).

While a CUDA graph is being captured the launches run in turn on the capturing stream.
``FTOPT_CARVE_STREAM=0`` runs them in turn always.
"""

from __future__ import annotations

import contextlib
from functools import lru_cache

import torch

from ftopt.lowering import knobs, tiles

ON = knobs.switch("FTOPT_CARVE_STREAM", True, "a carve's kernels run on a second stream")

# Programmatic dependent launch (NVIDIA, compute capability 9.0 and later): a kernel so
# launched is started while the kernel before it on its stream runs its last programs,
# and each of its programs waits (``griddepcontrol.wait``) for that kernel to end and its
# stores to be visible before anything else: the order of the stream kept, the launch's
# latency hidden. "defer": the deferred kernels of "split+defer" steps (launched after
# their main kernel, to read the flags it stores: ftopt.lowering.split); "all": every
# main kernel; "0": none. H200, GPT-2 8-bit Adam with skip_zeros (benchmarks/RESULTS.md,
# 2026-12-02): the deferred kernel starts as its main kernel ends (gap +1.1..1.9 us ->
# -0.1) but still runs ~8 us; against no skip_zeros, six A/Bs each, "defer" / "0":
# dense mean +2.4% / +2.7%, 90% of the embedding's rows zero 1.222-1.237x /
# 1.220-1.227x; "all" 1.154x, 1.145x (the carve's kernels then queue behind one
# another).
PDL = knobs.choice("FTOPT_PDL", "defer", ("defer", "all", "0"),
                   "kernels launched as programmatic dependent launches")

# device (with its index), and that stream -> its second stream and two events
_SIDE: dict = {}


def fork(device: torch.device):
    """A second stream of ``device`` that waits for the current stream's work so far, or
    ``None`` where the launches run in turn (off; a device without streams; a CUDA graph
    being captured)."""
    module = getattr(torch, device.type, None)
    if not ON or device.type not in ("cuda", "xpu") or module is None:
        return None
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    at = torch.device(device.type, module.current_device() if device.index is None
                      else device.index)
    found = _SIDE.get(at)
    if found is None:  # (an event for each direction, recorded again at each step)
        side = module.Stream(at)
        found = _SIDE[at] = _SIDE[side] = (
            side, module.Event(), module.Event(),
            side.cuda_stream if device.type == "cuda" else side.sycl_queue)
    side, forked, _, _ = found
    forked.record(module.current_stream(at))
    side.wait_event(forked)
    return side


@lru_cache(maxsize=16)
def _dependent_launches(device: torch.device) -> bool:
    return (not tiles.INTERPRETING and device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] >= 9)


@lru_cache(maxsize=16)
def multiprocessors(device: torch.device) -> int:
    """The multiprocessors of a CUDA or ROCm device, an XPU's compute units; 1 elsewhere
    (the interpreter runs programs one after another)."""
    if tiles.INTERPRETING or device.type not in ("cuda", "xpu"):
        return 1
    props = getattr(torch, device.type).get_device_properties(device)
    return int(getattr(props, "multi_processor_count", 0)
               or getattr(props, "gpu_subslice_count", 0) or 1)


def dependent(device: torch.device, deferred: bool) -> bool:
    """Whether a main kernel (``deferred``: a deferred one) on ``device`` is launched as
    a programmatic dependent launch (:data:`PDL`), where Triton has them
    (:data:`ftopt.lowering.launch.DEPENDENT_LAUNCHES`)."""
    return (PDL == "all" or PDL == "defer" and deferred) and _dependent_launches(device)


def handle(side) -> int:
    """The raw stream of ``side`` (from :func:`fork`) that Triton's launchers take: a
    launch that names it needs neither to make it the current stream and back nor the
    launcher's own queries of the current device and stream."""
    return _SIDE[side][3]


def join(device: torch.device, side) -> None:
    """The current stream of ``device`` waits for ``side``'s launches (from :func:`fork`;
    nothing where ``None``)."""
    if side is not None:
        joined = _SIDE[side][2]
        joined.record(side)
        getattr(torch, device.type).current_stream(device).wait_event(joined)


def run_bound(device: torch.device, beside: list, rest: list, args) -> None:
    """A donated step's bound launches (:class:`ftopt.lowering.launch.BoundLaunch`): the
    others' (``rest``) on the current stream, then a carve's spanned group's (``beside``)
    on the second, named to the launcher rather than made current; without a second
    stream, all in turn."""
    side = fork(device) if beside else None
    for b in rest:
        b.runner(*b.before, *args, *b.after)
    if side is None:
        for b in beside:
            b.runner(*b.before, *args, *b.after)
        return
    raw = handle(side)
    for b in beside:
        b.runner(*b.before, *args, *b.after, stream=raw)
    join(device, side)


def on(side):
    """The context that makes ``side`` the current stream (nothing where ``None``)."""
    if side is None:
        return contextlib.nullcontext()
    return getattr(torch, side.device.type).stream(side)
