"""The fuzzed contract of ``tests/test_fuzz.py`` by the ten thousand, on a GPU (or a CPU).

Runs the property checks of ``tests/fuzz_checks.py`` (fused == eager, skip_zeros exact,
purity, donate, checkpoint round trip) on examples drawn with ``random.Random`` through the
same sampling helpers as the hypothesis tests (``tests/fuzz_cases.py``), so hypothesis is
not needed here. On a GPU compiling a Triton kernel (~0.3-1 s) costs far more than a step,
so each seed draws a bounded pool of chain *structures* (``--structures``, default 30),
each with a fixed pair of param dtypes (``--dtypes``: every dtype of a tree is a kernel
group of its own), and every example picks one of them with fresh hyperparameters
(runtime kernel arguments), pytree, dtypes among the pair, gradients and zero patterns.
Work is spread over ``--workers`` processes that share the GPU(s) and the on-disk Triton
cache; ``--gpus N`` puts them round-robin on N GPUs.

    python benchmarks/fuzz.py                                   # GPU: 10,000 examples
    python benchmarks/fuzz.py --gpus 2                          # the same on 2 GPUs
    python benchmarks/fuzz.py --shard 0/2 --out r0              # half of them here,
    python benchmarks/fuzz.py --shard 1/2 --out r1              # the other half there,
    python benchmarks/fuzz.py --merge r0.json r1.json --out all # one report
    TRITON_INTERPRET=1 python benchmarks/fuzz.py --examples 50  # CPU: a quick check

Prints a table (examples, checks and failures by property, time) and writes
``<out>.json`` and ``<out>.md`` (default ``benchmarks/results/fuzz_<device>``). Every
failure is recorded with its case and ``--replay SEED:INDEX`` to rerun it alone (with the
run's ``--structures`` and ``--dtypes``; ``SEED:WORKER:INDEX`` replays an example of a
run made before shards existed). A replay names that case at the run's commit: a seed's
structures are drawn from the test registry, so a new entry changes the pools (the cases
``tests/test_fuzz_pinned.py`` replays are pinned by their structures, in
``tests/fuzz_pins.py``).

Kernel variety, measured on a CPU (distinct compile keys, as Triton would specialize them,
counted by hooking the launch path under ``TRITON_INTERPRET=1``; seed 0, 30 structures,
300 examples): any dtype per structure 397 keys, new ones per 100 examples 204, 110, 83
(still 0.6 per example at the end); two dtypes per structure 325 keys, 203, 89, 33 (0.3
per example at the end, falling). Prediction for one H200 with 16 cores (a profile of the
former runner there: 92 s per 33 examples per worker, of which 18 s formatted tensors in
an exception message, now gone, and 45 s compiled kernels): with about 400 kernels
compiled once into the shared cache, an example costs a worker ~1 s, so 16 workers run
10,000 examples in ~11-13 minutes; two GPUs (``--gpus 2``, 32 cores) about half that.
Measured on one H200 (15 workers): 7.1 examples a second for seed 13, 4.2 for seed 14
(~24 and ~40 minutes for 10,000): the prediction was 2-3x too fast. On a CPU the same
examples cost a worker ~0.15 s outside the interpreted kernels, so the GPU's own queue is
the likely limit: 15 processes share it (their kernels time-sliced), and the checks made
~750 ``torch.equal`` calls an example, each a kernel and a device sync. The purity and
bitwise checks now compare all tensors of a device as one concatenation of their bytes
(counted over 12 examples of seed 14 on a CPU: ``equal`` 8,971 -> 1,951 calls, ``clone``
7,579 -> 981 plus 1,819 ``cat``; host reads 10,223 -> 3,203), and the relative errors and
skip_zeros comparisons run on host copies. Predicted: ~1.5-2x more
examples a second on the GPU. Got: 37-53 examples a second on two H200s with 30 workers
(seeds 17 and 18: 10,000 examples in 251-270 s), ~5x per GPU.
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


DTYPE_NAMES = ("fp32", "fp16", "bf16")


def structure_pool(seed: int, size: int, dtypes: int = 3) -> list:
    """The structures of one seed (the same in every worker), each with the param dtypes
    its examples may use: ``dtypes`` of fp32/fp16/bf16 drawn per structure (``None``, any
    dtype, when 3: the draws of runs before ``--dtypes`` existed)."""
    out = []
    for i in range(size):
        s = draw_structure(RandomSource(random.Random(f"pool-{seed}-{i}")))
        names = None if dtypes >= 3 else tuple(
            random.Random(f"dtypes-{seed}-{i}").sample(DTYPE_NAMES, dtypes))
        out.append((s, names))
    return out


def example(seed: int, index: int, pool: list, device: str, worker: int | None = None):
    """The case of one example: its own ``random.Random``, so it replays alone (and is
    the same whichever worker, shard or GPU runs it). ``worker``: the key of runs before
    ``--shard`` existed (their replays read ``SEED:WORKER:INDEX``)."""
    key = f"{seed}-{index}" if worker is None else f"{seed}-{worker}-{index}"
    src = RandomSource(random.Random(key))
    structure, dtypes = pool[src.integers(0, len(pool) - 1)]
    return draw_case(src, structure, device, dtypes=dtypes)


def shard_indices(n: int, shard: tuple[int, int]) -> range:
    """The example indices below ``n`` of shard ``(k, of)``: every ``of``-th from ``k``,
    so that the shards of one seed are disjoint and together all ``n``."""
    k, of = shard
    return range(k, n, of)


def _device(device: str, worker: int, gpus: int) -> str:
    """Worker ``worker``'s device: GPUs assigned round-robin when ``gpus`` > 1."""
    if gpus <= 1 or device == "cpu":
        return device
    index = worker % gpus
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def work(job: tuple) -> dict:
    """This worker's share (every ``workers``-th) of one seed's shard of examples."""
    seed, worker, workers, n, shard, pool_size, dtypes, device, gpus, deadline = job
    torch.set_num_threads(1)
    device = _device(device, worker, gpus)
    pool = structure_pool(seed, pool_size, dtypes)
    checked, failed = collections.Counter(), collections.Counter()
    failures = []
    t0 = time.perf_counter()
    count = 0
    for index in shard_indices(n, shard)[worker::workers]:
        if deadline is not None and time.time() > deadline:
            break  # the summary says how many ran
        case = example(seed, index, pool, device)
        for prop, message in fuzz_checks.run_all(case).items():
            checked[prop] += 1
            if message is not None:
                failed[prop] += 1
                if len(failures) < MAX_FAILURES_KEPT:
                    failures.append({"property": prop, "message": message[:2000],
                                     "case": case.describe(),
                                     "replay": f"{seed}:{index}"})
        count += 1
    return {"examples": count, "checked": dict(checked), "failed": dict(failed),
            "failures": failures, "seconds": time.perf_counter() - t0,
            "code_diff_elements": fuzz_checks.STATS["code_diff_elements"]}


