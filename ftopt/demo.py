"""A short training run on built-in data: ``python -m ftopt.demo``.

Trains a small MLP to classify the two-spirals data set (generated here, no download)
with a ``torch.func`` loop, once per optimizer, and prints the loss curves, the final
accuracy and what ``ftopt.explain`` says about the step. Runs on the GPU when there is
one (fused Triton kernels), else on the CPU (eager).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

import ftopt


def two_spirals(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` points on two interleaved spirals, labels 0 and 1."""
    t = torch.rand(n, generator=generator) * 3 * math.pi + 0.5
    label = torch.randint(0, 2, (n,), generator=generator)
    sign = 1 - 2 * label.float()
    x = torch.stack([sign * t * torch.cos(t), sign * t * torch.sin(t)], dim=1) / 10
    x = x + 0.02 * torch.randn(n, 2, generator=generator)
    return x, label


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 2))


def train(name: str, tx: ftopt.GradientTransformation, data, steps: int, device) -> dict:
    """A ``torch.func`` training loop: params and state are plain pytrees."""
    torch.manual_seed(0)
    model = make_model().to(device)
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = tx.init(params)
    x, y = (t.to(device) for t in data)

    def loss_fn(p, xb, yb):
        logits = torch.func.functional_call(model, p, (xb,))
        return nn.functional.cross_entropy(logits, yb)

    grad_fn = torch.func.grad_and_value(loss_fn)
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        idx = torch.randint(0, x.shape[0], (256,), device=device)
        grads, loss = grad_fn(params, x[idx], y[idx])
        params, state = ftopt.step(tx, params, grads, state, donate=True)
        if step % (steps // 10) == 0 or step == steps - 1:
            losses.append(loss.item())
    elapsed = time.perf_counter() - start
    with torch.no_grad():
        accuracy = (torch.func.functional_call(model, params, (x,)).argmax(1) == y)
    return {"name": name, "losses": losses, "accuracy": accuracy.float().mean().item(),
            "seconds": elapsed, "tx": tx, "params": params}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    data = two_spirals(4096, torch.Generator().manual_seed(0))
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny tensors: threads cost more than they give
    schedule = ftopt.warmup_cosine_decay_schedule(0.0, 3e-2, args.steps // 10, args.steps)
    optimizers = {
        "adamw": ftopt.adamw(schedule, weight_decay=1e-4),
        "adamw + skip_zeros": ftopt.adamw(schedule, weight_decay=1e-4, skip_zeros=True),
        "lion": ftopt.lion(3e-3, weight_decay=1e-2),
        "sgd + nesterov": ftopt.sgd(0.1, momentum=0.9, nesterov=True),
        "lamb": ftopt.lamb(1e-2, weight_decay=1e-4),
        "adam, 8-bit states": ftopt.adam(1e-2, state_bits=8),
        "clip + adam (chain)": ftopt.chain(ftopt.clip_by_global_norm(1.0),
                                           ftopt.adam(1e-2)),
    }
    print(f"two spirals, MLP 2-64-64-2, {args.steps} steps of batch 256 on {device}\n")
    print(f"{'optimizer':<22}{'loss: start -> end':>26}{'accuracy':>10}{'seconds':>9}")
    results = []
    for name, tx in optimizers.items():
        r = train(name, tx, data, args.steps, device)
        results.append(r)
        print(f"{name:<22}{r['losses'][0]:>12.4f} -> {r['losses'][-1]:<10.4f}"
              f"{r['accuracy']:>10.3f}{r['seconds']:>9.2f}")
    print("\nwhat one step of adamw does here:")
    ftopt.explain(results[0]["tx"], results[0]["params"])
    best = max(results, key=lambda r: r["accuracy"])
    print(f"\nbest: {best['name']} ({best['accuracy']:.3f} accuracy)")


if __name__ == "__main__":
    main()
