"""Host cost of ``ftopt.step`` for a single-process user once ``torch.distributed.tensor``
is imported (Trainer, Lightning and many libraries import it), on the CPU.

A step must send trees holding ``DTensor`` leaves to the distributed backend; finding
them means flattening params and grads. This script times a donated fused step over a
148-leaf tree with the kernel launch stubbed (only the host path is timed), in two fresh
processes: without and with ``import torch.distributed.tensor``. The difference is what
the DTensor lookup costs a step. Kernels run in the Triton interpreter for the first
(untimed) step.

    .venv/bin/python benchmarks/dtensor_scan.py --out DIR

Prints a table and writes ``dtensor_scan.json`` and ``dtensor_scan.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

_CHILD = """
import os, sys, timeit
import torch
if sys.argv[1] == "1":
    import torch.distributed.tensor  # noqa: F401
import ftopt
from ftopt.lowering import execute
torch.manual_seed(0)
params = {f"l{i}": torch.randn(8) for i in range(148)}
grads = {k: torch.randn(8) for k in params}
tx = ftopt.adam(1e-3)
state = tx.init(params)
params, state = ftopt.step(tx, params, grads, state, donate=True, backend="fused")
execute.PreparedStep.launch = lambda self, *args: None
def call():
    ftopt.step(tx, params, grads, state, donate=True, backend="fused")
times = timeit.repeat(call, number=int(sys.argv[2]), repeat=5)
print(min(times) / int(sys.argv[2]) * 1e6)
"""


def measure(imported: bool, number: int) -> float:
    """Microseconds per step (min over 5 repeats of ``number`` calls), in a fresh process."""
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    out = subprocess.run([sys.executable, "-c", _CHILD, "1" if imported else "0",
                          str(number)], env=env, check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--number", type=int, default=2000)
    args = parser.parse_args()
    rows = {"plain": measure(False, args.number),
            "torch.distributed.tensor imported": measure(True, args.number)}
    rows["difference"] = rows["torch.distributed.tensor imported"] - rows["plain"]
    lines = ["| donated fused step, 148 leaves, launch stubbed | us per step |",
             "| --- | ---: |"] + [f"| {k} | {v:.2f} |" for k, v in rows.items()]
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dtensor_scan.json").write_text(json.dumps(rows, indent=1))
    (args.out / "dtensor_scan.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