def warm(job: tuple) -> float:
    """Compile the kernels of every structure once before the examples run: each worker
    runs a few cases of its share of the pool (structures ``worker, worker + workers,
    ...``), so the shared on-disk Triton cache holds each kernel once instead of every
    worker compiling the same ones at the same time. Results are not counted."""
    seed, worker, workers, pool_size, dtypes, device, gpus, deadline = job
    torch.set_num_threads(1)
    device = _device(device, worker, gpus)
    pool = structure_pool(seed, pool_size, dtypes)
    t0 = time.perf_counter()
    for k in range(worker, pool_size, workers):
        structure, names = pool[k]
        for rep in range(3):  # dtypes, tree shapes and 8-bit leaves vary by case
            if deadline is not None and time.time() > deadline:
                return time.perf_counter() - t0
            src = RandomSource(random.Random(f"warm-{seed}-{k}-{rep}"))
            fuzz_checks.run_all(draw_case(src, structure, device, dtypes=names))
    return time.perf_counter() - t0


def replay(spec: str, pool_size: int, dtypes: int, device: str) -> int:
    """One example again: ``SEED:INDEX``, or ``SEED:WORKER:INDEX`` for the examples of
    runs before ``--shard`` existed (drawn as they were then: any dtype)."""
    parts = [int(x) for x in spec.split(":")]
    seed, index = parts[0], parts[-1]
    worker = parts[1] if len(parts) == 3 else None
    if worker is not None:
        dtypes = 3
    case = example(seed, index, structure_pool(seed, pool_size, dtypes), device, worker)
    print(case.describe())
    results = fuzz_checks.run_all(case)
    for prop, message in results.items():
        print(f"{prop}: {'ok' if message is None else message}")
    return int(any(m is not None for m in results.values()))


