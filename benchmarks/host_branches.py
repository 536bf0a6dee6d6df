"""Host time and launches of a ``partition`` whose branches differ in their rules.

The GPT-2 tree (148 leaves; small widths: only the host work is measured), AdamW
(weight decay 0.1) on the matrices and Lion on the other leaves, a donated fused step
with the kernel launch stubbed (the step counts still advance): the partition as one
``ftopt.step``, against each branch stepped on its own leaves (one ``ftopt.step`` and
launch per branch). Runs on the CPU (``TRITON_INTERPRET=1``, set here) or a GPU:

    python3 benchmarks/host_branches.py --out DIR

Writes ``host_branches.json`` and ``host_branches.md`` to ``DIR``.
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


def _tree(device: str) -> tuple[dict, dict]:
    gen = torch.Generator().manual_seed(0)
    shapes = gpt2_shapes(vocab=64, d=16, ctx=32, n_layer=12)
    params = {k: torch.randn(s, generator=gen).to(device) for k, s in shapes.items()}
    grads = {k: torch.randn(s, generator=gen).to(device) for k, s in shapes.items()}
    return params, grads


def _branches() -> dict:
    return {"adamw": ftopt.adamw(1e-3, weight_decay=0.1), "lion": ftopt.lion(1e-4)}


def _label(tree: dict) -> dict:
    return {k: "adamw" if v.ndim > 1 else "lion" for k, v in tree.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    launches: list = []
    execute.PreparedStep.launch = lambda self, scalars, pairs, *rest: (
        launches.append(1), increment(pairs))
    params, grads = _tree(device)
    rows: dict = {}

    tx = ftopt.partition(_branches(), _label(params))
    state = [tx.init(params)]

    def joined():
        _, state[0] = ftopt.step(tx, params, grads, state[0], donate=True, backend="fused")

    labels = _label(params)
    parts = {name: ({k: v for k, v in params.items() if labels[k] == name},
                    {k: v for k, v in grads.items() if labels[k] == name}, t)
             for name, t in _branches().items()}
    states = {name: p[2].init(p[0]) for name, p in parts.items()}

    def apart():
        for name, (p, g, t) in parts.items():
            _, states[name] = ftopt.step(t, p, g, states[name], donate=True, backend="fused")

    for name, fn in (("one partition", joined), ("branch by branch", apart)):
        launches.clear()
        try:
            times = host_us(fn, args.iters)
        except RuntimeError as err:  # a partition that cannot fuse
            rows[name] = {"error": str(err)}
            continue
        rows[name] = {"leaves": len(params),
                      "launches_per_step": len(launches) / (args.iters + 5),
                      "median_us": statistics.median(times), "min_us": min(times)}
    lines = [f"Host time of a partition {{AdamW on matrices, Lion elsewhere}}, GPT-2 tree, "
             f"launch stubbed, {device} (torch {torch.__version__})", "",
             "| path | leaves | launches/step | median us | min us |",
             "| --- | --- | --- | --- | --- |"]
    for name, row in rows.items():
        if "error" in row:
            lines.append(f"| {name} | - | does not fuse: {row['error'][:80]} | - | - |")
        else:
            lines.append(f"| {name} | {row['leaves']} | {row['launches_per_step']:.0f} | "
                         f"{row['median_us']:.0f} | {row['min_us']:.0f} |")
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_branches.json").write_text(json.dumps(
        {"device": device, "torch": torch.__version__, "rows": rows}, indent=2))
    (args.out / "host_branches.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
