"""GPT-2 small under FSDP2: the ftopt step against torch.optim.AdamW(fused=True).

    torchrun --nproc_per_node 2 benchmarks/fsdp_gpu.py --out DIR     (NCCL, one GPU a rank)
    torchrun --nproc_per_node 2 benchmarks/fsdp_gpu.py --small --out DIR   (gloo, CPU)

Two FSDP2 copies of one GPT-2 (built here from torch modules) on the same mesh, in the
same run: one stepped by ``ftopt.step(adamw, donate=True)``, one by torch's fused AdamW.
Measured on each: the optimizer step alone (over fixed gradients), the whole training
step (forward, backward, step), and, for ``clip_by_global_norm`` + adamw, the step and
the norm all-reduce alone (one collective of one float per leaf), and the host time of
the ftopt step with its DTensor cache and without (the full path). Correctness: after a
few steps on the same full batch on every rank, the FSDP2 params against one process
(rank 0, unsharded) running the same ftopt chain. Targets: optimizer step >= 1.5x faster
than torch fused; the whole step not slower. Rank 0 prints a table and writes
``fsdp_gpu.json`` and ``fsdp_gpu.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, init_device_mesh

import ftopt


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT2(torch.nn.Module):
    def __init__(self, vocab: int, ctx: int, d: int, layers: int, heads: int):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(vocab, d), torch.nn.Embedding(ctx, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def shard(model: torch.nn.Module, mesh) -> torch.nn.Module:
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()`` (synchronised before and after each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def host_ms(fn, device, repeats: int, warmup: int = 3) -> float:
    """Mean host milliseconds per call of ``fn`` (the device work is not waited for)."""
    for _ in range(warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    elapsed = (time.perf_counter() - start) * 1e3 / repeats
    sync(device)
    return elapsed


@contextlib.contextmanager
def full_path_only():
    """Within it, DTensor steps take the full path (the cached one is off)."""
    from ftopt import dtensor_cache

    saved = dtensor_cache.cached_step
    dtensor_cache.cached_step = lambda *args: None
    try:
        yield
    finally:
        dtensor_cache.cached_step = saved


def loss_of(model, batch):
    idx, target = batch
    logits = model(idx)
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", action="store_true", help="a tiny model, gloo on the CPU")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=6,
                    help="interleaved rounds of the whole-step timing")
    args = ap.parse_args()
    small = args.small or not torch.cuda.is_available()
    dist.init_process_group("gloo" if small else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if small:
        device = torch.device("cpu")
        cfg = dict(vocab=512, ctx=64, d=64, layers=2, heads=4)
        batch_shape = (4, 32)
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        cfg = dict(vocab=50257, ctx=1024, d=768, layers=12, heads=12)
        batch_shape = (8, 512)
    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(0)
    base = GPT2(**cfg).to(device)
    g = torch.Generator(device="cpu").manual_seed(1)
    batches = [(torch.randint(0, cfg["vocab"], batch_shape, generator=g).to(device),
                torch.randint(0, cfg["vocab"], batch_shape, generator=g).to(device))
               for _ in range(4)]
    rows = {}

    # -- correctness: FSDP2 ftopt against one process (rank 0), same full batches -------
    tx = ftopt.chain(ftopt.clip_by_global_norm(1.0), ftopt.adamw(3e-4, weight_decay=0.1))
    model = shard(copy.deepcopy(base), mesh)
    params = dict(model.named_parameters())
    state = tx.init(params)
    single = copy.deepcopy(base) if rank == 0 else None
    single_params = dict(single.named_parameters()) if single is not None else None
    single_state = tx.init(single_params) if single is not None else None
    for batch in batches:
        loss_of(model, batch).backward()
        params, state = ftopt.step(tx, params, {k: v.grad for k, v in params.items()},
                                   state, donate=True)
        model.zero_grad(set_to_none=False)
        if single is not None:
            loss_of(single, batch).backward()
            single_params, single_state = ftopt.step(
                tx, single_params, {k: v.grad for k, v in single_params.items()},
                single_state, donate=True)
            single.zero_grad(set_to_none=False)
    fulls = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in params.items()}
    if rank == 0:
        rows["max abs diff, FSDP2 vs one process, 4 steps clip+adamw"] = max(
            float((fulls[k] - single_params[k]).detach().abs().max()) for k in fulls)
    del single, single_params, single_state

    # -- optimizer step alone, over fixed gradients --------------------------------------
    ours = shard(copy.deepcopy(base), mesh)
    theirs = shard(copy.deepcopy(base), mesh)
    for m in (ours, theirs):
        loss_of(m, batches[0]).backward()
    adamw = ftopt.adamw(3e-4, weight_decay=0.1)
    p_ours = dict(ours.named_parameters())
    s_ours = adamw.init(p_ours)
    g_ours = {k: v.grad for k, v in p_ours.items()}
    torch_opt = torch.optim.AdamW(theirs.parameters(), lr=3e-4, weight_decay=0.1,
                                  fused=True)
    s_clip = tx.init(p_ours)

    def ftopt_step():
        ftopt.step(adamw, p_ours, g_ours, s_ours, donate=True)

    def ftopt_clip_step():
        ftopt.step(tx, p_ours, g_ours, s_clip, donate=True)

    rows["optimizer step, ftopt adamw (ms)"] = timed(ftopt_step, device, args.repeats)
    # Host time of the step (no synchronisation in the loop): the cached DTensor step,
    # and the full path (every leaf unwrapped and checked) it saves.
    rows["host time per step, ftopt adamw (ms)"] = host_ms(ftopt_step, device, args.repeats)
    with full_path_only():
        rows["host time per step, full DTensor path (ms)"] = host_ms(ftopt_step, device,
                                                                      args.repeats)
    rows["optimizer step, torch AdamW fused (ms)"] = timed(torch_opt.step, device,
                                                           args.repeats)
    rows["optimizer step, ftopt clip+adamw (ms)"] = timed(ftopt_clip_step, device,
                                                          args.repeats)
    norms = torch.zeros(len(p_ours), dtype=torch.float32, device=device)
    rows["norm all-reduce alone (ms)"] = timed(lambda: dist.all_reduce(norms), device,
                                               args.repeats)

    # -- whole training step ---------------------------------------------------------------
    def train_ours():
        loss_of(ours, batches[1]).backward()
        ftopt.step(adamw, p_ours, {k: v.grad for k, v in p_ours.items()}, s_ours,
                   donate=True)
        ours.zero_grad(set_to_none=False)

    def train_theirs():
        loss_of(theirs, batches[1]).backward()
        torch_opt.step()
        theirs.zero_grad(set_to_none=False)

    # Interleaved rounds, the order alternating (clocks and caches drift over a run): the
    # median of each one's round medians.
    rounds: dict[str, list[float]] = {"ours": [], "theirs": []}
    for r in range(args.rounds):
        order = [("ours", train_ours), ("theirs", train_theirs)]
        for name, fn in (order if r % 2 == 0 else order[::-1]):
            rounds[name].append(timed(fn, device, args.repeats))
    rows["training step, ftopt (ms)"] = statistics.median(rounds["ours"])
    rows["training step, torch fused (ms)"] = statistics.median(rounds["theirs"])
    rows["training step rounds with ftopt faster"] = sum(
        a < b for a, b in zip(rounds["ours"], rounds["theirs"]))
    rows["training step rounds"] = args.rounds
    rows["optimizer speed-up (torch / ftopt)"] = (
        rows["optimizer step, torch AdamW fused (ms)"]
        / rows["optimizer step, ftopt adamw (ms)"])
    rows["training step ratio (ftopt / torch)"] = (
        rows["training step, ftopt (ms)"] / rows["training step, torch fused (ms)"])
    if rank == 0:
        info = {"device": str(torch.cuda.get_device_name(device)) if device.type == "cuda"
                else "cpu", "world": world, "torch": torch.__version__, "config": cfg,
                "batch": batch_shape, "small": small, "results": rows}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fsdp_gpu.json"), "w") as f:
            json.dump(info, f, indent=1)
        lines = [f"# FSDP2 GPT-2 ({'small config, CPU' if small else 'GPT-2 small'}, "
                 f"{world} ranks, {info['device']}, torch {torch.__version__})", "",
                 "| measure | value |", "| --- | --- |"]
        lines += [f"| {k} | {v:.4g} |" for k, v in rows.items()]
        text = "\n".join(lines) + "\n"
        with open(os.path.join(args.out, "fsdp_gpu.md"), "w") as f:
            f.write(text)
        print(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
