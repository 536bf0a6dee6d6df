"""The fuzzed contract of ``tests/test_fuzz.py`` by the ten thousand, on a GPU (or a CPU).

Runs the property checks of ``tests/fuzz_checks.py`` (fused == eager, skip_zeros exact,
purity, donate, checkpoint round trip) on examples drawn with ``random.Random`` through the
same sampling helpers as the hypothesis tests (``tests/fuzz_cases.py``), so hypothesis is
not needed here. On a GPU compiling a Triton kernel (~0.3-1 s) costs far more than a step,
so each seed draws a bounded pool of chain *structures* (``--structures``) and every
example picks one of them with fresh hyperparameters (runtime kernel arguments), pytree,
dtypes, gradients and zero patterns. Work is spread over ``--workers`` processes that share
the GPU (and the on-disk Triton cache).

    python benchmarks/fuzz.py                                   # GPU: 10,000 examples
    TRITON_INTERPRET=1 python benchmarks/fuzz.py --examples 50  # CPU: a quick check

Prints a table (examples, checks and failures by property, time) and writes
``<out>.json`` and ``<out>.md`` (default ``benchmarks/results/fuzz_<device>``). Every
failure is recorded with its case and ``--replay SEED:WORKER:INDEX`` to rerun it alone.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import pathlib
import platform
import random
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fuzz_checks  # noqa: E402
from fuzz_cases import RandomSource, draw_case, draw_structure  # noqa: E402

MAX_FAILURES_KEPT = 40


def structure_pool(seed: int, size: int) -> list:
    """The structures of one seed (the same in every worker)."""
    return [draw_structure(RandomSource(random.Random(f"pool-{seed}-{i}")))
            for i in range(size)]


def example(seed: int, worker: int, index: int, pool: list, device: str):
    """The case of one example: its own ``random.Random``, so it replays alone."""
    src = RandomSource(random.Random(f"{seed}-{worker}-{index}"))
    structure = pool[src.integers(0, len(pool) - 1)]
    return draw_case(src, structure, device)


def work(job: tuple) -> dict:
    """Examples ``index = worker, worker + workers, ...`` below ``n`` of one seed."""
    seed, worker, workers, n, pool_size, device, deadline = job
    torch.set_num_threads(1)
    pool = structure_pool(seed, pool_size)
    checked, failed = collections.Counter(), collections.Counter()
    failures = []
    t0 = time.perf_counter()
    count = 0
    for index in range(worker, n, workers):
        if deadline is not None and time.time() > deadline:
            break  # the summary says how many ran
        case = example(seed, worker, index, pool, device)
        for prop, message in fuzz_checks.run_all(case).items():
            checked[prop] += 1
            if message is not None:
                failed[prop] += 1
                if len(failures) < MAX_FAILURES_KEPT:
                    failures.append({"property": prop, "message": message[:2000],
                                     "case": case.describe(),
                                     "replay": f"{seed}:{worker}:{index}"})
        count += 1
    return {"examples": count, "checked": dict(checked), "failed": dict(failed),
            "failures": failures, "seconds": time.perf_counter() - t0,
            "code_diff_elements": fuzz_checks.STATS["code_diff_elements"]}


def warm(job: tuple) -> float:
    """Compile the kernels of every structure once before the examples run: each worker
    runs a few cases of its share of the pool (structures ``worker, worker + workers,
    ...``), so the shared on-disk Triton cache holds each kernel once instead of every
    worker compiling the same ones at the same time. Results are not counted."""
    seed, worker, workers, pool_size, device, deadline = job
    torch.set_num_threads(1)
    pool = structure_pool(seed, pool_size)
    t0 = time.perf_counter()
    for k in range(worker, pool_size, workers):
        for rep in range(3):  # dtypes, tree shapes and 8-bit leaves vary by case
            if deadline is not None and time.time() > deadline:
                return time.perf_counter() - t0
            src = RandomSource(random.Random(f"warm-{seed}-{k}-{rep}"))
            fuzz_checks.run_all(draw_case(src, pool[k], device))
    return time.perf_counter() - t0


def replay(spec: str, pool_size: int, device: str, workers: int) -> int:
    seed, worker, index = (int(x) for x in spec.split(":"))
    case = example(seed, worker, index, structure_pool(seed, pool_size), device)
    print(case.describe())
    results = fuzz_checks.run_all(case)
    for prop, message in results.items():
        print(f"{prop}: {'ok' if message is None else message}")
    return int(any(m is not None for m in results.values()))


def markdown(summary: dict) -> str:
    lines = [f"# Fuzzed contract on {summary['device']}", "",
             f"{summary['examples']} examples ({summary['examples_per_seed']} for each of the "
             f"seeds {', '.join(map(str, summary['seeds']))}; a pool of "
             f"{summary['structures']} structures per seed; {summary['workers']} workers) in "
             f"{summary['seconds']:.0f} s; 8-bit codes "
             f"that differ between fused and eager: {summary['code_diff_elements']}.", "",
             "| property | checked | failed |", "| --- | ---: | ---: |"]
    for prop in fuzz_checks.PROPERTIES:
        lines.append(f"| {prop} | {summary['checked'].get(prop, 0)} | "
                     f"{summary['failed'].get(prop, 0)} |")
    for f in summary["failures"]:
        lines += ["", f"## {f['property']} (replay {f['replay']})", "", "```",
                  f["message"], f["case"], "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=None,
                    help="examples per seed (default: 10000 on a GPU, 50 on a CPU)")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (default: 0)")
    ap.add_argument("--structures", type=int, default=300, help="structures per seed")
    ap.add_argument("--workers", type=int, default=None,
                    help="processes (default: min(12, cores) on a GPU, 1 on a CPU)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    ap.add_argument("--out", default=None, help="output path without suffix")
    ap.add_argument("--replay", default=None, help="SEED:WORKER:INDEX of one example")
    ap.add_argument("--warm", action="store_true",
                    help="a compile warm-up pass over the structures first (GPU; on the H200 "
                         "it took 420 s for 60 structures: worth it only for long runs)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds after which no new example starts (results are kept)")
    args = ap.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device != "cpu"
    workers = args.workers or (min(12, os.cpu_count() or 1) if gpu else 1)
    if args.replay:
        return replay(args.replay, args.structures, device, workers)
    n = args.examples if args.examples is not None else (10_000 if gpu else 50)
    seeds = [int(s) for s in args.seeds.split(",")]
    name = torch.cuda.get_device_name().split()[-1].lower() if gpu else "cpu"
    out = pathlib.Path(args.out or ROOT / "benchmarks" / "results" / f"fuzz_{name}")
    deadline = None if args.time_limit is None else time.time() + args.time_limit
    jobs = [(seed, w, workers, n, args.structures, device, deadline) for seed in seeds
            for w in range(workers)]
    t0 = time.perf_counter()
    warm_jobs = [(seed, w, workers, args.structures, device, deadline) for seed in seeds
                 for w in range(workers)] if gpu and args.warm else []
    if workers == 1:
        warm_seconds = [warm(j) for j in warm_jobs]
        results = [work(j) for j in jobs]
    else:
        with mp.get_context("spawn").Pool(workers) as pool:
            warm_seconds = pool.map(warm, warm_jobs, chunksize=1)
            results = pool.map(work, jobs, chunksize=1)
    if warm_seconds:
        print(f"warm-up (kernels compiled once per structure): {max(warm_seconds):.0f} s")
    seconds = time.perf_counter() - t0
    checked, failed = collections.Counter(), collections.Counter()
    for r in results:
        checked.update(r["checked"])
        failed.update(r["failed"])
    summary = {
        "device": torch.cuda.get_device_name() if gpu else f"cpu ({platform.processor()})",
        "seeds": seeds, "examples_per_seed": n, "structures": args.structures,
        "workers": workers, "examples": sum(r["examples"] for r in results),
        "seconds": seconds, "checked": dict(checked), "failed": dict(failed),
        "code_diff_elements": sum(r["code_diff_elements"] for r in results),
        "failures": [f for r in results for f in r["failures"]][:MAX_FAILURES_KEPT],
        "torch": torch.__version__,
    }
    print(f"{'property':<16}{'checked':>10}{'failed':>10}")
    for prop in fuzz_checks.PROPERTIES:
        print(f"{prop:<16}{checked.get(prop, 0):>10}{failed.get(prop, 0):>10}")
    print(f"{summary['examples']} examples in {seconds:.1f} s "
          f"({summary['examples'] / seconds:.1f}/s); differing 8-bit codes: "
          f"{summary['code_diff_elements']}")
    for f in summary["failures"][:5]:
        print(f"\nFAILED {f['property']} (--replay {f['replay']}): {f['message'][:500]}\n"
              f"{f['case']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(summary))
    print(f"wrote {out}.json and {out}.md")
    return int(sum(failed.values()) > 0)


if __name__ == "__main__":
    sys.exit(main())
