"""Muon step time on GPT-2-small shapes: ftopt.muon vs a per-leaf torch loop of the same math.

    python3 benchmarks/muon_gpu.py --out DIR          # GPU (default sizes: GPT-2 small)
    python3 benchmarks/muon_gpu.py --quick --out DIR  # the same shapes, < 60 s on an H200
    python3 benchmarks/muon_gpu.py --small --out DIR  # CPU, a 2-layer d=64 tree, seconds

The reference loop is optax.contrib.muon written leaf by leaf (Nesterov momentum, Newton-
Schulz with (3.4445, -4.7750, 2.0315) x 5, shape scale, learning rate; AdamW with
Nesterov for the non-2-D leaves). Both are first checked to give the same params after 3
steps (Newton-Schulz in fp32 for the check; the run stops there if they differ), then
timed with the iteration dtype given by ``--ns-dtype`` (default: bf16 on CUDA, fp32 on
CPU): ``--warmup`` untimed steps, then ``--iters`` steps between two synchronisations.
``--quick`` checks 2 steps and times 5 (after 2 untimed). The trees are drawn on the
device (seeded) so that setup costs seconds, not minutes. Writes ``muon_gpu.json`` and
``muon_gpu.md`` to ``--out``. Target on an H200: ftopt >= 2x faster than the loop.

ftopt is timed on the path ``ftopt.step`` takes for a donated step (fused in segments on
a GPU: ``backend="fused"``, which raises rather than fall back; ``auto`` elsewhere), and
on the eager path for comparison; the path that ran is reported (from
``ftopt.explain``), with the kernel launches per step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import wall_ms  # noqa: E402

import ftopt  # noqa: E402

COEFFS = (3.4445, -4.7750, 2.0315)


def gpt2_shapes(vocab: int, d: int, ctx: int, n_layer: int) -> dict[str, tuple]:
    """GPT-2's parameter names and shapes (HF ``GPT2LMHeadModel``, tied head)."""
    shapes = {"wte": (vocab, d), "wpe": (ctx, d)}
    for i in range(n_layer):
        h = f"h.{i}."
        shapes.update({
            h + "ln_1.w": (d,), h + "ln_1.b": (d,), h + "attn.w": (d, 3 * d),
            h + "attn.b": (3 * d,), h + "proj.w": (d, d), h + "proj.b": (d,),
            h + "ln_2.w": (d,), h + "ln_2.b": (d,), h + "fc.w": (d, 4 * d),
            h + "fc.b": (4 * d,), h + "fc_proj.w": (4 * d, d), h + "fc_proj.b": (d,)})
    shapes.update({"ln_f.w": (d,), "ln_f.b": (d,)})
    return shapes


class LoopMuon:
    """optax.contrib.muon, one leaf at a time with plain torch ops."""

    def __init__(self, lr, beta=0.95, eps=1e-8, b1=0.9, b2=0.999, ns_dtype=torch.float32):
        self.lr, self.beta, self.eps, self.b1, self.b2 = lr, beta, eps, b1, b2
        self.ns_dtype, self.t, self.mu, self.nu = ns_dtype, 0, {}, {}

    def _ns(self, x):
        tall = x.shape[0] > x.shape[1]
        if tall:
            x = x.T
        y = (x / (x.norm() + self.eps)).to(self.ns_dtype)
        a, b, c = COEFFS
        for _ in range(5):
            gram = y @ y.T
            y = a * y + (b * gram + c * gram @ gram) @ y
        y = y.to(x.dtype)
        return y.T if tall else y

    @torch.no_grad()
    def step(self, params, grads):
        self.t += 1
        t, out = self.t, {}
        for k, p in params.items():
            g = grads[k]
            if g.dim() == 2:
                bt = self.beta
                mu = self.mu.get(k, torch.zeros_like(g)).lerp(g, 1 - bt)
                self.mu[k] = mu
                m_hat = bt * mu / (1 - bt ** (t + 1)) + (1 - bt) * g / (1 - bt**t)
                u = self._ns(m_hat) * math.sqrt(max(1.0, g.shape[1] / g.shape[0]))
            else:
                b1, b2 = self.b1, self.b2
                mu = self.mu.get(k, torch.zeros_like(g)).lerp(g, 1 - b1)
                nu = self.nu.get(k, torch.zeros_like(g)).lerp(g * g, 1 - b2)
                self.mu[k], self.nu[k] = mu, nu
                m_hat = b1 * mu / (1 - b1 ** (t + 1)) + (1 - b1) * g / (1 - b1**t)
                u = m_hat / ((nu / (1 - b2**t)).sqrt() + self.eps)
            out[k] = p - self.lr * u
        return out


def _tree(shapes, device, seed, scale=1.0):
    gen = torch.Generator(device=device).manual_seed(seed)
    return {k: scale * torch.randn(s, generator=gen, device=device) for k, s in shapes.items()}


