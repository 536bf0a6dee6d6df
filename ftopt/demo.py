"""A short training run on built-in data: ``python -m ftopt demo``.

Trains a small MLP to classify the two-spirals data set (generated here, no download)
with a ``torch.func`` loop, once per optimizer, with a progress bar per run, then prints a
table (loss, accuracy, time per step after a warm-up), what ``ftopt.explain`` says about
the step, and writes a PNG of the loss curves (``--out``; needs matplotlib). Runs on the
GPU when there is one (fused Triton kernels), else on the CPU (eager).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import time

import torch
from torch import nn

import ftopt

try:  # optional: the demo runs without them (no progress bar; no PNG, says so)
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover - depends on the environment
    tqdm = None
try:
    from matplotlib.figure import Figure
except ImportError:  # pragma: no cover - depends on the environment
    Figure = None

WARMUP_STEPS = 3  # compile the fused kernels (on a GPU) before the clock starts


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


def train(name: str, tx: ftopt.GradientTransformation, data, steps: int, device,
          progress: bool = True) -> dict:
    """A ``torch.func`` training loop: params and state are plain pytrees. A few warm-up
    steps on a throwaway copy come first (kernel compilation is not counted)."""
    torch.manual_seed(0)
    model = make_model().to(device)
    x, y = (t.to(device) for t in data)

    def loss_fn(p, xb, yb):
        logits = torch.func.functional_call(model, p, (xb,))
        return nn.functional.cross_entropy(logits, yb)

    grad_fn = torch.func.grad_and_value(loss_fn)

    def run(params, state, n, bar=None):
        losses = []
        for _ in range(n):
            idx = torch.randint(0, x.shape[0], (256,), device=device)
            grads, loss = grad_fn(params, x[idx], y[idx])
            params, state = ftopt.step(tx, params, grads, state, donate=True)
            losses.append(loss.detach())  # no .item(): a GPU step is not synchronised
            if bar is not None:
                bar.update()
        return params, state, losses

    def fresh():
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        return params, tx.init(params)

    run(*fresh(), WARMUP_STEPS)
    params, state = fresh()
    bar = (tqdm(total=steps, desc=f"{name:<22}", unit="step", leave=True)
           if progress and tqdm is not None else None)
    _synchronize(device)
    start = time.perf_counter()
    params, state, losses = run(params, state, steps, bar)
    _synchronize(device)
    elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    with torch.no_grad():
        accuracy = (torch.func.functional_call(model, params, (x,)).argmax(1) == y)
    return {"name": name, "losses": torch.stack(losses).tolist(),
            "accuracy": accuracy.float().mean().item(), "seconds": elapsed, "tx": tx,
            "params": params}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plot_losses(results: list[dict], path: pathlib.Path, title: str) -> pathlib.Path | None:
    """The loss curves (a 10-step running mean) as a PNG at ``path``; ``None`` without
    matplotlib."""
    if Figure is None:
        return None
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    for r in results:
        losses = torch.tensor(r["losses"])
        window = min(10, len(losses))
        ax.plot(torch.arange(window, len(losses) + 1),
                losses.unfold(0, window, 1).mean(1), label=r["name"])
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (mean of {min(10, len(results[0]['losses']))} steps)")
    ax.set_title(title)
    ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def _table(results: list[dict]) -> list[str]:
    """A markdown table: loss (mean of the first and last 10 steps), accuracy, time."""
    lines = ["| optimizer | loss: start -> end | accuracy | ms/step | seconds |",
             "| --- | --- | --- | --- | --- |"]
    for r in results:
        losses = r["losses"]
        first, last = losses[:10], losses[-10:]
        ms = 1e3 * r["seconds"] / len(losses)
        lines.append(f"| {r['name']} | {sum(first) / len(first):.4f} -> "
                     f"{sum(last) / len(last):.4f} | {r['accuracy']:.3f} | {ms:.2f} | "
                     f"{r['seconds']:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    """Run the demo (``python -m ftopt demo --help`` lists the options)."""
    parser = argparse.ArgumentParser(prog="python -m ftopt demo",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("build/demo"),
                        help="where results.md and losses.png go (default: build/demo)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.steps < 10:
        parser.error("--steps must be at least 10")
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
    title = f"two spirals, MLP 2-64-64-2, {args.steps} steps of batch 256 on {device}"
    print(title + f" (times after {WARMUP_STEPS} warm-up steps)\n")
    results = [train(name, tx, data, args.steps, device, progress=not args.no_progress)
               for name, tx in optimizers.items()]
    table = _table(results)
    print("\n" + "\n".join(table))
    print("\nwhat one step of adamw does here:")
    ftopt.explain(results[0]["tx"], results[0]["params"], donate=True)
    best = max(results, key=lambda r: r["accuracy"])
    print(f"\nbest: {best['name']} ({best['accuracy']:.3f} accuracy)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(f"{title}\n\n" + "\n".join(table) + "\n")
    png = plot_losses(results, args.out / "losses.png", title)
    print(f"\ntable: {args.out / 'results.md'}")
    print(f"loss curves: {png}" if png is not None else
          "loss curves: not drawn (matplotlib is not installed: pip install matplotlib)")


if __name__ == "__main__":
    main()
