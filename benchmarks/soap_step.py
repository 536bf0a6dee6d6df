"""One step of the matrix optimizers (SOAP, NorMuon, Muon) against AdamW's, on a
GPT-2-like tree of a given width: a table of median step times, written as JSON.

    python benchmarks/soap_step.py                      # CPU, width 64, 12 layers
    python benchmarks/soap_step.py --device cuda --width 768 --out results/soap_h200.json

SOAP's step refines its bases every ``precondition_frequency`` (10) steps: the median
over 20 steps holds the plain steps, ``max`` the refinements.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import ftopt


def tree(width: int, layers: int, device: str) -> dict:
    out = {}
    for i in range(layers):
        out[f"h{i}.qkv"] = torch.randn(width, 3 * width, device=device)
        out[f"h{i}.proj"] = torch.randn(width, width, device=device)
        out[f"h{i}.fc"] = torch.randn(width, 4 * width, device=device)
        out[f"h{i}.fc2"] = torch.randn(4 * width, width, device=device)
        out[f"h{i}.ln"] = torch.randn(width, device=device)
    return out


def time_steps(tx, params: dict, steps: int, device: str) -> list[float]:
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    state = tx.init(params)
    for _ in range(3):
        params, state = ftopt.step(tx, params, grads, state)
    times = []
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        params, state = ftopt.step(tx, params, grads, state)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.device == "cpu":
        torch.set_num_threads(1)
    params = tree(args.width, args.layers, args.device)
    cases = {"adamw": lambda: ftopt.adamw(1e-3, weight_decay=0.1),
             "muon": lambda: ftopt.muon(1e-3, weight_decay=0.1),
             "normuon": lambda: ftopt.normuon(1e-3, weight_decay=0.1),
             "soap": lambda: ftopt.soap(1e-3, weight_decay=0.1)}
    rows = []
    for name, make in cases.items():
        times = sorted(time_steps(make(), params, args.steps, args.device))
        rows.append({"optimizer": name, "median_ms": 1e3 * times[len(times) // 2],
                     "max_ms": 1e3 * times[-1]})
    base = rows[0]["median_ms"]
    n = sum(p.numel() for p in params.values())
    print(f"{len(params)} leaves, {n} elements, {args.device}, width {args.width}")
    print("| optimizer | median ms | max ms | x adamw |")
    print("| --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['optimizer']} | {r['median_ms']:.2f} | {r['max_ms']:.2f} | "
              f"{r['median_ms'] / base:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": args.device, "width": args.width, "layers": args.layers,
                       "leaves": len(params), "elements": n, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
