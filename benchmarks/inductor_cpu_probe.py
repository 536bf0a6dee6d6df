"""A probe, not a backend: how fast would an AdamW step be on the CPU if its rule were
compiled by ``torch.compile`` (inductor's C++ kernels) instead of run as torch ops?

One flat fp32 tensor of 10.13M elements (the size of ``eager_cpu.py``'s GPT-2 tree):
AdamW written as out-of-place torch ops and compiled, against torch's fused CPU AdamW
and foreach AdamW on the same tensor, and ``ftopt.step(adamw, donate=True)`` (eager,
chunked). Prints the medians and the compile time; writes nothing.

    .venv/bin/python benchmarks/inductor_cpu_probe.py [--iters 20]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

try:
    import ftopt
except ImportError:  # run from a checkout without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import ftopt

sys.path[:0] = [str(Path(__file__).resolve().parent)]
from timing import median_host_ms  # noqa: E402

N = 10_130_000
HP = dict(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=0.01)


def adamw_ops(p, g, m, v, lr, b1, b2, eps, wd, bc1, bc2_sqrt):
    m2 = m + (g - m) * (1 - b1)
    v2 = v * b2 + g * g * (1 - b2)
    p2 = p * (1 - lr * wd) - (lr / bc1) * m2 / (v2.sqrt() / bc2_sqrt + eps)
    p.copy_(p2)
    m.copy_(m2)
    v.copy_(v2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    m, v = torch.zeros(N), torch.zeros(N)
    scalars = (HP["lr"], HP["b1"], HP["b2"], HP["eps"], HP["wd"], 0.1, 0.03)
    compiled = torch.compile(adamw_ops, dynamic=False)
    t0 = time.perf_counter()
    compiled(p, g, m, v, *scalars)
    compile_s = time.perf_counter() - t0
    rows = [("torch.compile(AdamW ops), inductor C++", lambda: compiled(p, g, m, v, *scalars))]
    for kind in ("fused", "foreach"):
        w = torch.nn.Parameter(p.clone())
        w.grad = g.clone()
        opt = torch.optim.AdamW([w], lr=HP["lr"], weight_decay=HP["wd"], **{kind: True})
        rows.append((f"torch.optim.AdamW({kind}=True)", opt.step))
    tx = ftopt.adamw(HP["lr"], weight_decay=HP["wd"])
    box = {"p": {"w": p.clone()}}
    box["s"] = tx.init(box["p"])
    grads = {"w": g.clone()}

    def ftopt_step():
        box["p"], box["s"] = ftopt.step(tx, box["p"], grads, box["s"], donate=True,
                                        backend="eager")
    rows.append(("ftopt.step(adamw, eager, donate=True)", ftopt_step))
    print(f"compile: {compile_s:.1f} s (first call, cold cache)")
    print(f"| step, one {N / 1e6:.2f}M fp32 tensor, {args.threads} threads | median ms |")
    print("| --- | ---: |")
    for name, fn in rows:
        print(f"| {name} | {median_host_ms(fn, args.iters):.2f} |")


if __name__ == "__main__":
    main()
