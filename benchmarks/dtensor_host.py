"""Host cost of fused ``ftopt.step`` and ``tx.update`` over DTensor params (FSDP2's
``Shard(0)``), on the CPU: the cached DTensor calls against the full path (a donated step,
a non-donated one and an update), with the full path's phases of the donated step.

One process, a gloo group of one rank, 148 ``Shard(0)`` leaves, adamw; the kernel launch
is stubbed after two real steps (the Triton interpreter), so only the host path is timed.
DTensor handling does not depend on the device, so this is the host time a GPU step pays
on top of its launches.

    .venv/bin/python benchmarks/dtensor_host.py --out DIR

Prints a table and writes ``dtensor_host.json`` and ``dtensor_host.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh  # noqa: E402

import ftopt  # noqa: E402
from ftopt import distributed, dtensor_cache  # noqa: E402
from ftopt.lowering import execute  # noqa: E402

LEAVES = 148


def per_step_us(call, number: int) -> float:
    """Microseconds per call: the best of 5 repeats of ``number`` calls."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(number):
            call()
        best = min(best, (time.perf_counter() - start) / number)
    return best * 1e6


def phases(call, number: int) -> dict[str, float]:
    """Microseconds per full-path step spent in each phase of :mod:`ftopt.distributed`."""
    spent = {"unwrap (flatten, placements, to_local)": 0.0, "norm layouts": 0.0,
             "wrap": 0.0, "cache build": 0.0}
    originals = (distributed._Call.unwrap, distributed._Call.context,
                 distributed._Call.wrap, dtensor_cache.remember)

    def timed(name, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start
        return run

    distributed._Call.unwrap = timed("unwrap (flatten, placements, to_local)", originals[0])
    distributed._Call.context = timed("norm layouts", originals[1])
    distributed._Call.wrap = timed("wrap", originals[2])
    dtensor_cache.remember = timed("cache build", originals[3])
    try:
        start = time.perf_counter()
        for _ in range(number):
            call()
        total = time.perf_counter() - start
    finally:
        (distributed._Call.unwrap, distributed._Call.context, distributed._Call.wrap,
         dtensor_cache.remember) = originals
    out = {k: v / number * 1e6 for k, v in spent.items()}
    out["inner step and the rest"] = total / number * 1e6 - sum(out.values())
    return out


@contextlib.contextmanager
def no_dtensor_caches():
    """Every DTensor call takes the full path (unwrap, checks, rewrap)."""
    names = [n for n in ("cached_step", "cached_call") if hasattr(dtensor_cache, n)]
    saved = [getattr(dtensor_cache, n) for n in names]
    for n in names:
        setattr(dtensor_cache, n, lambda *a, **k: None)
    try:
        yield
    finally:
        for n, fn in zip(names, saved):
            setattr(dtensor_cache, n, fn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--number", type=int, default=200)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    params = {f"l{i:03d}": distribute_tensor(torch.randn(4, 2), mesh, [Shard(0)])
              for i in range(LEAVES)}
    grads = {k: distribute_tensor(torch.randn(4, 2), mesh, [Shard(0)]) for k in params}
    tx = ftopt.adamw(1e-3)
    state = tx.init(params)
    for _ in range(2):
        ftopt.step(tx, params, grads, state, donate=True, backend="fused")
    execute.PreparedStep.launch = lambda self, *args: None

    def call():
        ftopt.step(tx, params, grads, state, donate=True, backend="fused")

    def fresh():
        ftopt.step(tx, params, grads, state, donate=False, backend="fused")

    def update():
        tx.update(grads, state, params, backend="fused")

    fresh(), update()  # (their fused tables)
    rows = {}
    for name, fn in (("donated step", call), ("non-donated step", fresh),
                     ("tx.update", update)):
        rows[f"{name}: cached"] = per_step_us(fn, args.number)
        with no_dtensor_caches():
            rows[f"{name}: full DTensor path"] = per_step_us(fn, args.number)
        rows[f"{name}: speed-up"] = (rows[f"{name}: full DTensor path"]
                                     / rows[f"{name}: cached"])
    with no_dtensor_caches():
        full = phases(call, args.number)
    lines = [f"| fused, {LEAVES} Shard(0) leaves, launch stubbed | us per call |",
             "| --- | ---: |"] + [f"| {k} | {v:.1f} |" for k, v in rows.items()]
    lines += ["", "| full path, phase | us per step |", "| --- | ---: |"]
    lines += [f"| {k} | {v:.1f} |" for k, v in full.items()]
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dtensor_host.json").write_text(json.dumps({"steps": rows, "full_path": full},
                                                           indent=1))
    (args.out / "dtensor_host.md").write_text(table + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
