"""skip_zeros against no skip_zeros in a training loop's position: each step queued behind
a backward-sized burst of matrix products, its device time taken by its own two events.

``skip_watch_ab_gpu.py`` times 40 back-to-back steps between two events, started on an
idle device ("events") or behind one queued step ("primed"); ``watch_steps_gpu.py``
times a long run of back-to-back steps. A training loop runs neither: its optimizer step
is queued behind the backward pass's kernels (the host runs ahead; the device never
idles before the step) and is followed by the next forward pass, so the device goes from
dense compute to the step and back every iteration. Here each iteration queues a bf16
matrix product of ``--burst`` (8192: about 2 ms on an H200), an event, one donated step,
an event; a step's time is the time between its events.

GPT-2 Adam on each layout of ``gpu_step.LAYOUTS`` (``--layouts=8-bit,fp32``: only those
keys of ``tiles.SKIP_MODES``; ``--names="bf16 params, bf16 states;fp32"``: only
those of its names), no skip_zeros ("off") against skip_zeros with the watch
(the default), dense gradients and 90% of the embedding's rows zero ("sparse"),
``--rounds=N`` (4) rounds with the two variants' order swapped every other round, each
case ``--steps=N`` (128) timed iterations after 70 untimed ones (the watch's counts and
its probes at their rate). ``--burst=0``: no burst, the steps back to back, each still
timed by its own events. A case's time is the mean over its steps (its probes weighed
at their rate, as a loop pays them); the ratio is off's over the watch's, per round, and
the median of the rounds. Prints each round and the medians, writes
``OUT/in_loop.json``. The native tensor check is loaded first.

The burst matters on an H200: a bf16 product of 8192 holds the device at its 700 W power
limit, where its SM clock drops to 1.5-1.6 GHz (1.98 GHz while the steps run back to
back), so kernels with many instructions per byte (16-bit states, stochastic rounding,
skip_zeros' selects) take longer than between their own launches
(``benchmarks/RESULTS.md``, 2026-12-03).

``--kernels``: the timed steps also run under ``torch.profiler``, and each case prints
the device time a step of each kernel but the burst's (CUPTI: the kernels alone, without
the gaps between them), so that a step's time in this position can be told apart into
its kernels' (written to ``in_loop.json`` as ``kernels_us``).

    python3 benchmarks/skip_in_loop_gpu.py OUT [--layouts=...] [--names=...] [--rounds=4]
        [--steps=128] [--burst=8192] [--kernels]
"""
import collections
import contextlib
import json
import pathlib
import statistics
import sys

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parent)]
import gpu_step  # noqa: E402
import timing  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import ftopt  # noqa: E402
from ftopt.lowering import native  # noqa: E402


def _option(name: str, default: str) -> str:
    return next((a.split("=", 1)[1] for a in sys.argv[2:] if a.startswith(f"--{name}=")),
                default)


ONLY = [x for x in _option("layouts", "").split(",") if x]
NAMES = [x for x in _option("names", "").split(";") if x]
ROUNDS = int(_option("rounds", "4"))
STEPS = int(_option("steps", "128"))
BURST = int(_option("burst", "8192"))
KERNELS = "--kernels" in sys.argv[2:]
KINDS = ("dense", "sparse")


def in_loop_us(step, burst, burst_names: frozenset = frozenset()) -> tuple[list, dict]:
    """Each of :data:`STEPS` steps' device us, each queued behind ``burst()``; with
    :data:`KERNELS`, the device us a step of each kernel not named in ``burst_names``."""
    for _ in range(70):
        burst()
        step()
    torch.cuda.synchronize()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(STEPS)]
    with profile(activities=[ProfilerActivity.CUDA]) if KERNELS else (
            contextlib.nullcontext()) as prof:
        for a, b in pairs:
            burst()
            a.record()
            step()
            b.record()
        torch.cuda.synchronize()
    kernels: dict = collections.defaultdict(float)
    for e in (prof.events() if KERNELS else ()):
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name not in burst_names:
            kernels[e.name[:40]] += e.device_time / STEPS
    return [a.elapsed_time(b) * 1e3 for a, b in pairs], dict(kernels)


def kernel_names(fn) -> frozenset:
    """The names of the kernels ``fn`` launches (torch.profiler)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return frozenset(e.name for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)


def main() -> None:
    dev = torch.device("cuda")
    native.module(wait=True)
    print(f"native tensor check: {native.status()}", flush=True)
    x = torch.randn(BURST, BURST, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)

    def burst():  # (--burst=0: none, the steps back to back)
        if BURST:
            torch.mm(x, x, out=y)

    burst_ms = statistics.median(timing.event_ms(burst, 10, 3))
    burst_names = kernel_names(burst) if KERNELS else frozenset()
    print(f"burst: {BURST}^2 bf16 product, {burst_ms:.3f} ms", flush=True)
    cfg = gpu_step.gpt2_tree_config(dev)
    rows = []
    for name, kw, _, params, grads in gpu_step.layout_trees(cfg, ONLY, NAMES):
        sparse, _ = gpu_step._sparse_wte(grads, cfg)
        seen: dict = {}  # (variant, kind) -> each round's per-step us
        per_kernel: dict = {}  # (variant, kind) -> each round's us a step by kernel
        for rnd in range(ROUNDS):
            order = (("off", False), ("watch", True))
            for variant, skip in (order if rnd % 2 == 0 else order[::-1]):
                tx = ftopt.adam(1e-3, skip_zeros=skip, **kw)
                for kind, g in (("dense", grads), ("sparse", sparse)):
                    us, kernels = in_loop_us(timing.donated_stepper(tx, params, g), burst,
                                             burst_names)
                    seen.setdefault((variant, kind), []).append(us)
                    per_kernel.setdefault((variant, kind), []).append(kernels)
                    print(f"{rnd} {name:46s} {variant:5s} {kind:6s} mean "
                          f"{statistics.fmean(us):7.1f} us, median "
                          f"{statistics.median(us):7.1f}, max {max(us):7.1f}", flush=True)
                    for kernel, k_us in sorted(kernels.items(), key=lambda kv: -kv[1]):
                        print(f"      {kernel:40s} {k_us:7.1f} us a step", flush=True)
        for kind in KINDS:
            off = [statistics.fmean(u) for u in seen[("off", kind)]]
            watch = [statistics.fmean(u) for u in seen[("watch", kind)]]
            ratios = [o / w for o, w in zip(off, watch)]
            med = statistics.median(ratios)
            shown = (f"{med:.3f}x faster" if kind == "sparse"
                     else f"{(1 / med - 1) * 100:+.1f}% of off")
            print(f"{name:46s} {kind:6s} watch vs off, per round: "
                  f"{', '.join(f'{r:.3f}' for r in ratios)} -> {shown} "
                  f"(off {statistics.median(off):.1f} us, watch "
                  f"{statistics.median(watch):.1f})", flush=True)
            rows.append(dict(layout=name, grads=kind, off_mean_us=off, watch_mean_us=watch,
                             off_over_watch=ratios, median=med, burst_ms=burst_ms,
                             steps=STEPS, native_check=native.status(),
                             kernels_us={v: per_kernel[(v, kind)] for v in ("off", "watch")}
                             if KERNELS else {}))
        del params, grads, sparse
        torch.cuda.empty_cache()
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    (out / "in_loop.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
