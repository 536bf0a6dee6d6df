"""Muon vs AdamW on a small byte-level transformer language model, trained on the Python
standard library's own sources (no download).

    python3 benchmarks/muon_vs_adamw.py --out DIR            # GPU: 6 layers, d=384, 1000 steps
    python3 benchmarks/muon_vs_adamw.py --out DIR --amp      # the same under bf16 autocast
    python3 benchmarks/muon_vs_adamw.py --small --out DIR    # CPU: 2 layers, d=64, seconds

The text is every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` (sorted by path,
site-packages left out), read as bytes: the last 10% is the validation split. Both runs
start from the same initial weights and see the same batches in the same order (one
seed). Optimizers, each with linear warmup then cosine decay to 10% of the peak:

* ``muon``: ``ftopt.muon`` for the 2-D weights of the transformer blocks, ``ftopt.adamw``
  for the embeddings, the output head, norms and biases (the usual split: Muon
  orthogonalises hidden matrices; embedding rows are not a linear map's inputs), through
  ``ftopt.partition``;
* ``adamw``: ``ftopt.adamw`` for everything.

Both step through ``ftopt.Optimizer`` (one donated ``ftopt.step`` per step). Writes
``muon_vs_adamw.json`` and ``.md`` (final train loss, the mean of the last 10% of steps;
final val loss; ms per step) and ``muon_vs_adamw.png`` (loss curves, with matplotlib) or
``muon_vs_adamw.csv`` (always) to ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import ftopt  # noqa: E402

SMALL = dict(n_layer=2, d_model=64, n_head=2, ctx=64, batch=8, steps=30, data_bytes=1 << 19,
             eval_every=10, eval_batches=4)
FULL = dict(n_layer=6, d_model=384, n_head=6, ctx=256, batch=64, steps=1000,
            data_bytes=32 << 20, eval_every=100, eval_batches=20)


# ---- data ---------------------------------------------------------------------------------
def stdlib_bytes(limit: int) -> torch.Tensor:
    """The first ``limit`` bytes of the standard library's ``.py`` files, concatenated in
    path order (uint8)."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read()
            except OSError:
                continue  # an unreadable file is left out of the corpus
            chunks.append(data)
            total += len(data)
            if total >= limit:
                return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8)
    if total < 1 << 16:
        raise SystemExit(f"only {total} bytes of Python sources under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def batches(data: torch.Tensor, ctx: int, batch: int, count: int, seed: int):
    """``count`` (inputs, targets) batches of random windows, in a seeded order."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(count):
        start = torch.randint(0, data.numel() - ctx - 1, (batch,), generator=gen)
        rows = torch.stack([data[s:s + ctx + 1] for s in start.tolist()]).long()
        yield rows[:, :-1], rows[:, 1:]


# ---- model --------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.fc_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, t, 3, self.n_head, d // self.n_head).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))


class ByteLM(nn.Module):
    """A GPT-style decoder over bytes (vocabulary 256), untied head."""

    def __init__(self, n_layer: int, d_model: int, n_head: int, ctx: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(256, d_model), nn.Embedding(ctx, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, 256, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x)).float()
        return F.cross_entropy(logits.view(-1, 256), targets.reshape(-1))


# ---- optimizers ---------------------------------------------------------------------------
def _muon_labels(params: dict) -> dict:
    return {k: "muon" if k.startswith("blocks.") and p.dim() == 2 else "adam"
            for k, p in params.items()}


def make_tx(name: str, steps: int, args) -> ftopt.GradientTransformation:
    warmup = max(1, steps // 20)

    def sched(peak):
        return ftopt.warmup_cosine_decay_schedule(0.0, peak, warmup, steps, 0.1 * peak)

    adamw = ftopt.adamw(sched(args.adam_lr), b1=0.9, b2=0.95, weight_decay=args.wd)
    if name == "adamw":
        return adamw
    muon = ftopt.muon(sched(args.muon_lr), weight_decay=args.wd)
    return ftopt.partition({"muon": muon, "adam": adamw}, _muon_labels)


# ---- training -----------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def evaluate(model, val, cfg, device, amp) -> float:
    losses = []
    for x, y in batches(val, cfg["ctx"], cfg["batch"], cfg["eval_batches"], seed=1234):
        with torch.autocast(device.type, torch.bfloat16, enabled=amp):
            losses.append(model(x.to(device), y.to(device)))
    return float(torch.stack(losses).mean())


def train(name, init_state, train_data, val, cfg, device, args) -> dict:
    torch.manual_seed(args.seed)
    model = ByteLM(cfg["n_layer"], cfg["d_model"], cfg["n_head"], cfg["ctx"]).to(device)
    model.load_state_dict(init_state)
    opt = ftopt.Optimizer(model.named_parameters(), make_tx(name, cfg["steps"], args))
    losses, evals, busy = [], [], 0.0
    for step, (x, y) in enumerate(batches(train_data, cfg["ctx"], cfg["batch"],
                                          cfg["steps"], seed=args.seed)):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        _sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, torch.bfloat16, enabled=args.amp):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        _sync(device)
        busy += time.perf_counter() - start
        if (step + 1) % cfg["eval_every"] == 0 or step + 1 == cfg["steps"]:
            evals.append((step + 1, evaluate(model, val, cfg, device, args.amp)))
    train_curve = [float(v) for v in torch.stack(losses).cpu()]
    tail = train_curve[-max(1, len(train_curve) // 10):]
    return {"train": train_curve, "val": evals, "final_train": sum(tail) / len(tail),
            "final_val": evals[-1][1], "ms_per_step": busy / cfg["steps"] * 1e3}


# ---- output -------------------------------------------------------------------------------
def write_curves(out: str, runs: dict) -> str:
    """The CSV always; the PNG when matplotlib is installed. Returns what was written."""
    with open(os.path.join(out, "muon_vs_adamw.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["optimizer", "split", "step", "loss"])
        for name, r in runs.items():
            w.writerows([name, "train", i + 1, v] for i, v in enumerate(r["train"]))
            w.writerows([name, "val", s, v] for s, v in r["val"])
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "muon_vs_adamw.csv (matplotlib is not installed: no PNG)"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (name, r), color in zip(runs.items(), ("tab:blue", "tab:orange")):
        k = max(1, len(r["train"]) // 50)  # a running mean over ~2% of the steps
        smooth = torch.tensor(r["train"]).unfold(0, k, 1).mean(1).tolist()
        ax.plot(range(k, len(r["train"]) + 1), smooth, color=color, alpha=0.6,
                label=f"{name} train")
        ax.plot(*zip(*r["val"]), "o-", color=color, label=f"{name} val")
    ax.set(xlabel="step", ylabel="loss (nats/byte)", title="Muon vs AdamW, byte-level LM")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "muon_vs_adamw.png"), dpi=120)
    plt.close(fig)
    return "muon_vs_adamw.png, muon_vs_adamw.csv"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", action="store_true", help="a tiny model and run (CPU check)")
    ap.add_argument("--steps", type=int, help="steps per optimizer (default: by size)")
    ap.add_argument("--amp", action="store_true", help="bf16 autocast for the model")
    ap.add_argument("--muon-lr", type=float, default=0.02)
    ap.add_argument("--adam-lr", type=float, default=3e-3)
    ap.add_argument("--wd", type=float, default=0.1, help="AdamW's decoupled weight decay")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    cfg = dict(SMALL if args.small else FULL)
    if args.steps:
        cfg["steps"] = args.steps
        cfg["eval_every"] = max(1, min(cfg["eval_every"], args.steps // 4))
    if device.type == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))
    data = stdlib_bytes(cfg["data_bytes"])
    split = int(0.9 * data.numel())
    train_data, val = data[:split], data[split:]
    torch.manual_seed(args.seed)
    init = ByteLM(cfg["n_layer"], cfg["d_model"], cfg["n_head"], cfg["ctx"]).state_dict()
    n_params = sum(v.numel() for v in init.values())
    runs = {name: train(name, init, train_data, val, cfg, device, args)
            for name in ("muon", "adamw")}
    os.makedirs(args.out, exist_ok=True)
    curves = write_curves(args.out, runs)
    title = (f"byte-level LM, {cfg['n_layer']} layers, d={cfg['d_model']}, "
             f"{n_params / 1e6:.2f}M params, ctx {cfg['ctx']} x batch {cfg['batch']}, "
             f"{cfg['steps']} steps, {data.numel() / 1e6:.1f} MB of stdlib sources, "
             f"{device}{', bf16 autocast' if args.amp else ''}")
    lines = [f"## {title}", "", "| optimizer | final train loss | final val loss | ms / step |",
             "| --- | ---: | ---: | ---: |"]
    lines += [f"| {name} | {r['final_train']:.4f} | {r['final_val']:.4f} | "
              f"{r['ms_per_step']:.2f} |" for name, r in runs.items()]
    lines += ["", f"learning rates: muon {args.muon_lr} (adamw {args.adam_lr} for embeddings, "
              f"head, norms, biases), adamw {args.adam_lr}; warmup then cosine to 10%. "
              "Train loss: mean of the last 10% of steps. ms / step: forward, backward and "
              f"optimizer step. Curves: {curves}."]
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "muon_vs_adamw.md"), "w") as f:
        f.write(text + "\n\nCommand: python3 benchmarks/muon_vs_adamw.py " +
                " ".join(sys.argv[1:]) + "\n")
    with open(os.path.join(args.out, "muon_vs_adamw.json"), "w") as f:
        json.dump({"title": title, "device": str(device), "config": cfg, "params": n_params,
                   "args": vars(args), "curves": curves, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
