"""Host cost of one ``ftopt.step`` call on the GPT-2-small tree (148 leaves), on a GPU.

The fused kernels launch asynchronously, so what a step costs the training loop is the
host work of the call whenever the GPU is busy, and host work + kernel time when it is
not. This script measures, for ftopt (Adam, fused, donated) and torch.optim.Adam:

* ``host``: sync, then ``perf_counter`` around the call (median over ``--iters``);
* ``latency``: sync, call, sync: the whole step as a caller waiting on it sees it;
* ``host, GPU busy``: the host time of a call made while ~2 ms of work is still queued
  on the GPU (as after a backward pass): a call that waits on the queue shows it here;

in two gradient scenarios: the same gradient tensors every step (``zero_grad`` keeping
the buffers, or a persistent gradient tree), and new gradient tensors every step (cycling
through ``--grad-sets`` pre-made trees, as ``zero_grad(set_to_none=True)`` or a
``torch.func.grad`` loop give). For ftopt it also times the step with Triton's generic
``JITFunction`` launch instead of the cached launcher, and prints a cProfile of the
host path. Writes ``host_step.json`` and ``host_step.md`` to ``--out``.

On the GPU machine (see benchmarks/gpu_step.py for the set-up line):

    python3 benchmarks/host_step.py --out $OUT
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_step import gpt2_shapes, random_tree  # noqa: E402

import ftopt  # noqa: E402
from ftopt.lowering import launch  # noqa: E402


def _sync():
    torch.cuda.synchronize()


def measure(step, iters: int) -> dict:
    host, latency, busy = [], [], []
    for _ in range(iters):
        _sync()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        _sync()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e6)
        latency.append((t2 - t0) * 1e6)
    for _ in range(iters // 4):
        # The call while the GPU still has ~2 ms of queued work (as after a backward):
        # a step that waited on the queue would show it here.
        _sync()
        torch.cuda._sleep(4_000_000)
        t0 = time.perf_counter()
        step()
        busy.append((time.perf_counter() - t0) * 1e6)
    return {"host_us": statistics.median(host), "host_us_min": min(host),
            "latency_us": statistics.median(latency), "latency_us_min": min(latency),
            "host_busy_us": statistics.median(busy), "host_busy_us_max": max(busy)}


def ftopt_runner(params, grad_sets, tx):
    box = [{k: v.clone() for k, v in params.items()}, None]
    box[1] = tx.init(box[0])
    i = [0]

    def step():
        g = grad_sets[i[0] % len(grad_sets)]
        i[0] += 1
        box[0], box[1] = ftopt.step(tx, box[0], g, box[1], donate=True)

    return step


def torch_runner(params, grad_sets):
    ps = [torch.nn.Parameter(v.clone()) for v in params.values()]
    opt = torch.optim.Adam(ps, lr=1e-3, fused=True)
    keys = list(params)
    i = [0]

    def step():
        g = grad_sets[i[0] % len(grad_sets)]
        i[0] += 1
        if len(grad_sets) > 1 or ps[0].grad is None:
            for p, k in zip(ps, keys):
                p.grad = g[k]
        opt.step()

    return step


def profile(step, n: int) -> str:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        step()
    pr.disable()
    _sync()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(18)
    return out.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--grad-sets", type=int, default=4)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    shapes = gpt2_shapes(50257, 768, 1024, 12)
    params = random_tree(shapes, torch.float32, device, 0, 0.02)
    grad_sets = [random_tree(shapes, torch.float32, device, 1 + j, 1e-3)
                 for j in range(args.grad_sets)]
    rows = []
    variants = [
        ("ftopt fused, same grads", lambda: ftopt_runner(params, grad_sets[:1],
                                                         ftopt.adam(1e-3))),
        ("ftopt fused, new grad tensors each step",
         lambda: ftopt_runner(params, grad_sets, ftopt.adam(1e-3))),
        ("torch Adam fused, same grads", lambda: torch_runner(params, grad_sets[:1])),
        ("torch Adam fused, new grad tensors each step",
         lambda: torch_runner(params, grad_sets)),
    ]
    profiles = {}
    for name, make in variants:
        step = make()
        for _ in range(10):
            step()
        _sync()
        row = {"name": name, **measure(step, args.iters)}
        if name.startswith("ftopt"):
            profiles[name] = profile(step, 100)
        rows.append(row)
        print(f"{name}: host {row['host_us']:.1f} us, latency {row['latency_us']:.1f} us",
              flush=True)
        del step
    # The same step through Triton's generic launch (JITFunction.__call__ every time).
    direct, compiled = launch._DIRECT, dict(launch._COMPILED)
    launch._DIRECT = False
    launch._COMPILED.clear()
    try:
        step = ftopt_runner(params, grad_sets[:1], ftopt.adam(1e-3))
        for _ in range(10):
            step()
        row = {"name": "ftopt fused, same grads, generic Triton launch",
               **measure(step, args.iters)}
    finally:
        launch._DIRECT = direct
        launch._COMPILED.update(compiled)
    rows.append(row)
    print(f"{row['name']}: host {row['host_us']:.1f} us, latency {row['latency_us']:.1f} us")
    # New gradient addresses uploaded from pageable memory instead of a pinned buffer.
    pinned = launch.to_device
    launch.to_device = lambda values, device: torch.tensor(values, dtype=torch.int64).to(
        device, non_blocking=True)
    try:
        step = ftopt_runner(params, grad_sets, ftopt.adam(1e-3))
        for _ in range(10):
            step()
        row = {"name": "ftopt fused, new grad tensors each step, pageable address upload",
               **measure(step, args.iters)}
    finally:
        launch.to_device = pinned
    rows.append(row)
    print(f"{row['name']}: host {row['host_us']:.1f} us, busy {row['host_busy_us']:.1f} us")
    for name, text in profiles.items():
        print(f"\n== cProfile, 100 steps: {name}\n{text}")
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(), "iters": args.iters,
            "grad_sets": args.grad_sets, "leaves": len(shapes),
            "command": "python3 benchmarks/host_step.py --out DIR"}
    (args.out / "host_step.json").write_text(json.dumps({"meta": meta, "rows": rows,
                                                         "profiles": profiles}, indent=1))
    md = [f"# host cost of one step, GPT-2-small tree ({len(shapes)} leaves), fp32 Adam", "",
          f"- date: {meta['date']}; device: {meta['device']}; torch {meta['torch']}", "",
          "| variant | host us (median) | host us (min) | host us, GPU busy (median / max)"
          " | latency us (median) |",
          "| --- | --- | --- | --- | --- |"]
    md += [f"| {r['name']} | {r['host_us']:.1f} | {r['host_us_min']:.1f} | "
           f"{r['host_busy_us']:.1f} / {r['host_busy_us_max']:.1f} | {r['latency_us']:.1f} |"
           for r in rows]
    (args.out / "host_step.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
