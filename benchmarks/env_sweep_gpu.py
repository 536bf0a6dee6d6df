"""The watch A/B (``skip_watch_ab_gpu.py``) under each combination of environment
settings, each in a process of its own (the settings are read at import), the
combinations in turn ``--repeats`` times against drift. Prints, per combination and
layout, the watch against no skip_zeros with dense gradients, 90% of the embedding's rows
zero and every block part zero (each repeat, then the median; then the median of the
ratios with the queue primed), and the host's ms a call; writes ``OUT/sweep.json``.
``--steps=N``: the A/B's steps between two events; ``--opt=NAME``: its ``ftopt`` alias.
``--harness=loop``: ``skip_in_loop_gpu.py`` in place of the A/B (each step behind a
matrix-product burst, timed by its own events; dense and sparse gradients; ``--steps``
is its timed steps, ``--burst=N`` its burst's size, ``--names`` its layouts by name),
the watch against off.

    python3 benchmarks/env_sweep_gpu.py OUT --set FTOPT_CARVE_WARPS=,8-bit=2 \\
        --set "FTOPT_CARVE_SPAN=8-bit=2,8-bit=4" [--layouts=8-bit] [--rounds=2] [--repeats=2]
        [--kinds=dense,sparse] [--steps=40] [--opt=adam] [--harness=loop] [--burst=8192]

``--set NAME=a,b`` gives the values ``a`` and ``b``; a value with commas of its own
writes them as ``;`` (``FTOPT_SPAN=16-bit=4;fp32=2``); an empty value leaves the
variable unset.
``--dry-run`` prints the commands only, after checking each combination's values
(``python -m ftopt.lowering`` under it: a malformed value fails here, not on the GPU) and
noting names no ftopt module reads (a copy patched for an A/B may read them).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import statistics
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def check(update: dict, env: dict) -> None:
    """Fail on a value ftopt's backend would refuse; note names it does not read."""
    result = subprocess.run([sys.executable, "-m", "ftopt.lowering"], env={
        **env, "PYTHONPATH": str(HERE.parent)}, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(result.stderr.strip().splitlines()[-1])
    for name in update:
        if f"\n{name}  (default" not in "\n" + result.stdout:
            print(f"   note: no ftopt module reads {name}")


def settings(specs: list[str]) -> list[dict]:
    """Every combination of the ``--set`` lists, as environment updates (None: unset)."""
    axes = []
    for spec in specs:
        name, _, values = spec.partition("=")
        axes.append([(name, v.replace(";", ",") or None) for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)] if axes else [{}]


def label(update: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in update.items() if v is not None) or "defaults"


def summary(rows: list) -> dict:
    """(layout, grads) -> the watch's time over off's, the host's ms of each round, and
    the watch's time over off's with the queue primed (None where not recorded)."""
    off = {(r["layout"], r["grads"]): r for r in rows if r["variant"] == "off"}
    out = {}
    for row in rows:
        if row["variant"] == "watch":
            base = off.get((row["layout"], row["grads"]), {})
            primed = (statistics.median(row["primed_ms"]) / statistics.median(
                base["primed_ms"]) if row.get("primed_ms") and base.get("primed_ms")
                else None)
            out[(row["layout"], row["grads"])] = (row["vs_off"], row.get("host_ms", []),
                                                  primed)
    return out


def loop_summary(rows: list) -> dict:
    """:func:`summary` of ``skip_in_loop_gpu.py``'s rows (no host or primed times)."""
    return {(r["layout"], r["grads"]): (1 / r["median"], [], None) for r in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--set", action="append", default=[], dest="specs")
    parser.add_argument("--layouts", default="8-bit")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kinds", default="", help="the A/B's gradients (default: all)")
    parser.add_argument("--steps", type=int, default=0,
                        help="the A/B's steps between two events (default: its own)")
    parser.add_argument("--opt", default="", help="the A/B's ftopt alias (default: adam)")
    parser.add_argument("--harness", default="ab", choices=["ab", "loop"])
    parser.add_argument("--names", default="",
                        help="--harness=loop: its layouts by name, ';'-separated")
    parser.add_argument("--burst", type=int, default=0,
                        help="--harness=loop: the burst's size (default: its own)")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    combos = settings(args.specs)
    results: dict = {}
    for rep in range(args.repeats):
        for i, update in enumerate(combos):
            env = {k: v for k, v in os.environ.items() if k not in update}
            env.update({k: v for k, v in update.items() if v is not None})
            where = out / f"c{i}_r{rep}"
            loop = args.harness == "loop"
            script = "skip_in_loop_gpu.py" if loop else "skip_watch_ab_gpu.py"
            cmd = [sys.executable, str(HERE / script), str(where),
                   f"--layouts={args.layouts}", f"--rounds={args.rounds}"]
            cmd += [f"--kinds={args.kinds}"] if args.kinds and not loop else []
            cmd += [f"--steps={args.steps}"] if args.steps else []
            cmd += [f"--opt={args.opt}"] if args.opt and not loop else []
            cmd += [f"--burst={args.burst}"] if args.burst and loop else []
            cmd += [f"--names={args.names}"] if args.names and loop else []
            print(f"== {label(update)} (repeat {rep}): {' '.join(cmd)}", flush=True)
            if args.dry_run:
                if rep == 0:
                    check(update, env)
                continue
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
            rows = json.loads((where / ("in_loop.json" if loop else "watch_ab.json"))
                              .read_text())
            results.setdefault(i, []).append(loop_summary(rows) if loop else summary(rows))
    if args.dry_run:
        return
    table = []
    for i, update in enumerate(combos):
        runs = results[i]
        for layout, grads in sorted({key for run in runs for key in run}):
            ratios = [run[(layout, grads)][0] for run in runs if (layout, grads) in run]
            hosts = [h for run in runs for h in run.get((layout, grads), (0, []))[1]]
            shown = (", ".join(f"{1 / r:.3f}x" for r in ratios) if grads == "sparse"
                     else ", ".join(f"{(r - 1) * 100:+.1f}%" for r in ratios))
            med = statistics.median(ratios)
            med_shown = f"{1 / med:.3f}x" if grads == "sparse" else f"{(med - 1) * 100:+.1f}%"
            host = f"; host {statistics.median(hosts):.3f} ms a call" if hosts else ""
            primed = [run[(layout, grads)][2] for run in runs
                      if (layout, grads) in run and run[(layout, grads)][2] is not None]
            if primed:
                pm = statistics.median(primed)
                host += "; queue primed " + (f"{1 / pm:.3f}x" if grads == "sparse"
                                             else f"{(pm - 1) * 100:+.1f}%")
            print(f"{label(update):40s} {layout:30s} {grads:12s} {shown} (median "
                  f"{med_shown}{host})", flush=True)
            table.append(dict(settings=update, layout=layout, grads=grads, vs_off=ratios,
                              host_ms=hosts, primed_vs_off=primed))
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
