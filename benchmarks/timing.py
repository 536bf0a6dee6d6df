"""How the benchmarks time a step: the one place for warm-ups, synchronisation and
CUDA events, so that every table measures the same way.

* :class:`Clock`: per-call CUDA-event times, wall time over back-to-back calls, whole
  calls as a waiting caller sees them, host time (``gpu_step.py``'s sections).
* :func:`wall_ms`: warm-up calls, then ms per call over back-to-back calls, one sync.
* :func:`event_ms`: CUDA events around ``n`` back-to-back calls, ``reps`` times.
* :func:`each_call_ms`: an event between every two of ``n`` back-to-back calls started
  on an idle device: each position's ms (where in a window its time goes).
* :func:`donated_step_ms`: :func:`event_ms` of donated ``ftopt.step`` calls of a transform.
* :func:`host_us`: host time of each call in microseconds, no synchronisation (for
  benchmarks whose kernel launch is stubbed); :func:`median_host_ms`, its median in ms
  (a CPU benchmark's time).
* :func:`profile_text`: a cProfile's costliest functions by cumulative and by own time.
* :func:`kernel_us`: each kernel's mean device time over donated steps (torch.profiler):
  a step's GPU time without its host time.
"""

from __future__ import annotations

import collections
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ftopt  # noqa: E402
from ftopt.lowering import tiles  # noqa: E402


class Clock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def time_steps(self, fn: Callable, n: int) -> list[float]:
        """ms of each of ``n`` consecutive calls (CUDA events around each, one sync)."""
        if self.cuda:
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
            self.sync()
            for s, e in zip(starts, ends):
                s.record()
                fn()
                e.record()
            self.sync()
            return [s.elapsed_time(e) for s, e in zip(starts, ends)]
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    def wall(self, fn: Callable, n: int) -> float:
        """ms per call over ``n`` back-to-back calls with one sync at the end."""
        self.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        self.sync()
        return (time.perf_counter() - t0) * 1e3 / n

    def call(self, fn: Callable, n: int) -> list[float]:
        """ms of each whole call as a caller that waits for it sees it: sync, then
        ``perf_counter`` around the call and a sync (host work + GPU time)."""
        out = []
        for _ in range(n):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    def host(self, fn: Callable, n: int) -> list[float]:
        """ms of host time of each call: sync, then perf_counter around the call."""
        out = []
        for _ in range(n):
            self.sync()
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        self.sync()
        return out


def wall_ms(fn: Callable, device: torch.device, iters: int, warmup: int) -> float:
    """``warmup`` untimed calls, then ms per call over ``iters`` back-to-back calls (one
    sync at the end on a GPU)."""
    for _ in range(warmup):
        fn()
    return Clock(device).wall(fn, iters)


def event_ms(fn: Callable, n: int = 40, reps: int = 3, primed: bool = False) -> list[float]:
    """ms per call, ``reps`` times: CUDA events around ``n`` back-to-back calls
    (``primed``: after one call queued before the first event, whose host work before
    its first launch an idle device would otherwise wait for inside the window)."""
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        if primed:
            torch.cuda.synchronize()
            fn()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) / n)
    return out


def profile_text(prof: cProfile.Profile, n: int = 40) -> str:
    """The ``n`` costliest functions of ``prof`` by cumulative time, then by own time."""
    text = io.StringIO()
    for key in ("cumulative", "tottime"):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(n)
    return text.getvalue()


def each_call_ms(fn: Callable, n: int = 40, reps: int = 3) -> list[float]:
    """ms of each of ``n`` back-to-back calls, the median of ``reps`` windows: an event
    recorded before the first call and after every call, the device idle at the start
    (as :func:`event_ms` unprimed). Position 0 holds the first call's host work before
    its first launch; where the host keeps ahead, the later positions are device time."""
    per: list[list[float]] = [[] for _ in range(n)]
    for _ in range(reps):
        torch.cuda.synchronize()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        events[0].record()
        for k in range(n):
            fn()
            events[k + 1].record()
        torch.cuda.synchronize()
        for k in range(n):
            per[k].append(events[k].elapsed_time(events[k + 1]))
    return [statistics.median(x) for x in per]


def donated_stepper(tx: Any, params: dict, grads: dict | list,
                    backend: str = "fused") -> Callable[[], None]:
    """A function that runs one donated ``ftopt.step(tx, ...)`` on copies of ``params``
    each call (the same ``grads`` every step, or a list of them in turn)."""
    box = {"p": {k: v.clone() for k, v in params.items()}, "i": 0}
    box["s"] = tx.init(box["p"])
    turns = grads if isinstance(grads, list) else [grads]

    def one_step():
        box["i"] += 1
        box["p"], box["s"] = ftopt.step(tx, box["p"], turns[box["i"] % len(turns)],
                                        box["s"], donate=True, backend=backend)
    return one_step


def donated_step_ms(tx: Any, params: dict, grads: dict | list, n: int = 40, reps: int = 3,
                    warmup: int = 3, backend: str = "fused") -> list[float]:
    """:func:`event_ms` of :func:`donated_stepper`'s steps after ``warmup`` untimed
    ones."""
    one_step = donated_stepper(tx, params, grads, backend)
    for _ in range(warmup):
        one_step()
    return event_ms(one_step, n, reps)


def host_us(fn: Callable, iters: int, warmup: int = 5) -> list[float]:
    """Host time of each of ``iters`` calls (us) after ``warmup`` untimed calls; no
    synchronisation (the launch is stubbed, or only the host work is wanted)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return times


def median_host_ms(fn: Callable, iters: int, warmup: int = 3) -> float:
    """The median of :func:`host_us` in ms: a CPU call's time (nothing to synchronise)."""
    return statistics.median(host_us(fn, iters, warmup)) / 1e3


def cuda_events(step: Callable[[], None], steps: int) -> list:
    """The CUDA events (torch.profiler) of ``steps`` calls of ``step``, by start time.
    The skip_zeros watch does not count in them: the steps launch the same kernels each."""
    torch.cuda.synchronize()
    period = (tiles.WATCH_PERIOD, tiles.WATCH_PROBE, tiles.WATCH_FIRST_PROBE)
    tiles.WATCH_PERIOD = tiles.WATCH_PROBE = tiles.WATCH_FIRST_PROBE = 10**9
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
    finally:
        tiles.WATCH_PERIOD, tiles.WATCH_PROBE, tiles.WATCH_FIRST_PROBE = period
    return sorted([e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA],
                  key=lambda e: e.time_range.start)


def kernel_us(tx, params: dict, grads: dict, steps: int = 20) -> dict:
    """Mean device time (us) of each kernel name over ``steps`` donated steps, with the
    number of launches a step. The skip_zeros watch (``ftopt.lowering.skip_watch``)
    counts in the warm-up steps alone: the profiled steps launch the same kernels each,
    so the kernels of one name are told apart by their place in a step."""
    step = donated_stepper(tx, params, grads)
    for _ in range(17):  # (the watch's first count, read, its mode taken, its first probe)
        step()
    events = cuda_events(step, steps)
    per_step = max(len(events) // steps, 1)
    times = collections.defaultdict(list)
    for i, e in enumerate(events):
        # (kernels of one name told apart by their place in the step's launches)
        times[f"{e.name[:24]}#{i % per_step}"].append(e.device_time)
    return {k: dict(per_step=len(v) / steps, mean_us=sum(v) / len(v))
            for k, v in times.items()}
