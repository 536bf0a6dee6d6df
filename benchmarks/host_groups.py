"""Host time of ``ftopt.Optimizer.step`` with two param groups, joined or group by group.

The GPT-2 tree (148 leaves; small widths: only the host work is measured) in two groups,
AdamW with weight decay 0.1 for matrices and 0.0 for biases and norms, fused and
donated, against the same leaves in one AdamW group, and against a plain donated
``ftopt.step`` of ``adamw`` over the same tree (what the ``Optimizer`` adds on top).
The kernel launch is stubbed (the step counts advance on the host only, as the kernel's
write leaves them), so the numbers are the Python work of a step: one partition over
both groups (one launch per dtype group), against the groups stepped one by one (one
launch each), and the joined groups under a ``LambdaLR`` that writes a new ``lr`` after
every step. The native tensor check is waited for (a GPU process builds it in the
background on its first fused step), so the CPU runs the checks a GPU host runs. The
paths take turns over ``--repeats`` rounds of ``--iters`` steps (a shared machine is
noisy): the table shows the lowest of the rounds' medians and the fastest step. Runs on
the CPU (``TRITON_INTERPRET=1``, set here) or a GPU:

    python3 benchmarks/host_groups.py --out DIR

Writes ``host_groups.json`` and ``host_groups.md`` to ``DIR``.

Prediction for the H200 host (results: ``results/host_groups_cpu_bound_step.md``): the
CPU here gives plain 25, one group 26, joined 31, group by group 35, scheduled 40 us
(before the bound steps: 25, 50, 66, 64, 87). The H200's earlier 53 / 89 / 139 / 180
us included the old stub's ``add_`` of each step count and the count's read back from
the device every step (a synchronisation: one count for one group, two for the joined
groups, hence their +51), and the scheduled run two ``fill_`` launches. Expected there
now: one group within ~3 us of the plain step, joined groups ~5 us over one group, a
new ``lr`` in both groups ~10 us over the joined step (no device write on a bound step:
the kernel takes the number), group by group ~10 us over joined (one more launch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_step import gpt2_shapes  # noqa: E402

import ftopt  # noqa: E402
from ftopt.lowering import execute, native  # noqa: E402


def _optimizer(device: str, joined: bool, single: bool = False) -> ftopt.Optimizer:
    gen = torch.Generator().manual_seed(0)
    params = {}
    for name, shape in gpt2_shapes(vocab=64, d=16, ctx=32, n_layer=12).items():
        p = torch.nn.Parameter(torch.randn(shape, generator=gen).to(device))
        p.grad = torch.randn(shape, generator=gen).to(device)
        params[name] = p
    groups = [{"params": [(n, p) for n, p in params.items() if p.ndim > 1],
               "weight_decay": 0.1},
              {"params": [(n, p) for n, p in params.items() if p.ndim <= 1],
               "weight_decay": 0.0}]
    if single:  # the reference: every leaf in one group
        groups = [{"params": groups[0]["params"] + groups[1]["params"],
                   "weight_decay": 0.1}]
    opt = ftopt.Optimizer(groups, ftopt.adamw, lr=1e-3, backend="fused")
    if not joined:
        opt._joiner.step = lambda *args, **kwargs: None
    return opt


class PlainStep:
    """A donated ``ftopt.step`` of AdamW over the one-group optimizer's params, as a dict
    by name, with the gradients' dict built once: the step without the ``Optimizer``."""

    def __init__(self, opt: ftopt.Optimizer):
        group = opt.param_groups[0]
        self.params = dict(zip(group["param_names"], group["params"]))
        self.grads = {name: p.grad for name, p in self.params.items()}
        self.tx = ftopt.adamw(learning_rate=group["lr"], weight_decay=group["weight_decay"])
        self.state = self.tx.init(self.params)
        self.param_groups = [group]

    def step(self) -> None:
        _, self.state = ftopt.step(self.tx, self.params, self.grads, self.state, donate=True,
                                   backend="fused")


