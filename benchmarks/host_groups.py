"""Host time of ``ftopt.Optimizer.step`` with two param groups, joined or group by group.

The GPT-2 tree (148 leaves; small widths: only the host work is measured) in two groups,
AdamW with weight decay 0.1 for matrices and 0.0 for biases and norms, fused and
donated, against the same leaves in one AdamW group. The kernel launch is stubbed
(the step counts still advance), so the numbers
are the Python work of a step: one partition over both groups (one launch per dtype
group), against the groups stepped one by one (one launch each). Runs on the CPU
(``TRITON_INTERPRET=1``, set here) or a GPU:

    python3 benchmarks/host_groups.py --out DIR

Writes ``host_groups.json`` and ``host_groups.md`` to ``DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_step import gpt2_shapes  # noqa: E402
from timing import host_us  # noqa: E402

import ftopt  # noqa: E402
from ftopt.lowering import execute  # noqa: E402
from ftopt.lowering.counts import increment  # noqa: E402


def _optimizer(device: str, joined: bool, single: bool = False) -> ftopt.Optimizer:
    gen = torch.Generator().manual_seed(0)
    params = {}
    for name, shape in gpt2_shapes(vocab=64, d=16, ctx=32, n_layer=12).items():
        p = torch.nn.Parameter(torch.randn(shape, generator=gen).to(device))
        p.grad = torch.randn(shape, generator=gen).to(device)
        params[name] = p
    groups = [{"params": [(n, p) for n, p in params.items() if p.ndim > 1],
               "weight_decay": 0.1},
              {"params": [(n, p) for n, p in params.items() if p.ndim <= 1],
               "weight_decay": 0.0}]
    if single:  # the reference: every leaf in one group
        groups = [{"params": groups[0]["params"] + groups[1]["params"],
                   "weight_decay": 0.1}]
    opt = ftopt.Optimizer(groups, ftopt.adamw, lr=1e-3, backend="fused")
    if not joined:
        opt._joiner.step = lambda *args, **kwargs: None
    return opt


def measure(opt: ftopt.Optimizer, iters: int, warmup: int = 5) -> list[float]:
    """Host time per ``opt.step()`` (us), ``iters`` times after ``warmup`` steps."""
    return host_us(opt.step, iters, warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    launches = []
    # The stub: no kernel, the counts advance as the kernel would advance them.
    execute.PreparedStep.launch = lambda self, scalars, pairs: (
        launches.append(1), increment(pairs))
    rows: dict = {}
    for name, joined, single in (("one group (reference)", True, True),
                                 ("joined (one partition)", True, False),
                                 ("group by group", False, False)):
        opt = _optimizer(device, joined, single)
        leaves = sum(len(g["params"]) for g in opt.param_groups)
        launches.clear()
        times = measure(opt, args.iters)
        rows[name] = {"leaves": leaves, "groups": len(opt.param_groups),
                      "launches_per_step": len(launches) / (args.iters + 5),
                      "median_us": statistics.median(times), "min_us": min(times)}
    lines = [f"Host time of ftopt.Optimizer.step, GPT-2 tree, two AdamW groups, launch "
             f"stubbed, {device} (torch {torch.__version__})", "",
             "| path | leaves | launches/step | median us | min us |",
             "| --- | --- | --- | --- | --- |"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['leaves']} | {row['launches_per_step']:.0f} | "
                     f"{row['median_us']:.0f} | {row['min_us']:.0f} |")
    extra = (rows["joined (one partition)"]["median_us"]
             - rows["one group (reference)"]["median_us"])
    lines += ["", f"joined two groups cost {extra:+.0f} us per step over one group"]
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_groups.json").write_text(json.dumps(
        {"device": device, "torch": torch.__version__, "rows": rows,
         "joined_minus_one_group_us": extra}, indent=2))
    (args.out / "host_groups.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
