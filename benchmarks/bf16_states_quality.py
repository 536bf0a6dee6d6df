"""Does stochastic rounding of bf16 optimizer states train better than round-to-nearest?

    python3 benchmarks/bf16_states_quality.py --out DIR            # CPU, about a minute
    python3 benchmarks/bf16_states_quality.py --out DIR --steps 500 --seeds 1   # seconds

The same model, data and seed trained with AdamW (b2 = 0.999, small steps) three ways:

* ``fp32``: fp32 states (``ftopt.adamw``);
* ``bf16 nearest``: ``state_dtype=torch.bfloat16``, each store rounded to nearest (even);
* ``bf16 stochastic``: ``state_dtype=torch.bfloat16, state_rounding="stochastic"``: each
  store adds 16 random low bits (a hash of the step, leaf, slot and element) to the fp32
  state and truncates it to bf16.

The known failure of round-to-nearest: v's per-step change (1 - b2)(g^2 - v) is below
half a bf16 ulp of v (2^-9..2^-8 of v) unless g^2 is several times v, so v stalls (it stops
growing after a few hundred steps from zero, and never decays). Reported per optimizer,
mean over seeds: final train loss (mean of the last 10% of steps), validation loss, and
the drift of v: ``shadow`` is v kept in bf16 with the fp32 run's own gradients (the
rounding alone, the same trajectory; this script's own roundings, torch's ``.to`` for
nearest and dither-then-truncate with a ``torch.Generator`` for stochastic), mean over
elements of |v_bf16 - v_fp32| / v_fp32 at the end; ``run`` compares the end v of the
bf16 run with the fp32 run's (the rounding plus the trajectories drifting apart).

Model: the MLP 2-64-64-2 of ``ftopt.demo`` on its two-spirals data (8192 training
points, 4096 validation points), batch 256, constant learning rate. Writes
``bf16_states_quality.json`` and ``.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import ftopt  # noqa: E402
from ftopt.demo import make_model, two_spirals  # noqa: E402

B1, B2, WD = 0.9, 0.999, 1e-4


def round_nearest(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 (nearest, even) -> fp32."""
    return x.to(torch.bfloat16).to(torch.float32)