def measure(opt, iters: int) -> list[float]:
    """Host time per ``opt.step()`` (us), ``iters`` times; ``opt.between`` (a scheduler's
    step), where set, runs between the steps, untimed."""
    between = getattr(opt, "between", None)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        opt.step()
        times.append((time.perf_counter() - t0) * 1e6)
        if between is not None:
            between()
    return times


def _scheduled(opt: ftopt.Optimizer) -> ftopt.Optimizer:
    """``opt`` under a ``LambdaLR`` that writes every group's ``lr`` (a new float) after
    each step, as a schedule does."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 1e-3 * s))
    opt.between = sched.step
    return opt


PLAIN, ONE, JOINED, APART, SCHEDULED = (
    "ftopt.step, no Optimizer", "one group (reference)", "joined (one partition)",
    "group by group", "joined, lr scheduled")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # The one-call tensor check a GPU process builds (or loads) on its first fused step:
    # waited for here, so that every path is measured with it (and the CPU as a GPU host).
    native.module(wait=True)
    launches = []
    # The stub: no kernel. The step counts advance on the host, as with the kernel, whose
    # write of a count (through its address) leaves the tensor's version as it was: an
    # ``add_`` here would bump it, and every next step would read the count back from the
    # device (a synchronisation on a GPU) where the real step reads its host mirror.
    execute.PreparedStep.launch = lambda self, scalars, pairs, *rest: launches.append(1)
    opts = {ONE: _optimizer(device, True, True), JOINED: _optimizer(device, True, False),
            APART: _optimizer(device, False, False),
            SCHEDULED: _scheduled(_optimizer(device, True, False))}
    opts = {PLAIN: PlainStep(opts[ONE]), **opts}
    rows: dict = {}
    medians: dict = {name: [] for name in opts}
    times: dict = {name: [] for name in opts}
    for name, opt in opts.items():
        measure(opt, 5)  # warm-up: the first step plans and builds the tables
        launches.clear()
        measure(opt, 4)
        rows[name] = {"leaves": sum(len(g["params"]) for g in opt.param_groups),
                      "groups": len(opt.param_groups), "launches_per_step": len(launches) / 4}
    for _ in range(args.repeats):
        for name, opt in opts.items():
            got = measure(opt, args.iters)
            medians[name].append(statistics.median(got))
            times[name] += got
    for name in opts:
        rows[name].update(median_us=min(medians[name]), min_us=min(times[name]))
    lines = [f"Host time of ftopt.Optimizer.step, GPT-2 tree, two AdamW groups, launch "
             f"stubbed, {device} (torch {torch.__version__}; lowest median of "
             f"{args.repeats} rounds of {args.iters} steps; native tensor check: "
             f"{native.status()})", "",
             "| path | leaves | launches/step | median us | min us |",
             "| --- | --- | --- | --- | --- |"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['leaves']} | {row['launches_per_step']:.0f} | "
                     f"{row['median_us']:.0f} | {row['min_us']:.0f} |")
    over_plain = rows[ONE]["median_us"] - rows[PLAIN]["median_us"]
    extra = rows[JOINED]["median_us"] - rows[ONE]["median_us"]
    scheduled = rows[SCHEDULED]["median_us"] - rows[JOINED]["median_us"]
    lines += ["", f"one group costs {over_plain:+.0f} us per step over a plain ftopt.step; "
              f"joined two groups cost {extra:+.0f} us per step over one group; a new lr "
              f"in every group each step costs {scheduled:+.0f} us"]
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_groups.json").write_text(json.dumps(
        {"device": device, "torch": torch.__version__, "native_check": native.status(),
         "rows": rows,
         "one_group_minus_plain_step_us": over_plain, "scheduled_minus_joined_us": scheduled,
         "joined_minus_one_group_us": extra}, indent=2))
    (args.out / "host_groups.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
