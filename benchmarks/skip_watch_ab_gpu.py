"""What the skip_zeros watch costs and gains (``ftopt.lowering.skip_watch``), A/B in
one process, per layout.

GPT-2 Adam on each layout of ``gpu_step.LAYOUTS`` (``--layouts=fp32,8-bit``: only those
keys of ``tiles.SKIP_MODES``), donated steps (``gpu_step.median_step_ms``) with dense
gradients, 90% of the embedding's rows zero ("sparse"), one gradient in 97 zero
("mixed": every block part zero) and both ("sparse+mixed": the embedding's rows, one in 97
of the other leaves' gradients), in two rounds (``--rounds=N``; the two skip_zeros
variants' order swapped every other round; ``--kinds=dense,sparse``: only those
gradients): no skip_zeros, skip_zeros without the
watch (``tiles.WATCH = False``: each group keeps its mode and counts nothing) and with it
(the default). Prints each round and the medians, writes ``OUT/watch_ab.json``. The native
tensor check (``ftopt.lowering.native``) is loaded first. Each case also reports the
watch's modes over its steps and the host's time a call (near the step's time, the
device waits for launches).

``--opt=ademamix``: that ``ftopt`` alias instead of ``adam`` (its defaults, lr 1e-3).
``--per-step``: each case also times every step of its window apart
(``timing.each_call_ms``; the median of 3 windows per position, in the JSON as
``per_step_ms``) and prints the first step, the second and the median of the rest: where
an unprimed window's excess over the primed one lies.

    python3 benchmarks/skip_watch_ab_gpu.py OUT [--layouts=...] [--rounds=2] [--kinds=...]
        [--steps=40] [--opt=adam] [--per-step]
"""
import collections
import json
import pathlib
import statistics
import sys
import time

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks")]
import gpu_step  # noqa: E402
import timing  # noqa: E402
import torch  # noqa: E402

import ftopt  # noqa: E402
from ftopt.lowering import launch, native, skip_watch, tiles  # noqa: E402

VARIANTS = (("off", True, False), ("no watch", False, True), ("watch", True, True))
ONLY = [x for a in sys.argv[1:] if a.startswith("--layouts=")
        for x in a.split("=", 1)[1].split(",")]
ROUNDS = int(next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--rounds=")),
                  "2"))
KINDS = [x for a in sys.argv[1:] if a.startswith("--kinds=")
         for x in a.split("=", 1)[1].split(",")]
# Steps between a timing's two events (``--steps=N``): unprimed, the first call's host
# work before its first launch counts once in N steps.
STEPS = int(next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--steps=")),
                 "40"))
OPT = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--opt=")), "adam")
PER_STEP = "--per-step" in sys.argv[1:]


# The watch's mode at each step of a case (0 the group's own, 1 its alternate, 2 its
# spanned alternate, 3 its carve: ftopt.lowering.skip_watch), counted over every
# watched group: which mode a round's time is of.
MODES: collections.Counter = collections.Counter()
_plan = skip_watch.SkipWatch.plan


def _counted_plan(self) -> int:
    now = _plan(self)
    MODES[now] += 1
    return now


skip_watch.SkipWatch.plan = _counted_plan


def _step_and_host_ms(tx, params: dict, grads: dict) -> tuple[float, float, float, list]:
    """``gpu_step.median_step_ms``'s steps (3 untimed, 3 x :data:`STEPS` timed by
    events); the host's ms a call over 40 more, not waited for (where it is near the
    step's time, the device waits for launches); and the step's ms with one call queued
    before the first event (3 x :data:`STEPS`, the median), which leaves out the first
    call's host work before its first launch (events started on an idle device count it,
    once in :data:`STEPS` steps); with ``--per-step``, each step of a window apart."""
    step = timing.donated_stepper(tx, params, grads)
    for _ in range(3):
        step()
    ms = statistics.median(timing.event_ms(step, STEPS, 3))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(40):
        step()
    host = (time.perf_counter() - start) / 40 * 1e3
    torch.cuda.synchronize()
    primed = statistics.median(timing.event_ms(step, STEPS, 3, primed=True))
    return ms, host, primed, timing.each_call_ms(step, STEPS, 3) if PER_STEP else []


def main() -> None:
    dev = torch.device("cuda")
    # (steps on checked memory: the native tensor check built and loaded first, as in a
    # process past its first seconds; until then the host's checks run in Python, and a
    # step that the device runs in ~0.5 ms can wait for its launches)
    native.module(wait=True)
    print(f"native tensor check: {native.status()}", flush=True)
    cfg = gpu_step.gpt2_tree_config(dev)
    rows = []
    for name, kw, _, params, grads in gpu_step.layout_trees(cfg, ONLY):
        sparse, _ = gpu_step._sparse_wte(grads, cfg)
        mixed = gpu_step._scattered_zeros(grads)
        wte = "transformer.wte.weight"
        both = {**mixed, wte: sparse[wte]}
        times: dict = {}
        seen: dict = {}  # (variant, kind) -> each round's modes, host ms, primed ms
        for rnd in range(ROUNDS):
            # (the two skip_zeros variants in turn first, against any drift in a round)
            order = VARIANTS if rnd % 2 == 0 else VARIANTS[:1] + VARIANTS[:0:-1]
            for variant, watch, skip in order:
                tiles.WATCH = watch
                gpu_step._clear_lowering_caches()
                launch._COMPILED.clear()
                tx = getattr(ftopt, OPT)(1e-3, skip_zeros=skip, **kw)
                for kind, g in [x for x in (("dense", grads), ("sparse", sparse),
                                            ("mixed", mixed), ("sparse+mixed", both))
                                if not KINDS or x[0] in KINDS]:
                    MODES.clear()
                    ms, host, primed, each = _step_and_host_ms(tx, params, g)
                    times.setdefault((variant, kind), []).append(ms)
                    seen.setdefault((variant, kind), []).append((dict(MODES), host, primed,
                                                                 each))
                    print(f"{rnd} {name:30s} {variant:9s} {kind:12s} {ms:.4f} ms (queue "
                          f"primed {primed:.4f}; host {host:.4f} ms a call; modes "
                          f"{dict(sorted(MODES.items()))})", flush=True)
                    if each:
                        print(f"  each step: first {each[0]:.4f}, second {each[1]:.4f}, "
                              f"the rest's median {statistics.median(each[2:]):.4f} ms",
                              flush=True)
        for (variant, kind), v in times.items():
            off = statistics.median(times[("off", kind)])
            med = statistics.median(v)
            rows.append(dict(opt=OPT, layout=name, variant=variant, grads=kind, ms=v, median=med,
                             vs_off=med / off, native_check=native.status(),
                             modes=[x[0] for x in seen[(variant, kind)]],
                             host_ms=[x[1] for x in seen[(variant, kind)]],
                             primed_ms=[x[2] for x in seen[(variant, kind)]],
                             per_step_ms=[x[3] for x in seen[(variant, kind)]]))
            primed = statistics.median([x[2] for x in seen[(variant, kind)]])
            primed_off = statistics.median([x[2] for x in seen[("off", kind)]])
            print(f"{name:30s} {variant:9s} {kind:12s} median {med:.4f} ms "
                  f"({(med / off - 1) * 100:+.1f}% of off; queue primed "
                  f"{(primed / primed_off - 1) * 100:+.1f}%)", flush=True)
        del params, grads, sparse, mixed, both
        torch.cuda.empty_cache()
    tiles.WATCH = True
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    (out / "watch_ab.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
