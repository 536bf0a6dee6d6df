"""Every optimizer family of the catalogue on GPT-2-small shapes (fp32), fused, one run.

For each alias of the test registry (``tests/registry.py``) with no matrix stage of its
own, and each fusible transform named in ``--only`` (chained with ``scale(-1e-3)``): the
time of one donated ``ftopt.step`` on the 148-leaf GPT-2 tree, its nominal bytes per
element and the fraction of the device's copy bandwidth measured in the same run, twice:
for the main kernel alone (``B/elt``, what ``ftopt.explain`` says it reads and writes)
and for the whole step (``step B/elt``: plus what the norm passes read again, LAMB's,
LARS' and Fromage's params and updates). Both fractions divide by the time of the whole
step; "step of copy" is the one to hold against 1.0.

Expected on the H200 for ``noisy_sgd`` (12 B/elt, copy time 0.355 ms): since its noise is
drawn per pair of elements, each element costs about half of the former 3 finalizer
rounds (8 integer ops each), 2 int-to-float conversions, a ``log``, a correctly rounded
``sqrt`` and a ``cos`` (about 95 instructions a element before, measured 0.554 ms, 0.64
of copy: compute-bound): about 14 integer ops, 1 conversion, half a ``log`` + ``sqrt`` +
``sin``/``cos`` and 3 multiplies a element, about 50-55 instructions, which the issue rate
of 132 SMs covers in about 0.3 ms, under the memory time: 0.36-0.40 ms, >= 0.9 of copy.

Measured (H200, 2026-11-30): 0.418 ms (0.84 of copy) with 512-element tiles, 0.367 ms
(0.96) with the 1024-element tiles that noise and reduction kernels now get
(``tiles.HEAVY_TILE``): per-program work (the leaf's key; partial sums) halved.

``schedule_free_sgd``'s kernel moves exactly its 20 B/elt (reads g, p, z; writes p, z:
its generated source has three loads and two stores); the rest of its step is the
running scalars' torch ops on 0-d tensors (see the note column), each a tiny kernel of
a few microseconds: 24 of them a step before they were trimmed to 13 + 1 (no fill per
host number, no copy of b1), which is all the time over 20 B/elt there is to find.

``prodigy`` now runs as one rule (it was a torch stage: 20.4 ms in ``families_h200_after.md``,
29 ms on GPT-2 small elsewhere): a reduction pass reading g, p, x0 and s (16 B/elt) and the
donated main kernel (reads g, p, m, v, s: 20; writes p, m, v, s: 16; x0, which the rule
returns as it was, is neither read nor written there; it was 24 + 20 before), 52 B/elt
for the whole step, 3 launches and no torch op on 0-d tensors. Expected on the H200:
about 6.5 GB a step, ~1.6 ms at the copy bandwidth (1.9 ms at the former 60 B/elt); the
note column should read "1 norm pass(es); 0 + 1 ops on 0-d tensors" and "step of copy"
near the other norm families'. ``madgrad`` likewise no longer writes x0 (B/elt 32, was
36).

    python3 benchmarks/families_gpu.py --out DIR        # GPU; writes families.json / .md
    python3 benchmarks/families_gpu.py --out DIR --states 8   # 8-bit states (or bf16)
    python3 benchmarks/families_gpu.py --smoke --out DIR  # CPU interpreter, tiny tree
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import pathlib
import re
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import torch  # noqa: E402

import ftopt  # noqa: E402


def copy_tbps(device, numel: int) -> float:
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        dst.copy_(src)
    e.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 4 * 20 / (s.elapsed_time(e) * 1e-3) / 1e12


def time_family(tx, params, grads, iters: int, device) -> tuple[float, float]:
    """(ms of one step, ms a step in a loop). One step: the median over ``iters`` steps
    each timed alone, starting on an idle GPU, so a step whose host work outlasts its
    kernels (launches waiting on the host: reduction passes, running scalars) counts the
    host's time too. In a loop: ``iters`` steps back to back between two events, the
    host running ahead of the GPU as in training, where the step is queued behind the
    backward pass."""
    p = {k: v.clone() for k, v in params.items()}
    state = tx.init(p)
    for _ in range(3):
        p, state = ftopt.step(tx, p, grads, state, donate=True, backend="fused")
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            p, state = ftopt.step(tx, p, grads, state, donate=True, backend="fused")
        ms = (time.perf_counter() - t0) / iters * 1e3
        return ms, ms
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        p, state = ftopt.step(tx, p, grads, state, donate=True, backend="fused")
        e.record()
        ts.append((s, e))
    torch.cuda.synchronize()
    one = statistics.median(s.elapsed_time(e) for s, e in ts)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        p, state = ftopt.step(tx, p, grads, state, donate=True, backend="fused")
    e.record()
    torch.cuda.synchronize()
    return one, s.elapsed_time(e) / iters


PROFILED = 10

# How each family's states are stored (``--states``): the alias as made, or wrapped.
STATES = {
    "32": lambda tx: tx,
    "8": lambda tx: ftopt.quantize_states(tx, bits=8),
    "bf16": lambda tx: ftopt.quantize_states(tx, bits=32, state_dtype=torch.bfloat16),
}


def profile_kernels(tx, params, grads) -> list:
    """(kernel, device microseconds a step, launches a step) of ``PROFILED`` donated
    steps, largest first: where a step's time goes that its bytes do not explain."""
    from torch.profiler import ProfilerActivity, profile

    p = {k: v.clone() for k, v in params.items()}
    state = tx.init(p)
    for _ in range(3):
        p, state = ftopt.step(tx, p, grads, state, donate=True, backend="fused")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED):
            p, state = ftopt.step(tx, p, grads, state, donate=True, backend="fused")
        torch.cuda.synchronize()
    rows = [(a.key, a.device_time_total / PROFILED, a.count // PROFILED)
            for a in prof.key_averages() if a.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--only", default=None, help="comma-separated family names")
    ap.add_argument("--profile", action="store_true",
                    help="also each family's kernels: device time a step (torch.profiler)")
    ap.add_argument("--tag", default="", help="suffix of the output files' names")
    ap.add_argument("--states", choices=tuple(STATES), default="32",
                    help="state storage: 32 (fp32, default), 8 (8-bit blockwise) or bf16")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else None
    import gpu_step
    import registry

    device = torch.device("cpu" if args.smoke else "cuda")
    dims = ({"vocab": 257, "d": 32, "ctx": 64, "n_layer": 2} if args.smoke else
            {"vocab": 50257, "d": 768, "ctx": 1024, "n_layer": 12})
    shapes = gpu_step.gpt2_shapes(**dims)
    params = gpu_step.random_tree(shapes, torch.float32, device, 1, 0.02)
    grads = gpu_step.random_tree(shapes, torch.float32, device, 2, 0.01)
    n = gpu_step.numel_of(params)
    copy = None if args.smoke else copy_tbps(device, 1 << 28)
    rows = []
    for e in registry.TRANSFORMS:
        # A transform (not an alias) is timed when named in --only, chained with a
        # learning rate as a user would: scale_by_distance_over_gradients, say.
        named = e.kind == "transform" and only and e.name in only
        if not (e.kind == "alias" or named) or not e.fusible or e.mixes or (
                only and e.name not in only):
            continue
        tx = e.make(**e.example)
        if named:
            tx = ftopt.chain(tx, ftopt.scale(-1e-3))
        tx = STATES[args.states](tx)
        with contextlib.redirect_stdout(io.StringIO()):
            plan = ftopt.explain(tx, params, grads, donate=True, backend="fused")
        # Per group (fp32 small leaves beside 8-bit ones): its elements and bytes per
        # element, summed over the tree.
        groups = re.findall(r"(\d+) elements\n(?:.*\n)*?  bytes per element: main kernel "
                            r"reads ([\d.]+), writes ([\d.]+)(?:; norm passes read ([\d.]+) more)?",
                            plan)
        moved = sum(int(k) * (float(r) + float(w)) for k, r, w, _ in groups)
        reread = sum(int(k) * float(x or 0) for k, _, _, x in groups)
        passes = re.search(r"\((\d+) norm pass", plan)
        note = "torch stage + fused" if "matrix stage" in plan else ""
        if passes and int(passes.group(1)):
            note = (note + "; " if note else "") + f"{passes.group(1)} norm pass(es)"
        running = re.search(r"running scalars: (\d+) torch ops", plan)
        if running:  # (tiny kernels, a few microseconds each on a GPU)
            note = (note + "; " if note else "") + f"{running.group(1)} + 1 ops on 0-d tensors"
        ms, loop_ms = time_family(tx, params, grads, 2 if args.smoke else args.iters, device)
        per_elt = moved / n
        step_elt = (moved + reread) / n
        tbps = n * per_elt / (ms * 1e-3) / 1e12
        step_tbps = n * step_elt / (ms * 1e-3) / 1e12
        kernels = profile_kernels(tx, params, grads) if args.profile and copy else None
        rows.append({"name": e.name, "states": list(e.states), "ms": ms, "B_per_elt": per_elt,
                     "kernels": kernels,
                     "tbps": tbps, "of_copy": tbps / copy if copy else None,
                     "step_B_per_elt": step_elt, "step_tbps": step_tbps,
                     "step_of_copy": step_tbps / copy if copy else None, "note": note,
                     "loop_ms": loop_ms,
                     "loop_of_copy": n * step_elt / (loop_ms * 1e-3) / 1e12 / copy
                     if copy else None})
        frac = "" if copy is None else (f"{tbps / copy:.2f} / {step_tbps / copy:.2f} of copy;"
                                        f" loop {rows[-1]['loop_of_copy']:.2f}")
        print(f"{e.name:28s} {ms:8.3f} ms (loop {loop_ms:6.3f})  {per_elt:6.2f} / {step_elt:6.2f}"
              f" B/elt  {tbps:6.3f} / {step_tbps:6.3f} TB/s  {frac}", flush=True)
        for name, us, calls in kernels or ():
            print(f"    {us:9.1f} us  x{calls:<3d} {name[:90]}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "copy_tbps": copy, "numel": n, "leaves": len(params), "states": args.states,
            "date": time.strftime("%Y-%m-%d")}
    (args.out / f"families{args.tag}.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1))
    kept = {"32": "fp32", "8": "8-bit", "bf16": "bf16"}[args.states]
    md = [f"# Fused families, GPT-2 fp32 ({n / 1e6:.1f}M params, {len(params)} leaves, "
          f"{kept} states)", "",
          f"device {meta['device']}, copy {copy and round(copy, 3)} TB/s, {meta['date']}", "",
          "B/elt: the main kernel's bytes per element (explain); step B/elt: the whole "
          "step's, norm passes included. Both fractions of copy use the whole step's time "
          "(ms: one step timed alone, from an idle GPU; loop ms: a step of a loop, the host "
          "running ahead, as in training; loop of copy: the whole step's bytes at that "
          "time).",
          "", "| family | states | ms | B/elt | TB/s | of copy | step B/elt | step TB/s "
          "| step of copy | loop ms | loop of copy | note |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        oc, soc, loc = ("-" if r[k] is None else f"{r[k]:.2f}"
                        for k in ("of_copy", "step_of_copy", "loop_of_copy"))
        md.append(f"| {r['name']} | {', '.join(r['states']) or '-'} | {r['ms']:.3f} | "
                  f"{r['B_per_elt']:.2f} | {r['tbps']:.3f} | {oc} | {r['step_B_per_elt']:.2f} | "
                  f"{r['step_tbps']:.3f} | {soc} | {r['loop_ms']:.3f} | {loc} | "
                  f"{r['note']} |")
    for r in rows:
        if r.get("kernels"):
            md += ["", f"{r['name']}: device time a step by kernel (torch.profiler, "
                   f"{PROFILED} steps)", ""]
            md += [f"    {us:9.1f} us  x{calls:<3d} {name[:100]}"
                   for name, us, calls in r["kernels"]]
    (args.out / f"families{args.tag}.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
