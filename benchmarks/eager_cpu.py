"""Eager CPU speed of ``ftopt.step`` against ``torch.optim.Adam``/``AdamW``.

One Adam (and AdamW) step over a GPT-2-shaped tree of about 10M parameters (12 layers,
d_model 256, vocabulary 2048, context 512: 148 leaves, from 256-element layernorm
vectors to 1M-element embedding and MLP matrices), on the CPU:

* ``ftopt.step(tx, params, grads, state, backend="eager")`` with ``donate=False`` (new
  params and state every step) and ``donate=True`` (written in place);
* ``torch.optim.Adam(foreach=True)`` (the baseline), ``foreach=False`` and ``fused=True``
  (torch's fused CPU kernel: one pass that reads and writes each tensor once).

Each variant keeps its own params and state and is stepped in a training-like loop (the
outputs of one step are the inputs of the next). After ``--warmup`` rounds, ``--iters``
rounds are timed with ``time.perf_counter``; in each round every variant runs once, in
turn, so that drift of the machine hits all of them alike. The table shows the median.

    .venv/bin/python benchmarks/eager_cpu.py [--threads 2] [--iters 30] [--wait-quiet 120]

It rewrites the measurement of the "Eager CPU" section of benchmarks/RESULTS.md (other
sections, and the notes below the section's marker line, are kept); ``--no-results`` only
prints. It also reports how much CPU other processes used meanwhile: with two threads on a
two-core machine every op waits for both cores, so a busy neighbour slows the many-op
steps most; ``--wait-quiet`` first waits (bounded) for the machine to be idle.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

try:
    import ftopt
except ImportError:  # run from a checkout without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import ftopt

HERE = Path(__file__).resolve().parent
SECTION = "Eager CPU"


def gpt2_tree(n_layer: int = 12, d: int = 256, vocab: int = 2048, ctx: int = 512,
              seed: int = 0) -> dict[str, torch.Tensor]:
    """GPT-2's parameter names and shapes (HF ``GPT2LMHeadModel``, tied head), scaled."""
    g = torch.Generator().manual_seed(seed)

    def t(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    tree = {"transformer.wte.weight": t(vocab, d), "transformer.wpe.weight": t(ctx, d)}
    for i in range(n_layer):
        h = f"transformer.h.{i}."
        tree.update({
            h + "ln_1.weight": 1 + t(d), h + "ln_1.bias": t(d),
            h + "attn.c_attn.weight": t(d, 3 * d), h + "attn.c_attn.bias": t(3 * d),
            h + "attn.c_proj.weight": t(d, d), h + "attn.c_proj.bias": t(d),
            h + "ln_2.weight": 1 + t(d), h + "ln_2.bias": t(d),
            h + "mlp.c_fc.weight": t(d, 4 * d), h + "mlp.c_fc.bias": t(4 * d),
            h + "mlp.c_proj.weight": t(4 * d, d), h + "mlp.c_proj.bias": t(d),
        })
    tree.update({"transformer.ln_f.weight": 1 + t(d), "transformer.ln_f.bias": t(d)})
    return tree


def clone_tree(tree):
    return {k: v.clone() for k, v in tree.items()}


class FtoptRunner:
    def __init__(self, tx, params, grads, donate: bool):
        self.tx, self.grads, self.donate = tx, grads, donate
        self.params = clone_tree(params)
        self.state = tx.init(self.params)

    def __call__(self):
        self.params, self.state = ftopt.step(self.tx, self.params, self.grads, self.state,
                                             donate=self.donate, backend="eager")


class TorchRunner:
    def __init__(self, opt_cls, params, grads, **kwargs):
        self.params = [p.clone().requires_grad_(True) for p in params.values()]
        for p, g in zip(self.params, grads.values()):
            p.grad = g.clone()
        self.opt = opt_cls(self.params, **kwargs)

    def __call__(self):
        self.opt.step()


def bench(variants: dict[str, Callable[[], None]], warmup: int, iters: int) -> dict:
    """name -> (median ms, min ms, median over rounds of time / baseline's time)."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(warmup + iters):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if r >= warmup:
                times[name].append(dt)
    base = times[next(iter(variants))]
    return {name: (statistics.median(ts) * 1e3, min(ts) * 1e3,
                   statistics.median(t / b for t, b in zip(ts, base)))
            for name, ts in times.items()}


class MachineLoad:
    """CPU time that other processes used while the benchmark ran (from /proc/stat),
    as a fraction of all cores: on a shared machine the timings depend on it."""

    def __enter__(self):
        self.t0, self.busy0, self.own0 = time.perf_counter(), _busy_seconds(), _own_seconds()
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.t0
        busy = _busy_seconds() - self.busy0
        own = _own_seconds() - self.own0
        cpus = os.cpu_count() or 1
        self.others = max(0.0, busy - own) / (wall * cpus) if busy == busy else float("nan")
        self.loadavg = os.getloadavg()


def _busy_seconds() -> float:
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return float("nan")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


def wait_quiet(limit_s: float, threshold: float = 0.3) -> float:
    """Wait (at most ``limit_s``) until other processes use under ``threshold`` of the
    CPU over a 5 s window; returns the last measured fraction."""
    deadline = time.perf_counter() + limit_s
    while True:
        with MachineLoad() as load:
            time.sleep(5)
        if load.others < threshold or time.perf_counter() > deadline:
            return load.others


def make_variants(params, grads, which: str, lr: float = 1e-3, wd: float = 1e-2):
    if which == "adam":
        tx = ftopt.adam(lr)
        ref = dict(opt_cls=torch.optim.Adam, lr=lr)
    else:
        tx = ftopt.adamw(lr, weight_decay=wd)
        ref = dict(opt_cls=torch.optim.AdamW, lr=lr, weight_decay=wd)
    name = "Adam" if which == "adam" else "AdamW"
    return {
        f"torch.optim.{name}(foreach=True)": TorchRunner(params=params, grads=grads,
                                                          foreach=True, **ref),
        f"torch.optim.{name}(foreach=False)": TorchRunner(params=params, grads=grads,
                                                           foreach=False, **ref),
        f"torch.optim.{name}(fused=True)": TorchRunner(params=params, grads=grads,
                                                        fused=True, **ref),
        f"ftopt.step({which}, eager, donate=False)": FtoptRunner(tx, params, grads, False),
        f"ftopt.step({which}, eager, donate=True)": FtoptRunner(tx, params, grads, True),
        # 8-bit states (leaves of 4096 elements and more), as bitsandbytes' 8-bit Adam
        f"ftopt.step({which}, state_bits=8, eager, donate=True)": FtoptRunner(
            ftopt.adam(lr, state_bits=8) if which == "adam"
            else ftopt.adamw(lr, weight_decay=wd, state_bits=8), params, grads, True),
    }


def table(results: dict) -> str:
    lines = ["| optimizer step | median ms | min ms | median / torch foreach median | "
             "median of per-round ratios |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for res in results.values():
        base = next(v[0] for k, v in res.items() if "foreach=True" in k)
        for name, (med, best, ratio) in res.items():
            lines.append(f"| {name} | {med:.2f} | {best:.2f} | {med / base:.2f}x | "
                         f"{ratio:.2f}x |")
    return "\n".join(lines)


NOTES = "<!-- notes: kept when the table is rewritten -->"


def write_results(path: Path, body: str) -> None:
    """Rewrite the section's measurement (everything after the marker ``NOTES`` in the
    section is kept as it is)."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    pattern = re.compile(rf"^## {re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    match = pattern.search(text)
    notes = ""
    if match and NOTES in match.group(0):
        notes = match.group(0)[match.group(0).index(NOTES):].rstrip() + "\n"
    section = f"## {SECTION}\n\n{body.strip()}\n\n{notes or NOTES + chr(10)}"
    if match:
        text = text[:match.start()] + section + "\n" + text[match.end():]
        text = text.rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + section
    path.write_text(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (2)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    ap.add_argument("--no-results", action="store_true", help="print only")
    ap.add_argument("--notes", default="", help="text for the section's notes paragraph")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                    help="first wait up to SECONDS for other processes to leave the CPU idle")
    args = ap.parse_args(argv)
    if args.wait_quiet > 0:
        wait_quiet(args.wait_quiet)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    params = gpt2_tree(args.layers, args.d_model, args.vocab)
    gen = torch.Generator().manual_seed(1)
    grads = {k: torch.randn(v.shape, generator=gen) * 1e-2 for k, v in params.items()}
    n = sum(p.numel() for p in params.values())

    results = {}
    with torch.no_grad(), MachineLoad() as load:
        for which in ("adam", "adamw"):
            results[which] = bench(make_variants(params, grads, which), args.warmup,
                                   args.iters)
    cmd = "python benchmarks/eager_cpu.py " + " ".join(argv if argv is not None
                                                        else sys.argv[1:])
    header = (
        f"* date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}\n"
        f"* command: `{cmd.strip()}`\n"
        f"* machine: {os.cpu_count()}-core CPU ({platform.processor() or platform.machine()}"
        f"), `torch.set_num_threads({args.threads})`, no GPU used\n"
        f"* torch {torch.__version__}, Python {platform.python_version()}\n"
        f"* tree: GPT-2 shapes, {args.layers} layers, d_model {args.d_model}, vocab "
        f"{args.vocab}: {len(params)} leaves, {n / 1e6:.2f}M fp32 params\n"
        f"* median (and min) of {args.iters} steps after {args.warmup} warm-up steps, "
        "variants interleaved round-robin; the last column is the median over rounds of "
        "(this step's time / the torch foreach step's time in the same round)\n"
        f"* other processes used {100 * load.others:.0f}% of the machine's CPU during the "
        f"run (load average {load.loadavg[0]:.2f}); with 2 threads a step stalls whenever "
        "another process holds the second core\n"
    )
    out = header + "\n" + table(results) + "\n"
    print(out)
    if not args.no_results:
        body = out + ("\n" + args.notes.strip() + "\n" if args.notes else "")
        write_results(args.results, body)
        print(f"wrote the '{SECTION}' section of {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
