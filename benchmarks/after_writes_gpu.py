"""What a small kernel costs right after a kernel that wrote much memory, against after
one that only read it: whether a step's last short kernel (a "split+defer" step's
deferred kernel, ~8 us after the 8-bit main kernel, ~3.5 us where that kernel wrote
nothing) pays for the writes before it.

A "big" kernel (``torch`` copy of 1.4 GB, or a sum over it: reads only), then at once
one small kernel: a one-element add, a byte-sum of 335 KB (the flags of GPT-2's 8-bit
groups), or nothing. Device time of each small kernel by the profiler, and the gap
between the big kernel's end and the small one's start, medians of 20.

    python3 benchmarks/after_writes_gpu.py
"""
import pathlib
import statistics
import sys

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parent)]
import timing  # noqa: E402
import torch  # noqa: E402

N = 350_000_000  # fp32 elements: 1.4 GB


def main() -> None:
    dev = torch.device("cuda")
    src = torch.randn(N, device=dev)
    dst = torch.empty_like(src)
    flags = torch.zeros(335_000, dtype=torch.uint8, device=dev)
    one = torch.zeros(1, device=dev)
    acc = torch.zeros((), device=dev)
    bigs = {"copy (writes 1.4 GB)": lambda: dst.copy_(src),
            "sum (reads only)": lambda: torch.sum(src, dim=0, out=acc)}
    smalls = {"add one element": lambda: one.add_(1.0),
              "sum of 335 KB of flags": lambda: flags.sum(dtype=torch.int32)}
    for big_name, big in bigs.items():
        for small_name, small in smalls.items():
            def pair(big=big, small=small):
                big()
                small()
            for _ in range(3):
                pair()
            events = [e for e in timing.cuda_events(pair, 20) if e.device_time > 0]
            durations, gaps = [], []
            for a, b in zip(events, events[1:]):
                if a.device_time > 100 and b.device_time < 100:  # (big, then small)
                    durations.append(b.device_time)
                    gaps.append(b.time_range.start - a.time_range.end)
            print(f"after {big_name:22s} {small_name:24s}: {statistics.median(durations):6.2f} "
                  f"us (gap {statistics.median(gaps):5.2f} us; {len(durations)} pairs)",
                  flush=True)


if __name__ == "__main__":
    main()
