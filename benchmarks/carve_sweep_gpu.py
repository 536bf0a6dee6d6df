"""The carve's spanned group (``ftopt.lowering.groups.carved``) at each span, warps and
programs, in one process: GPT-2 8-bit Adam with skip_zeros, 90% of the embedding's rows
zero.

For each ``--spans`` x ``--warps`` x ``--programs`` (``tiles.CARVE_SPANS``,
``tiles.CARVE_WARPS`` and ``tiles.CARVE_PROGRAMS`` of the layout, set in the process;
warps 0: the layout's tile; programs 0: a program a span), in ``--rounds`` rounds
(the order reversed every other round), with no skip_zeros first in each round: the
step's ms by CUDA events (3 x 40 donated steps, the median; and with one call queued
before the first event, "primed") and each kernel's device time by the profiler (the
spanned kernel is the one launched on the second stream). Prints each run and the
medians, writes ``OUT/carve_sweep.json``.

    python3 benchmarks/carve_sweep_gpu.py OUT [--spans=2,4,8] [--warps=0,2,4,8]
        [--programs=0,1,2,4] [--rounds=2] [--layout=8-bit]
"""
import json
import pathlib
import statistics
import sys

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parent)]
import gpu_step  # noqa: E402
import timing  # noqa: E402
import torch  # noqa: E402

import ftopt  # noqa: E402
from ftopt.lowering import launch, native, tiles  # noqa: E402


def _arg(name: str, default: str) -> str:
    return next((a.split("=", 1)[1] for a in sys.argv[2:] if a.startswith(f"--{name}=")),
                default)


def _run(kw: dict, skip: bool, params: dict, grads: dict) -> dict:
    gpu_step._clear_lowering_caches()
    launch._COMPILED.clear()
    tx = ftopt.adam(1e-3, skip_zeros=skip, **kw)
    step = timing.donated_stepper(tx, params, grads)
    for _ in range(20):  # (the watch's first count read and its carve taken)
        step()
    ms = statistics.median(timing.event_ms(step, 40, 3))
    primed = statistics.median(timing.event_ms(step, 40, 3, primed=True))
    kernels = timing.kernel_us(tx, params, grads)
    return dict(ms=ms, primed=primed,
                kernels={k: round(v["mean_us"], 2) for k, v in kernels.items()},
                kernel_sum=sum(v["per_step"] * v["mean_us"] for v in kernels.values()))


def main() -> None:
    native.module(wait=True)
    cfg = gpu_step.gpt2_tree_config(torch.device("cuda"))
    layout = _arg("layout", "8-bit")
    spans = [int(x) for x in _arg("spans", "2,4,8").split(",")]
    warps = [int(x) for x in _arg("warps", "0").split(",")]
    programs = [int(x) for x in _arg("programs", "0").split(",")]
    rounds = int(_arg("rounds", "2"))
    combos = [(s, w, p) for s in spans for w in warps for p in programs]
    shipped = (dict(tiles.CARVE_SPANS), dict(tiles.CARVE_WARPS), dict(tiles.CARVE_PROGRAMS))
    rows: dict = {}
    for _, kw, key, params, grads in gpu_step.layout_trees(cfg, [layout]):
        sparse, _ = gpu_step._sparse_wte(grads, cfg)
        for rnd in range(rounds):
            off = _run(kw, False, params, sparse)
            rows.setdefault("off", []).append(off)
            print(f"{rnd} off {off['ms']:.4f} ms (primed {off['primed']:.4f})", flush=True)
            for span, warp, program in combos if rnd % 2 == 0 else combos[::-1]:
                tiles.CARVE_SPANS[key] = span
                for table, value in ((tiles.CARVE_WARPS, warp),
                                     (tiles.CARVE_PROGRAMS, program)):
                    table.pop(key, None)
                    if value:
                        table[key] = value
                got = _run(kw, True, params, sparse)
                got["vs_off"] = off["ms"] / got["ms"]
                label = f"span {span} warps {warp} programs {program}"
                rows.setdefault(label, []).append(got)
                print(f"{rnd} {label}: {got['ms']:.4f} ms "
                      f"({got['vs_off']:.3f}x; primed {got['primed']:.4f}); kernels "
                      f"{got['kernels']}", flush=True)
        del params, grads, sparse
    tiles.CARVE_SPANS.clear()
    tiles.CARVE_SPANS.update(shipped[0])
    for table, values in zip((tiles.CARVE_WARPS, tiles.CARVE_PROGRAMS), shipped[1:]):
        table.clear()
        table.update(values)
    off_ms = statistics.median(r["ms"] for r in rows["off"])
    print(f"medians (off {off_ms:.4f} ms):")
    for label, runs in rows.items():
        ms = statistics.median(r["ms"] for r in runs)
        primed = statistics.median(r["primed"] for r in runs)
        kernels = statistics.median(r["kernel_sum"] for r in runs)
        print(f"  {label:30s} {ms:.4f} ms ({off_ms / ms:.3f}x of off), primed "
              f"{primed:.4f}, kernels a step {kernels:.1f} us")
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    (out / "carve_sweep.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
