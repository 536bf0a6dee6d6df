"""The compact-state targets (8-bit and bf16 states at the bandwidth floor, skip_zeros
on every layout), each met or not, from the files one GPU session writes.

    python3 benchmarks/compact_targets.py --step DIR/gpu_results.json \\
        [--ab DIR/watch_ab.json] [--loop DIR/in_loop.json] [--out DIR/targets]

``--step``: ``gpu_step.py``'s results (its ``copy``, ``single``, ``gpt2_fp32``,
``eight_bit`` and ``layouts`` sections; a target whose section is absent is listed as
not measured). ``--ab``: ``skip_watch_ab_gpu.py``'s (the watch against off between the
step's own launches: where skip_zeros' targets are read); ``--loop``:
``skip_in_loop_gpu.py``'s (each step in a training loop's position, reported beside).
Prints the table and writes ``OUT.md`` and ``OUT.json``.

``--run DIR`` (on the GPU) runs the three first, one after another in one session, into
``DIR/step``, ``DIR/ab`` and ``DIR/loop``, then writes ``DIR/targets.{md,json}`` (about
five minutes on an H200); ``--dry-run`` prints their commands.

    python3 benchmarks/compact_targets.py --run DIR
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

# gpu_step.LAYOUTS names of the layouts the skip_zeros targets cover.
SKIP_LAYOUTS = ("fp32", "bf16 params, fp32 states", "bf16 params, bf16 states",
                "fp32 params, 8-bit states")
SKIP_COST, SKIP_SPEEDUP = 3.0, 1.25  # % slower with dense gradients; x with zero rows


def _rows(table: dict | None) -> dict:
    return {r["name"]: r for r in (table or {}).get("rows", []) if r.get("available")}


def _ratio(rows: dict, peer: str, ours: str, key: str = "ms") -> float | None:
    a, b = rows.get(peer), rows.get(ours)
    return a[key] / b[key] if a and b else None


def step_targets(res: dict) -> list[dict]:
    """(target, value, threshold, met) rows from ``gpu_step.py``'s results."""
    sec = res.get("sections", {})
    out = []

    def add(target, value, want, fmt="{:.2f}", higher=True):
        met = None if value is None else (value >= want if higher else value <= want)
        out.append(dict(target=target, value=value, want=want, met=met,
                        shown="not measured" if value is None else fmt.format(value)))

    eight = sec.get("eight_bit", {})
    ours = "ftopt adam(state_bits=8) auto"
    single, tree = _rows(eight.get("single")), _rows(eight.get("tree"))
    add("8-bit Adam, 64M tensor: of copy", (single.get(ours) or {}).get("of_copy"), 0.7)
    add("8-bit Adam, 64M tensor: x flashoptim int8",
        _ratio(single, "flashoptim FlashAdam (int8 states)", ours), 1.2, "{:.2f}x")
    add("8-bit Adam, GPT-2: of copy", (tree.get(ours) or {}).get("of_copy"), 0.7)
    add("8-bit Adam, GPT-2: x bnb Triton 8-bit per tensor",
        _ratio(tree, "bnb Triton 8-bit (direct)", ours), 4.5, "{:.2f}x")
    tables = sec.get("layouts", {}).get("tables", {})
    bf16 = _rows(tables.get("bf16 params, bf16 states: dense"))
    add("bf16 params + states, GPT-2: of copy", (bf16.get("ftopt fused") or {}).get("of_copy"),
        0.9)
    add("bf16 params + states, GPT-2: x torch fused Adam, whole call",
        (bf16.get("torch Adam fused (bf16 states)") or {}).get("call_vs_ftopt"), 2.0,
        "{:.2f}x")
    for name, title in (("single", "64M tensor"), ("gpt2_fp32", "GPT-2")):
        add(f"32-bit Adam, {title}: of copy (no regression)",
            (_rows(sec.get(name)).get("ftopt fused") or {}).get("of_copy"), 0.97)
    summary = sec.get("layouts", {}).get("summary", {})
    for layout in SKIP_LAYOUTS:
        dense, sparse = summary.get(f"{layout}: dense"), summary.get(f"{layout}: sparse")
        add(f"skip_zeros, {layout}: dense, % over off (gpu_step)",
            dense and dense["cost_pct"], SKIP_COST, "{:+.1f}%", higher=False)
        add(f"skip_zeros, {layout}: 90% zero rows, x off (gpu_step)",
            sparse and sparse["speedup"], SKIP_SPEEDUP, "{:.3f}x")
    return out