def markdown(summary: dict) -> str:
    shards = ", ".join(summary["shards"])
    lines = [f"# Fuzzed contract on {summary['device']}", "",
             f"{summary['examples']} examples ({summary['examples_per_seed']} per seed, "
             f"shards {shards} of the seeds {', '.join(map(str, summary['seeds']))}; a pool "
             f"of {summary['structures']} structures per seed, {summary['dtypes']} param "
             f"dtypes per structure; {summary['workers']} workers on {summary['gpus']} "
             f"device(s)) in {summary['seconds']:.0f} s; 8-bit codes that differ between "
             f"fused and eager: {summary['code_diff_elements']}.", "",
             *([f"Merged from {len(summary['calls'])} calls (times summed): "
                + "; ".join(summary["calls"]) + ".", ""] if summary.get("calls") else []),
             f"Replay a failure: `python3 benchmarks/fuzz.py --replay SEED:INDEX "
             f"{summary['replay_flags']}`.", "",
             "| property | checked | failed |", "| --- | ---: | ---: |"]
    for prop in fuzz_checks.PROPERTIES:
        lines.append(f"| {prop} | {summary['checked'].get(prop, 0)} | "
                     f"{summary['failed'].get(prop, 0)} |")
    for f in summary["failures"]:
        lines += ["", f"## {f['property']} (replay {f['replay']})", "", "```",
                  f["message"], f["case"], "```"]
    return "\n".join(lines) + "\n"


_SAME = ("seeds", "examples_per_seed", "structures", "dtypes", "torch")


def merge(paths: list[str]) -> dict:
    """One summary of the result files of several calls (shards of the same seeds, on
    other GPUs or machines, at once or one after another): counts and times summed, each
    call's workers, GPUs and time kept."""
    parts = [json.loads(pathlib.Path(p).read_text()) for p in paths]
    first = parts[0]
    for p, part in zip(paths, parts):
        for key in _SAME:
            if part.get(key) != first.get(key):
                raise SystemExit(f"--merge: {p} has {key}={part.get(key)!r}, "
                                 f"{paths[0]} {first.get(key)!r}")
    shards = [s for part in parts for s in part["shards"]]
    if len(set(shards)) != len(shards) or len({s.split("/")[1] for s in shards}) > 1:
        raise SystemExit(f"--merge: the shards {shards} are not disjoint shards of one split")
    checked, failed = collections.Counter(), collections.Counter()
    for part in parts:
        checked.update(part["checked"])
        failed.update(part["failed"])
    return {**{k: first[k] for k in _SAME}, "replay_flags": first["replay_flags"],
            "device": " + ".join(sorted({p["device"] for p in parts})),
            "shards": shards, "gpus": max(p["gpus"] for p in parts),
            "workers": max(p["workers"] for p in parts),
            "examples": sum(p["examples"] for p in parts),
            "seconds": sum(p["seconds"] for p in parts),
            "calls": [f"shard {'+'.join(p['shards'])}: {p['examples']} examples, "
                      f"{p['workers']} workers on {p['gpus']} GPU(s), {p['seconds']:.0f} s"
                      for p in parts],
            "checked": dict(checked), "failed": dict(failed),
            "code_diff_elements": sum(p["code_diff_elements"] for p in parts),
            "failures": [f for p in parts for f in p["failures"]][:MAX_FAILURES_KEPT]}


