"""Param groups on the GPU: the GPT-2 small AdamW recipe with no decay for biases and norms.

Times a whole donated ``ftopt.step`` (and ``ftopt.Optimizer.step``) of:

* ``single``: one group, ``adamw(lr, weight_decay=0.1)`` on every leaf (the baseline);
* ``partition``: ``partition({"decay": adamw(wd=0.1), "no_decay": adamw(wd=0)}, labels)``;
* ``masked``: ``chain(scale_by_adam, masked(add_decayed_weights(0.1), mask), lr)``;
* ``mask=``: ``adamw(lr, weight_decay=0.1, mask=mask)`` (the rule's own mask);
* ``Optimizer x1`` / ``Optimizer x2``: ``ftopt.Optimizer`` with one group, and with the
  two torch-style groups (decay / no decay).

Target: each two-group variant within 2% of ``single``. "kernel" is GPU time between
CUDA events around each step, "call" a synchronised call timed whole (host included).

    python3 benchmarks/groups_gpu.py --out benchmarks/results/groups_h200
    TRITON_INTERPRET=1 python3 benchmarks/groups_gpu.py --small --out /tmp/groups  # CPU check
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_step import gpt2_shapes, random_tree  # noqa: E402
from timing import Clock  # noqa: E402

import ftopt  # noqa: E402

LR = 3e-4


def _no_decay(name: str) -> bool:
    return name.endswith(".bias") or ".ln_" in name or "ln_f" in name


def variants(params: dict) -> dict:
    mask = {k: not _no_decay(k) for k in params}
    labels = {k: "decay" if m else "no_decay" for k, m in mask.items()}
    return {
        "single": ftopt.adamw(LR, weight_decay=0.1),
        "partition": ftopt.partition({"decay": ftopt.adamw(LR, weight_decay=0.1),
                                      "no_decay": ftopt.adamw(LR, weight_decay=0.0)}, labels),
        "masked": ftopt.chain(ftopt.scale_by_adam(),
                              ftopt.masked(ftopt.add_decayed_weights(0.1), mask),
                              ftopt.scale_by_learning_rate(LR)),
        "mask=": ftopt.adamw(LR, weight_decay=0.1, mask=mask),
    }


def step_runner(tx, params: dict, grads: dict, backend: str):
    box = [{k: v.clone() for k, v in params.items()}, None]
    box[1] = tx.init(box[0])

    def step():
        box[0], box[1] = ftopt.step(tx, box[0], grads, box[1], donate=True, backend=backend)
    return step


def optimizer_runner(params: dict, grads: dict, groups: int, backend: str):
    tensors = {k: v.clone() for k, v in params.items()}
    for k, t in tensors.items():
        t.grad = grads[k]
    if groups == 1:
        spec = [{"params": list(tensors.values()), "param_names": list(tensors)}]
    else:
        names = {True: [k for k in tensors if not _no_decay(k)],
                 False: [k for k in tensors if _no_decay(k)]}
        spec = [{"params": [tensors[k] for k in names[d]], "param_names": names[d],
                 "weight_decay": 0.1 if d else 0.0} for d in (True, False)]
    opt = ftopt.Optimizer(spec, ftopt.adamw, lr=LR, weight_decay=0.1, backend=backend)
    return opt.step


def measure(fn, clock: Clock, warmup: int, iters: int) -> dict:
    for _ in range(warmup):
        fn()
    kernel = clock.time_steps(fn, iters)
    call = clock.call(fn, iters)
    return {"kernel_ms": statistics.median(kernel), "call_ms": statistics.median(call)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for groups.json / groups.md")
    parser.add_argument("--small", action="store_true",
                        help="a tiny model and few steps (a CPU check under TRITON_INTERPRET=1)")
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = "fused" if device.type == "cpu" else "auto"
    shapes = (gpt2_shapes(64, 16, 8, 1) if args.small else gpt2_shapes(50257, 768, 1024, 12))
    iters, warmup = (3, 1) if args.small else (args.iters, 20)
    params = random_tree(shapes, torch.float32, device, 0, 0.02)
    grads = random_tree(shapes, torch.float32, device, 1, 1e-3)
    clock = Clock(device)
    rows = {}
    for name, tx in variants(params).items():
        text = ftopt.explain(tx, params, grads, donate=True, backend=backend,
                             file=io.StringIO())
        launches = [int(line.split(":")[1].split()[0]) for line in text.splitlines()
                    if "kernel launches per step" in line]
        rows[name] = {**measure(step_runner(tx, params, grads, backend), clock, warmup, iters),
                      "launches": sum(launches), "fused": "path: eager" not in text}
    for groups in (1, 2):
        rows[f"Optimizer x{groups}"] = {
            **measure(optimizer_runner(params, grads, groups, backend), clock, warmup, iters),
            "launches": None, "fused": None}
    base = rows["single"]
    lines = [f"GPT-2 {'(small test shapes) ' if args.small else ''}AdamW param groups, "
             f"{sum(t.numel() for t in params.values())} params, {len(params)} leaves, "
             f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}",
             "", "| variant | fused | launches | kernel ms | call ms | kernel / single | "
             "call / single |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in rows.items():
        ref = rows["Optimizer x1"] if name.startswith("Optimizer") else base
        lines.append(f"| {name} | {r['fused']} | {r['launches']} | {r['kernel_ms']:.3f} | "
                     f"{r['call_ms']:.3f} | {r['kernel_ms'] / ref['kernel_ms']:.3f} | "
                     f"{r['call_ms'] / ref['call_ms']:.3f} |")
    table = "\n".join(lines)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "groups.json"), "w") as f:
        json.dump({"rows": rows, "small": args.small, "device": str(device),
                   "torch": torch.__version__}, f, indent=1)
    with open(os.path.join(args.out, "groups.md"), "w") as f:
        f.write(table + "\n\nCommand: python3 benchmarks/groups_gpu.py"
                + (" --small" if args.small else "") + f" --out {args.out}\n")


if __name__ == "__main__":
    main()
