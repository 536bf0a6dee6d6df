"""What the register cap search (``FTOPT_CAP_STEP``) costs a cold compile, on a CPU.

A capped kernel that spills past ``tiles.CAP_SPILLS`` compiles again at higher caps
(``launch._fit_cap``). The GPU measures that cost only when a machine comes; this script
measures it here. It records the kernels of ``sass_count.py``'s cases under the
interpreter, compiles each capped one for sm_90 (Triton's whole pipeline and its
``ptxas``, each compile in a fresh cache) at every cap from its own to 128 by 8 and
uncapped, and replays searches over those compiles: the library's ``_fit_cap`` at each
step (a guess from the spills), and stepping up one cap at a time for comparison. Per
kernel and search: the caps compiled, the one launched, and the seconds of the compiles
(the uncapped compile counted where the kernel runs uncapped). Spills are Triton's
``n_spills``: local memory bytes / 4. Put the GPU machine's Triton first on the path
for its ``ptxas`` (``sass_count.py``).

    PYTHONPATH=DIR python benchmarks/cap_search_cost.py [CASE ...] [--steps 0,8,16]
        [--out benchmarks/results/cap_search_cost]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

DEFAULT_CASES = ["adam8_skip", "ademamix8_skip", "ademamix_stddev_lion8_skip_bf16_params",
                 "adam8", "ademamix8"]


def _compile_all(jobs: list[dict]) -> list[dict]:
    """In this process (not interpreted): each capped job at every cap, cold."""
    import sass_count

    out = []
    for job in jobs:
        base = job["options"]["maxnreg"]
        by_cap = {}
        for cap in [*range(base, 129, 8), None]:
            options = {k: v for k, v in job["options"].items() if k != "maxnreg"}
            if cap is not None:
                options["maxnreg"] = cap
            with tempfile.TemporaryDirectory() as cache:
                os.environ["TRITON_CACHE_DIR"] = cache
                start = time.perf_counter()
                res = sass_count.compile_jobs([{**job, "options": options}])[0]
                seconds = time.perf_counter() - start
            by_cap[str(cap)] = {"spills": (res["spills"] or 0) // 4,
                                "registers": res["registers"], "seconds": seconds}
        out.append(by_cap)
    return out


class _Replay:
    """Stands in for a JITFunction: each warmup is one of the recorded compiles."""

    def __init__(self, by_cap: dict):
        self.by_cap, self.caps = by_cap, []

    def warmup(self, *args, grid, **named):
        cap = named.get("maxnreg")
        self.caps.append(cap)
        spills = self.by_cap[str(cap)]["spills"]

        class Compiled:
            def _init_handles(self):
                self.n_spills = spills
        return Compiled()


def _stepping(replay: _Replay, base: int, step: int, limit: int):
    """Up one cap at a time (the first search); the cap launched."""
    cap = base
    while True:
        replay.warmup(grid=(1,), maxnreg=cap)
        if replay.by_cap[str(cap)]["spills"] <= limit:
            return cap
        cap += step
        if step <= 0 or cap > 128:
            return None


def _searches(by_cap: dict, base: int, steps: list[int]) -> list[dict]:
    from ftopt.lowering import launch, tiles

    rows = []
    for step in steps:
        for how in (["guess", "step"] if step else ["guess"]):
            replay = _Replay(by_cap)
            if how == "guess":
                tiles.CAP_STEP = step
                named = {"maxnreg": base}
                launch._fit_cap(replay, [], (1,), named)
                launched = named.get("maxnreg")
            else:
                launched = _stepping(replay, base, step, tiles.CAP_SPILLS)
            compiles = list(replay.caps)
            if launched is None:
                compiles.append(None)  # (the launch compiles it uncapped)
            seconds = sum(by_cap[str(c)]["seconds"] for c in compiles)
            rows.append({"step": step, "search": how if step else "none",
                         "compiled": compiles, "launched": launched, "seconds": seconds})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="*", help=f"sass_count cases (default: {DEFAULT_CASES})")
    ap.add_argument("--steps", default="0,8,16")
    ap.add_argument("--out", help="write <out>.md and <out>.json")
    ap.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.compile:
        json.dump(_compile_all(json.load(sys.stdin)), sys.stdout)
        return
    import sass_count

    jobs = [j for j in sass_count.record(args.cases or DEFAULT_CASES)
            if "maxnreg" in j["options"]]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__, "--compile"], input=json.dumps(jobs),
                          text=True, capture_output=True, env=env, timeout=3600)
    if done.returncode:
        raise SystemExit(done.stderr[-4000:])
    compiled = json.loads(done.stdout)
    steps = [int(s) for s in args.steps.split(",")]
    lines = ["| case | kernel | spills at its cap, +8, ..., 128; uncapped: registers "
             "| search | caps compiled | launched | compile s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    rows = []
    totals: dict = {}
    for i, (job, by_cap) in enumerate(zip(jobs, compiled)):
        base = job["options"]["maxnreg"]
        profile = ", ".join(str(by_cap[str(c)]["spills"]) for c in range(base, 129, 8))
        profile += f"; {by_cap['None']['registers']}"
        for s in _searches(by_cap, base, steps):
            key = f"{s['search']} {s['step']}" if s["step"] else "none"
            totals[key] = totals.get(key, 0.0) + s["seconds"]
            caps = ", ".join("uncapped" if c is None else str(c) for c in s["compiled"])
            lines.append(f"| {job['case']} | {job['name']} {i} | {profile} | "
                         f"{key} | {caps} | {s['launched'] or 'uncapped'} | "
                         f"{s['seconds']:.1f} |")
            rows.append({"case": job["case"], "kernel": job["name"], "index": i,
                         "spills": by_cap, **s})
    lines.append("")
    lines.append("| search | compile s, all kernels |")
    lines.append("| --- | --- |")
    lines += [f"| {k} | {v:.1f} |" for k, v in totals.items()]
    table = "\n".join(lines)
    print(table)
    if args.out:
        sass_count.write(args.out, "The cap search's cold compiles",
                         f"cap_search_cost.py {' '.join(args.cases)} --steps {args.steps}",
                         "", table, rows)


if __name__ == "__main__":
    main()