def report(summary: dict, out: pathlib.Path) -> int:
    """Print the table, write ``<out>.json`` and ``<out>.md``; 1 if anything failed."""
    print(f"{'property':<16}{'checked':>10}{'failed':>10}")
    for prop in fuzz_checks.PROPERTIES:
        print(f"{prop:<16}{summary['checked'].get(prop, 0):>10}"
              f"{summary['failed'].get(prop, 0):>10}")
    seconds = max(summary["seconds"], 1e-9)
    print(f"{summary['examples']} examples in {seconds:.1f} s "
          f"({summary['examples'] / seconds:.1f}/s); differing 8-bit codes: "
          f"{summary['code_diff_elements']}")
    for f in summary["failures"][:5]:
        print(f"\nFAILED {f['property']} (--replay {f['replay']} {summary['replay_flags']}): "
              f"{f['message'][:500]}\n{f['case']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(summary))
    print(f"wrote {out}.json and {out}.md")
    return int(sum(summary["failed"].values()) > 0)


def _shard(text: str) -> tuple[int, int]:
    k, of = (int(x) for x in text.split("/"))
    if not 0 <= k < of:
        raise argparse.ArgumentTypeError(f"--shard K/N needs 0 <= K < N, got {text}")
    return k, of


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=None,
                    help="examples per seed, all shards together (default: 10000 on a GPU, "
                         "50 on a CPU)")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (default: 0)")
    ap.add_argument("--structures", type=int, default=30, help="structures per seed")
    ap.add_argument("--dtypes", type=int, default=2, choices=(1, 2, 3),
                    help="param dtypes per structure, of fp32/fp16/bf16 (default: 2; 3 is "
                         "any dtype, the draws of earlier runs)")
    ap.add_argument("--shard", type=_shard, default=(0, 1),
                    help="K/N: this call runs every N-th example from K (default: 0/1)")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs, workers round-robin on them")
    ap.add_argument("--workers", type=int, default=None,
                    help="processes (default: min(16 per GPU, cores) on a GPU, 1 on a CPU)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    ap.add_argument("--out", default=None, help="output path without suffix")
    ap.add_argument("--replay", default=None,
                    help="SEED:INDEX of one example (SEED:WORKER:INDEX: of an earlier run)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="sum the result files of several shards into one report (--out)")
    ap.add_argument("--warm", action="store_true",
                    help="a compile warm-up pass over the structures first (GPU; on the H200 "
                         "it took 420 s for 60 structures: worth it only for long runs)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds after which no new example starts (results are kept)")
    args = ap.parse_args()
    if args.merge:
        out = pathlib.Path(args.out or ROOT / "benchmarks" / "results" / "fuzz_merged")
        return report(merge(args.merge), out)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device != "cpu"
    gpus = args.gpus if gpu else 1
    if args.replay:
        return replay(args.replay, args.structures, args.dtypes, device)
    workers = args.workers or (min(16 * gpus, os.cpu_count() or 1) if gpu else 1)
    n = args.examples if args.examples is not None else (10_000 if gpu else 50)
    seeds = [int(s) for s in args.seeds.split(",")]
    name = torch.cuda.get_device_name().split()[-1].lower() if gpu else "cpu"
    shard_tag = "" if args.shard == (0, 1) else f"_shard{args.shard[0]}of{args.shard[1]}"
    out = pathlib.Path(args.out or ROOT / "benchmarks" / "results" / f"fuzz_{name}{shard_tag}")
    deadline = None if args.time_limit is None else time.time() + args.time_limit
    jobs = [(seed, w, workers, n, args.shard, args.structures, args.dtypes, device, gpus,
             deadline) for seed in seeds for w in range(workers)]
    t0 = time.perf_counter()
    warm_jobs = [(seed, w, workers, args.structures, args.dtypes, device, gpus, deadline)
                 for seed in seeds for w in range(workers)] if gpu and args.warm else []
    if workers == 1:
        warm_seconds = [warm(j) for j in warm_jobs]
        results = [work(j) for j in jobs]
    else:
        with mp.get_context("spawn").Pool(workers) as pool:
            warm_seconds = pool.map(warm, warm_jobs, chunksize=1)
            results = pool.map(work, jobs, chunksize=1)
    if warm_seconds:
        print(f"warm-up (kernels compiled once per structure): {max(warm_seconds):.0f} s")
    checked, failed = collections.Counter(), collections.Counter()
    for r in results:
        checked.update(r["checked"])
        failed.update(r["failed"])
    summary = {
        "device": torch.cuda.get_device_name() if gpu else f"cpu ({platform.processor()})",
        "seeds": seeds, "examples_per_seed": n, "structures": args.structures,
        "dtypes": args.dtypes, "torch": torch.__version__,
        "replay_flags": f"--structures {args.structures} --dtypes {args.dtypes}",
        "shards": [f"{args.shard[0]}/{args.shard[1]}"], "gpus": gpus, "workers": workers,
        "examples": sum(r["examples"] for r in results),
        "seconds": time.perf_counter() - t0, "checked": dict(checked), "failed": dict(failed),
        "code_diff_elements": sum(r["code_diff_elements"] for r in results),
        "failures": [f for r in results for f in r["failures"]][:MAX_FAILURES_KEPT],
    }
    return report(summary, out)


if __name__ == "__main__":
    sys.exit(main())
