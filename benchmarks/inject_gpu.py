"""``ftopt.step`` of ``inject_hyperparams(adam)`` against the plain ``adam`` chain, on a GPU.

Both run the same fused kernel; what the wrapper adds is host work (loading the state's
hyperparameters, advancing its count and schedules) and, for values not known on the host,
a scalar buffer computed on the device. Rows, on the GPT-2-small tree (148 leaves):

* ``adam``: the plain chain, float hyperparameters;
* ``inject``: ``inject_hyperparams(adam)(learning_rate, b1)``, values known on the host;
* ``inject, schedule``: ``learning_rate`` a ``warmup_cosine_decay_schedule``;
* ``inject, changed in place``: ``state.hyperparams["learning_rate"].fill_(...)`` before
  every step (read on the device: the buffer-scalar kernel variant).

Each row is timed donated and not: the host time of the call (median, us) and the
latency (sync, call, sync). It also checks that every row ran fused (``backend="fused"``
raises otherwise) and counts compiled kernel modules after warm-up (must stay constant).
Writes ``inject_gpu.json`` and ``inject_gpu.md`` to ``--out``.

    python3 benchmarks/inject_gpu.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_step import gpt2_shapes, random_tree  # noqa: E402

import ftopt  # noqa: E402
from ftopt.lowering import kernel_files  # noqa: E402


def _time(step, iters: int) -> tuple[float, float]:
    host, latency = [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append((t1 - t0) * 1e6)
        latency.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(host), statistics.median(latency)


def _cases() -> dict:
    schedule = ftopt.warmup_cosine_decay_schedule(0.0, 1e-3, 100, 10_000)
    return {
        "adam": (ftopt.adam(1e-3, b1=0.9), None),
        "inject": (ftopt.inject_hyperparams(ftopt.adam)(learning_rate=1e-3, b1=0.9), None),
        "inject, schedule": (ftopt.inject_hyperparams(ftopt.adam)(
            learning_rate=schedule, b1=0.9), None),
        "inject, changed in place": (ftopt.inject_hyperparams(ftopt.adam)(
            learning_rate=1e-3, b1=0.9), "fill"),
    }


def run(iters: int, warmup: int) -> list[dict]:
    device = torch.device("cuda")
    shapes = gpt2_shapes(50257, 768, 1024, 12)
    grads = random_tree(shapes, torch.float32, device, 1, 1e-3)
    rows = []
    for name, (tx, change) in _cases().items():
        for donate in (False, True):
            box = {"p": random_tree(shapes, torch.float32, device, 0, 0.02)}
            box["s"] = tx.init(box["p"])

            def step(tx=tx, box=box, donate=donate, change=change):
                if change == "fill":
                    box["s"].hyperparams["learning_rate"].fill_(1e-3)
                box["p"], box["s"] = ftopt.step(tx, box["p"], grads, box["s"],
                                                donate=donate, backend="fused")

            for _ in range(warmup):
                step()
            modules = len(kernel_files._MODULES)
            host, latency = _time(step, iters)
            rows.append({"case": name, "donate": donate, "host_us": round(host, 1),
                         "latency_us": round(latency, 1),
                         "compiled_after_warmup": len(kernel_files._MODULES) - modules})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("inject_gpu.py needs a CUDA GPU", file=sys.stderr)
        return 1
    rows = run(args.iters, args.warmup)
    lines = ["| case | donated | host us | latency us | compiled after warm-up |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['case']} | {r['donate']} | {r['host_us']} | {r['latency_us']} | "
              f"{r['compiled_after_warmup']} |" for r in rows]
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "inject_gpu.json").write_text(json.dumps({
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "rows": rows}, indent=2))
    (args.out / "inject_gpu.md").write_text(
        f"# inject_hyperparams vs adam, ftopt.step fused ({torch.cuda.get_device_name()})"
        f"\n\n`python3 benchmarks/inject_gpu.py --out DIR`\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
