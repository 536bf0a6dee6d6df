"""The kernels of one step on the GPU's timeline: where each starts and ends, on which
stream, and the gaps between them.

Donated Adam steps on the GPT-2 tree (8-bit states, or fp32 with ``fp32``), dense
gradients and 90% of the embedding's rows zero, with and without skip_zeros (the watch
settled first). Prints, for each: the step time (CUDA events), the host time of a call,
``ftopt.explain`` of the skip_zeros step, and two steps' kernels from torch.profiler
(start and end from the step's first kernel, in us). A step's critical path is read off
it: which kernels run one after another, which beside another, and what waits.

    python3 benchmarks/step_timeline_gpu.py [8-bit|fp32]
"""
import pathlib
import statistics
import sys
import time

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parent)]
import gpu_step  # noqa: E402
import timing  # noqa: E402
import torch  # noqa: E402

import ftopt  # noqa: E402
from ftopt.lowering import native  # noqa: E402

STEPS = 8  # profiled steps; two of them printed


def main() -> None:
    dev = torch.device("cuda")
    native.module(wait=True)  # (the host's checks of a process past its first seconds)
    print(f"native tensor check: {native.status()}", flush=True)
    cfg = gpu_step.gpt2_tree_config(dev)
    params, grads = gpu_step._tree(cfg, torch.float32, seed=21)
    sparse, _ = gpu_step._sparse_wte(grads, cfg)
    layout = sys.argv[1] if len(sys.argv) > 1 else "8-bit"
    kw = dict(state_bits=8) if layout == "8-bit" else {}
    for name, g in (("dense", grads), ("sparse", sparse)):
        for skip in (False, True):
            tx = ftopt.adam(1e-3, skip_zeros=skip, **kw)
            step = timing.donated_stepper(tx, params, g)
            for _ in range(40):  # (the watch's counts, its mode taken)
                step()
            torch.cuda.synchronize()
            host = []
            for _ in range(30):
                t = time.perf_counter()
                step()
                host.append((time.perf_counter() - t) * 1e6)
            ms = timing.event_ms(step, 40, 3)
            if skip:
                print(ftopt.explain(tx, params, g, donate=True))
            events = timing.cuda_events(step, STEPS)
            per = len(events) // STEPS
            print(f"== {layout} {name} skip_zeros={skip}: step ms "
                  f"{[round(x, 4) for x in ms]}, host us a call "
                  f"{statistics.median(host):.0f}, kernels a step {per}")
            for s in (STEPS - 3, STEPS - 2):
                chunk, t0, end = events[s * per:(s + 1) * per], None, None
                for e in chunk:
                    t0 = e.time_range.start if t0 is None else t0
                    gap = "" if end is None else f" gap {e.time_range.start - end:+.1f}"
                    print(f"  step {s} {e.name[:32]:32s} stream "
                          f"{getattr(e, 'device_resource_id', '?')} start "
                          f"{e.time_range.start - t0:7.1f} end {e.time_range.end - t0:7.1f} "
                          f"({e.device_time:6.1f}){gap}")
                    end = e.time_range.end if end is None else max(end, e.time_range.end)
                following = events[(s + 1) * per].time_range.start - t0
                print(f"  step {s} next starts at {following:.1f}")


if __name__ == "__main__":
    main()
