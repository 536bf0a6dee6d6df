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
``JITFunction`` launch instead of the cached launcher, with tensors checked by torch's
guards plus Python pointer reads or from Python alone instead of the native check, the
non-donated step of a functional loop and ``tx.update``, and prints a cProfile of the
host path. Writes ``host_step.json`` and ``host_step.md`` to ``--out``.

On the GPU machine (see benchmarks/gpu_step.py for the set-up line):

    python3 benchmarks/host_step.py --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
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
from ftopt.lowering import checks, launch, native  # noqa: E402


def _sync():
    torch.cuda.synchronize()


def measure(step, iters: int) -> dict:
    """Lists of host, latency and busy-GPU host times (us) of ``iters`` calls."""
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
    for _ in range(max(1, iters // 4)):
        # The call while the GPU still has ~2 ms of queued work (as after a backward):
        # a step that waited on the queue would show it here.
        _sync()
        torch.cuda._sleep(4_000_000)
        t0 = time.perf_counter()
        step()
        busy.append((time.perf_counter() - t0) * 1e6)
    return {"host": host, "latency": latency, "busy": busy}


def summarize(name: str, samples: dict) -> dict:
    host, busy, latency = samples["host"], samples["busy"], samples["latency"]
    q = lambda xs, f: sorted(xs)[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
    return {"name": name, "host_us": statistics.median(host), "host_us_p10": q(host, 0.1),
            "host_us_p90": q(host, 0.9), "host_busy_us": statistics.median(busy),
            "host_busy_us_p90": q(busy, 0.9), "latency_us": statistics.median(latency),
            "n": len(host)}


@contextlib.contextmanager
def generic_launch():
    """Triton's ``JITFunction`` launch on every call (no cached compiled kernel)."""
    saved = launch._DIRECT, launch._COMPILED
    launch._DIRECT, launch._COMPILED = False, {}
    try:
        yield
    finally:
        launch._DIRECT, launch._COMPILED = saved


@contextlib.contextmanager
def tensor_checks(native: bool, guards: bool):
    """How cached steps check their tensors (see ftopt/lowering/checks.py); the choice is
    made when the tables are built: the warm-up runs under it too."""
    saved = checks.USE_NATIVE, checks.USE_GUARDS
    checks.USE_NATIVE, checks.USE_GUARDS = native, guards
    try:
        yield
    finally:
        checks.USE_NATIVE, checks.USE_GUARDS = saved


def guard_checks():
    return tensor_checks(native=False, guards=True)


def python_checks():
    return tensor_checks(native=False, guards=False)


def ftopt_runner(params, grad_sets, tx, mode: str = "donate"):
    """``mode``: "donate" (in place), "functional" (donate=False: new params and states
    each call, fed back) or "update" (``tx.update``: new updates and states)."""
    box = [{k: v.clone() for k, v in params.items()}, None]
    box[1] = tx.init(box[0])
    i = [0]

    def step():
        g = grad_sets[i[0] % len(grad_sets)]
        i[0] += 1
        if mode == "update":
            _, box[1] = tx.update(g, box[1], box[0])
        else:
            box[0], box[1] = ftopt.step(tx, box[0], g, box[1], donate=mode == "donate")

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
    ap.add_argument("--iters", type=int, default=400, help="timed calls per variant")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--grad-sets", type=int, default=4)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    t0 = time.perf_counter()
    native.module(wait=True)  # built once per torch version, then cached on disk
    print(f"native check: {native.status()} ({time.perf_counter() - t0:.1f} s)", flush=True)
    shapes = gpt2_shapes(50257, 768, 1024, 12)
    params = random_tree(shapes, torch.float32, device, 0, 0.02)
    grad_sets = [random_tree(shapes, torch.float32, device, 1 + j, 1e-3)
                 for j in range(args.grad_sets)]
    same, new = grad_sets[:1], grad_sets
    none = contextlib.nullcontext
    variants = [  # name, step, context of its calls
        ("ftopt fused, same grads", ftopt_runner(params, same, ftopt.adam(1e-3)), none),
        ("ftopt fused, new grad tensors each step", ftopt_runner(params, new,
                                                                 ftopt.adam(1e-3)), none),
        ("torch Adam fused, same grads", torch_runner(params, same), none),
        ("torch Adam fused, new grad tensors each step", torch_runner(params, new), none),
        ("ftopt fused, same grads, generic Triton launch",
         ftopt_runner(params, same, ftopt.adam(1e-3)), generic_launch),
        ("ftopt fused, same grads, torch guards + Python pointers (no native check)",
         ftopt_runner(params, same, ftopt.adam(1e-3)), guard_checks),
        ("ftopt fused, new grads, torch guards + Python pointers (no native check)",
         ftopt_runner(params, new, ftopt.adam(1e-3)), guard_checks),
        ("ftopt fused, new grads, checks in Python",
         ftopt_runner(params, new, ftopt.adam(1e-3)), python_checks),
        ("ftopt fused donate=False (functional loop), new grads",
         ftopt_runner(params, new, ftopt.adam(1e-3), "functional"), none),
        ("ftopt fused tx.update, new grads",
         ftopt_runner(params, new, ftopt.adam(1e-3), "update"), none),
    ]
    for _, step, ctx in variants:
        with ctx():
            for _ in range(10):
                step()
    _sync()
    samples = {name: {"host": [], "latency": [], "busy": []} for name, _, _ in variants}
    per_round = max(1, args.iters // args.rounds)
    gc.disable()  # a collection inside one call would land on whichever variant ran
    try:
        for _ in range(args.rounds):  # interleaved: drift of the host hits all alike
            for name, step, ctx in variants:
                with ctx():
                    for key, values in measure(step, per_round).items():
                        samples[name][key] += values
    finally:
        gc.enable()
    rows = [summarize(name, samples[name]) for name, _, _ in variants]
    for r in rows:
        print(f"{r['name']}: host {r['host_us']:.1f} us (p10 {r['host_us_p10']:.1f}), busy "
              f"{r['host_busy_us']:.1f} us, latency {r['latency_us']:.1f} us", flush=True)
    profiles = {name: profile(step, 100) for name, step, _ in variants[:2]}
    for name, text in profiles.items():
        print(f"\n== cProfile, 100 steps: {name}\n{text}")
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(), "iters": args.iters,
            "grad_sets": args.grad_sets, "leaves": len(shapes),
            "native_check": native.status()[:500],
            "command": "python3 benchmarks/host_step.py --out DIR"}
    (args.out / "host_step.json").write_text(json.dumps({"meta": meta, "rows": rows,
                                                         "profiles": profiles}, indent=1))
    md = [f"# host cost of one step, GPT-2-small tree ({len(shapes)} leaves), fp32 Adam", "",
          f"- date: {meta['date']}; device: {meta['device']}; torch {meta['torch']}", "",
          f"- native tensor check: {meta['native_check']}", "",
          f"- {args.rounds} interleaved rounds, {rows[0]['n']} calls per variant, gc off "
          "while timing", "",
          "| variant | host us (median) | p10 | p90 | host us, GPU busy (median / p90)"
          " | latency us (median) |",
          "| --- | --- | --- | --- | --- | --- |"]
    md += [f"| {r['name']} | {r['host_us']:.1f} | {r['host_us_p10']:.1f} | "
           f"{r['host_us_p90']:.1f} | {r['host_busy_us']:.1f} / {r['host_busy_us_p90']:.1f} | "
           f"{r['latency_us']:.1f} |" for r in rows]
    (args.out / "host_step.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