def round_stochastic(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """fp32 -> bf16 by dither-then-truncate -> fp32: add 16 uniform random low bits to the
    bit pattern and drop them. NaN stays NaN; a finite value that would dither to inf keeps
    its nearest rounding; exactly representable values are unchanged."""
    bits = x.view(torch.int32)
    r = torch.randint(0, 1 << 16, x.shape, generator=gen, dtype=torch.int32)
    out = ((bits + r) & ~0xFFFF).view(torch.float32)
    keep = torch.isinf(out) & torch.isfinite(x)
    out = torch.where(keep, round_nearest(x), out)
    return torch.where(torch.isnan(x), x, out)


def _adam_state(state):
    return next(s for s in state if hasattr(s, "nu"))


def train(mode: str, seed: int, steps: int, lr: float, data, val, shadow: bool) -> dict:
    """One run; ``mode``: fp32, nearest or stochastic."""
    torch.manual_seed(seed)
    model = make_model()
    x, y = data
    xv, yv = val
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def loss_fn(p, xb, yb):
        return nn.functional.cross_entropy(torch.func.functional_call(model, p, (xb,)), yb)

    grad_fn = torch.func.grad_and_value(loss_fn)
    store = None if mode == "fp32" else torch.bfloat16
    tx = ftopt.adamw(lr, b1=B1, b2=B2, weight_decay=WD, state_dtype=store,
                     state_rounding="nearest" if mode == "fp32" else mode)
    state = tx.init(params)
    batch_gen = torch.Generator().manual_seed(1000 + seed)
    round_gen = torch.Generator().manual_seed(2000 + seed)
    shadows = {"nearest": {k: torch.zeros_like(v) for k, v in params.items()},
               "stochastic": {k: torch.zeros_like(v) for k, v in params.items()}}
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (256,), generator=batch_gen)
        grads, loss = grad_fn(params, x[idx], y[idx])
        losses.append(loss.item())
        params, state = ftopt.step(tx, params, grads, state)
        if shadow:  # v in bf16 fed the fp32 run's gradients (fp32 math, one rounding)
            for k, g in grads.items():
                new = {r: B2 * shadows[r][k] + (1 - B2) * g * g for r in shadows}
                shadows["nearest"][k] = round_nearest(new["nearest"])
                shadows["stochastic"][k] = round_stochastic(new["stochastic"], round_gen)
    with torch.no_grad():
        val_loss = loss_fn(params, xv, yv).item()
        accuracy = (torch.func.functional_call(model, params, (xv,)).argmax(1) == yv)
    nu = {k: v.float() for k, v in _adam_state(state).nu.items()}
    tail = max(1, steps // 10)
    return {"train": sum(losses[-tail:]) / tail, "val": val_loss,
            "accuracy": accuracy.float().mean().item(), "nu": nu,
            "shadows": shadows if shadow else None, "params": params}


def drift(a: dict, ref: dict) -> float:
    """Mean over elements of |a - ref| / ref (elements with ref > 0)."""
    num, count = 0.0, 0
    for k, r in ref.items():
        ok = r > 0
        num += ((a[k] - r).abs()[ok] / r[ok]).sum().item()
        count += int(ok.sum())
    return num / max(count, 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data = two_spirals(8192, torch.Generator().manual_seed(0))
    val = two_spirals(4096, torch.Generator().manual_seed(1))
    modes = ["fp32", "nearest", "stochastic"]
    rows = {m: [] for m in modes}
    start = time.perf_counter()
    for seed in range(args.seeds):
        runs = {m: train(m, seed, args.steps, args.lr, data, val, shadow=(m == "fp32"))
                for m in modes}
        ref = runs["fp32"]
        for m in modes:
            r = runs[m]
            shadow = (None if m == "fp32" else
                      drift(ref["shadows"][m], ref["nu"]))
            rows[m].append({"seed": seed, "train": r["train"], "val": r["val"],
                            "accuracy": r["accuracy"],
                            "run_drift": None if m == "fp32" else drift(r["nu"], ref["nu"]),
                            "shadow_drift": shadow})
            print(f"seed {seed} {m:<11} train {r['train']:.5f} val {r['val']:.5f} "
                  f"acc {r['accuracy']:.4f}"
                  + ("" if m == "fp32" else f" v drift: shadow {shadow:.4f} run "
                     f"{rows[m][-1]['run_drift']:.4f}"), flush=True)
    seconds = time.perf_counter() - start

    def mean(m, key):
        vals = [r[key] for r in rows[m]]
        return None if vals[0] is None else sum(vals) / len(vals)

    names = {"fp32": "fp32 states", "nearest": "bf16, nearest",
             "stochastic": "bf16, stochastic"}
    title = (f"AdamW (b1 {B1}, b2 {B2}, lr {args.lr:g}, wd {WD:g}) on two spirals, MLP "
             f"2-64-64-2, {args.steps} steps of batch 256, {args.seeds} seeds, CPU "
             f"({seconds:.0f} s)")
    table = ["| states | train loss | val loss | val accuracy | v drift, same grads | "
             "v drift, own run |", "| --- | --- | --- | --- | --- | --- |"]
    for m in modes:
        sd, rd = mean(m, "shadow_drift"), mean(m, "run_drift")
        table.append(f"| {names[m]} | {mean(m, 'train'):.5f} | {mean(m, 'val'):.5f} | "
                     f"{mean(m, 'accuracy'):.4f} | {'-' if sd is None else f'{sd:.4f}'} | "
                     f"{'-' if rd is None else f'{rd:.4f}'} |")
    print("\n" + title + "\n\n" + "\n".join(table))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bf16_states_quality.md").write_text(title + "\n\n" + "\n".join(table) + "\n")
    (args.out / "bf16_states_quality.json").write_text(json.dumps(
        {"title": title, "steps": args.steps, "seeds": args.seeds, "lr": args.lr,
         "b1": B1, "b2": B2, "weight_decay": WD, "seconds": seconds, "runs": rows},
        indent=1))
    print(f"\nwritten: {args.out / 'bf16_states_quality.md'}")


if __name__ == "__main__":
    main()