def check_same(shapes, device, steps: int = 3, backend: str = "auto") -> float:
    """Max relative difference of the params after ``steps`` steps (fp32 iterations)."""
    params = _tree(shapes, device, 0)
    tx = ftopt.muon(0.02, ns_dtype=torch.float32)
    loop = LoopMuon(0.02)
    state, ref = tx.init(params), dict(params)
    for s in range(steps):
        grads = _tree(shapes, device, 100 + s)
        params, state = ftopt.step(tx, params, grads, state, backend=backend)
        ref = loop.step(ref, grads)
    worst = max(float((params[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in params)
    if not worst < 1e-4:  # NaN included
        raise SystemExit(f"ftopt.muon and the per-leaf loop differ after {steps} steps: "
                         f"max relative difference {worst:.3g} (>= 1e-4); not timing")
    return worst


def path_of(tx, params, grads, backend: str) -> tuple[str, str]:
    """(a short name of the path a donated step takes, ``ftopt.explain``'s text)."""
    text = ftopt.explain(tx, params, grads, donate=True, backend=backend,
                         file=open(os.devnull, "w"))
    paths = sorted({line.strip()[len("path: "):] for line in text.splitlines()
                    if line.strip().startswith("path: ")})
    launches = [line.split(":", 1)[1].strip() for line in text.splitlines()
                if "kernel launches per step" in line]
    name = "; ".join(paths) + (f"; kernel launches per step: {launches[0]}" if launches
                               else "")
    return name, text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", action="store_true", help="a tiny tree (CPU check)")
    ap.add_argument("--quick", action="store_true",
                    help="GPT-2 small shapes, a 2-step check, 5 timed steps (< 60 s on an H200)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ns-dtype", choices=["auto", "bf16", "fp32"], default="auto")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dims = (dict(vocab=256, d=64, ctx=32, n_layer=2) if args.small
            else dict(vocab=50257, d=768, ctx=1024, n_layer=12))
    iters, warmup, check_steps = args.iters, args.warmup, 3
    if args.quick or args.small:
        iters, warmup, check_steps = 5, 2, 2
    shapes = gpt2_shapes(**dims)
    torch.set_float32_matmul_precision("highest")  # no TF32 in the fp32 check
    backend = "fused" if device.type == "cuda" else "auto"
    start = time.perf_counter()
    worst = check_same(shapes, device, check_steps, backend)
    print(f"check: ftopt.muon and the per-leaf loop agree to {worst:.1e} after "
          f"{check_steps} steps ({time.perf_counter() - start:.1f} s)", flush=True)
    ns = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
          "bf16": torch.bfloat16, "fp32": torch.float32}[args.ns_dtype]
    params, grads = _tree(shapes, device, 1), _tree(shapes, device, 2)
    tx = ftopt.muon(0.02, ns_dtype=ns)
    path, explained = path_of(tx, params, grads, backend)
    print(f"ftopt path ({backend}): {path}", flush=True)
    boxes = {b: {"p": {k: v.clone() for k, v in params.items()}, "s": tx.init(params)}
             for b in (backend, "eager")}  # (ftopt donates its params)
    loop = LoopMuon(0.02, ns_dtype=ns)
    lbox = {"p": {k: v.clone() for k, v in params.items()}}

    def ftopt_step(b):
        box = boxes[b]
        box["p"], box["s"] = ftopt.step(tx, box["p"], grads, box["s"], donate=True,
                                        backend=b)

    def loop_step():
        lbox["p"] = loop.step(lbox["p"], grads)

    t_ftopt = wall_ms(lambda: ftopt_step(backend), device, iters, warmup)
    t_eager = wall_ms(lambda: ftopt_step("eager"), device, iters, warmup)
    t_loop = wall_ms(loop_step, device, iters, warmup)
    n = sum(math.prod(s) for s in shapes.values())
    matrices = [s for s in shapes.values() if len(s) == 2]
    short = "fused in segments" if path.startswith("fused") else "eager"
    rows = [(f"ftopt.muon, backend={backend!r} (ran: {short})", t_ftopt),
            ("ftopt.muon, backend='eager' (foreach ops, batched Newton-Schulz)", t_eager),
            ("per-leaf torch loop", t_loop)]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    title = (f"Muon step, {len(shapes)} leaves ({len(matrices)} matrices in "
             f"{len(set(matrices))} shapes), {n / 1e6:.1f}M params, {name}, "
             f"Newton-Schulz in {str(ns).replace('torch.', '')}")
    lines = [f"## {title}", "", "| implementation | ms / step |", "| --- | ---: |"]
    lines += [f"| {label} | {ms:.2f} |" for label, ms in rows]
    lines += ["", f"ftopt path: {path}"]
    lines += ["", f"speed-up over the loop: {t_loop / t_ftopt:.2f}x (target on an H200: "
              f">= 2x; eager ftopt: {t_loop / t_eager:.2f}x); params agree to {worst:.1e} "
              f"(relative, fp32 iterations, {check_steps} steps, backend={backend!r}); "
              f"{iters} timed steps after {warmup} untimed"]
    lines += ["", "`ftopt.explain(tx, params, grads, donate=True, backend=...)`:", "",
              "```", explained, "```"]
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "muon_gpu.md"), "w") as f:
        f.write(text + "\n\nCommand: python3 benchmarks/muon_gpu.py " +
                " ".join(sys.argv[1:]) + "\n")
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    with open(os.path.join(args.out, "muon_gpu.json"), "w") as f:
        json.dump({"title": title, "device": name, "torch": torch.__version__,
                   "ns_dtype": str(ns), "iters": iters, "warmup": warmup,
                   "check_steps": check_steps, "backend": backend, "path": path,
                   "ms_ftopt": t_ftopt, "ms_ftopt_eager": t_eager, "ms_loop": t_loop,
                   "speedup": t_loop / t_ftopt, "speedup_eager": t_loop / t_eager,
                   "max_rel_diff": worst,
                   "leaves": len(shapes), "matrices": len(matrices),
                   "matrix_shapes": len(set(matrices)), "params": n,
                   "peak_cuda_bytes": peak}, f, indent=1)

if __name__ == "__main__":
    main()