def skip_targets(ab: list | None, loop: list | None) -> list[dict]:
    """skip_zeros rows from the watch A/B (the watch's ms over off's) and the loop's
    position (off's us over the watch's)."""
    out = []
    for source, rows in (("A/B", ab), ("loop", loop)):
        if rows is None:
            continue
        for layout in SKIP_LAYOUTS:
            for grads in ("dense", "sparse"):
                if source == "A/B":
                    row = next((r for r in rows if r["layout"] == layout and
                                r["grads"] == grads and r["variant"] == "watch"), None)
                    slower = row and row["vs_off"]
                else:
                    row = next((r for r in rows if r["layout"] == layout and
                                r["grads"] == grads), None)
                    slower = row and 1 / row["median"]
                if grads == "dense":
                    value = None if slower is None else (slower - 1) * 100
                    met = None if value is None else value <= SKIP_COST
                    shown, want = ("not measured" if value is None
                                   else f"{value:+.1f}%"), SKIP_COST
                    what = "dense, % over off"
                else:
                    value = None if slower is None else 1 / slower
                    met = None if value is None else value >= SKIP_SPEEDUP
                    shown, want = ("not measured" if value is None
                                   else f"{value:.3f}x"), SKIP_SPEEDUP
                    what = "90% zero rows, x off"
                out.append(dict(target=f"skip_zeros, {layout}: {what} ({source})",
                                value=value, want=want, met=met, shown=shown))
    return out


HERE = pathlib.Path(__file__).resolve().parent


def run_commands(folder: pathlib.Path) -> list[list[str]]:
    """The benchmark runs behind every target, into ``folder``'s ``step``, ``ab`` and
    ``loop``: the step's sections (no torch.compile peers: none is a target), the watch
    A/B and the loop's position, four rounds each."""
    py = sys.executable
    return [[py, str(HERE / "gpu_step.py"), "--sections",
             "copy,single,gpt2_fp32,eight_bit,layouts", "--compile", "off",
             "--out", str(folder / "step")],
            [py, str(HERE / "skip_watch_ab_gpu.py"), str(folder / "ab"), "--rounds=4",
             "--kinds=dense,sparse"],
            [py, str(HERE / "skip_in_loop_gpu.py"), str(folder / "loop"), "--rounds=4"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step")
    parser.add_argument("--ab")
    parser.add_argument("--loop")
    parser.add_argument("--out")
    parser.add_argument("--run", help="run the benchmarks into this folder first")
    parser.add_argument("--dry-run", action="store_true", help="with --run: print them")
    args = parser.parse_args()
    if args.run:
        folder = pathlib.Path(args.run)
        for cmd in run_commands(folder):
            print(" ".join(cmd), flush=True)
            if not args.dry_run:
                subprocess.run(cmd, check=True)
        if args.dry_run:
            return
        args.step = str(folder / "step" / "gpu_results.json")
        args.ab = str(folder / "ab" / "watch_ab.json")
        args.loop = str(folder / "loop" / "in_loop.json")
        args.out = args.out or str(folder / "targets")
    if not args.step:
        parser.error("--step (or --run) is required")

    def load(path):
        return json.loads(pathlib.Path(path).read_text()) if path else None

    rows = step_targets(load(args.step)) + skip_targets(load(args.ab), load(args.loop))
    verdict = {True: "met", False: "NOT met", None: "-"}
    lines = ["| target | value | met |", "| --- | --- | --- |"]
    lines += [f"| {r['target']} | {r['shown']} | {verdict[r['met']]} |" for r in rows]
    text = "\n".join(lines)
    print(text)
    missed = [r["target"] for r in rows if r["met"] is False]
    absent = sum(r["met"] is None for r in rows)
    print(f"\n{len(rows) - len(missed) - absent} met, {absent} not measured, "
          f"{len(missed)} not met: " + ("; ".join(missed) or "none"))
    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(text + "\n")
        out.with_suffix(".json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
