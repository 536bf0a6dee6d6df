"""The device's time of each step of a long primed run, by what the skip_zeros watch did
at that step (``ftopt.lowering.skip_watch``): its ordinary steps, and those that count
(a probe's too), with each watched group's mode (starred where it counted). The mean
over every step, counted ones included at their rate, is a training loop's steady
state; ``skip_watch_ab_gpu.py``'s medians of 40-step windows mostly leave them out.

GPT-2 Adam on each layout of ``gpu_step.LAYOUTS`` (``--layouts=8-bit,16-bit states``), no
skip_zeros against skip_zeros with the watch, dense gradients and 90% of the
embedding's rows zero, ``--steps=N`` (320) steps each after 70 untimed ones, a CUDA event
after each. Prints a table, writes ``OUT/watch_steps.json``.

    python3 benchmarks/watch_steps_gpu.py OUT [--layouts=8-bit] [--steps=320]
"""
import collections
import json
import pathlib
import statistics
import sys

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parent)]
import gpu_step  # noqa: E402
import timing  # noqa: E402
import torch  # noqa: E402

import ftopt  # noqa: E402
from ftopt.lowering import launch, native, skip_watch  # noqa: E402

ONLY = [x for a in sys.argv[2:] if a.startswith("--layouts=")
        for x in a.split("=", 1)[1].split(",")] or ["8-bit", "16-bit states"]
STEPS = int(next((a.split("=", 1)[1] for a in sys.argv[2:] if a.startswith("--steps=")),
                 "320"))

# What each watched group did at the step being run: (its mode, whether it counted).
DID: list = []
_plan = skip_watch.SkipWatch.plan


def _recorded_plan(self) -> int:
    now = _plan(self)
    DID.append((now, self.sampling))
    return now


skip_watch.SkipWatch.plan = _recorded_plan


def step_times(step) -> tuple[list, list]:
    """Each step's device us and what the watch did at it, over :data:`STEPS` steps with
    one queued before the first event."""
    for _ in range(70):
        step()
    torch.cuda.synchronize()
    step()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(STEPS + 1)]
    did = []
    events[0].record()
    for i in range(STEPS):
        DID.clear()
        step()
        events[i + 1].record()
        did.append(tuple(DID))
    torch.cuda.synchronize()
    return [events[i].elapsed_time(events[i + 1]) * 1e3 for i in range(STEPS)], did


def main() -> None:
    native.module(wait=True)
    cfg = gpu_step.gpt2_tree_config(torch.device("cuda"))
    rows = []
    for name, kw, _, params, grads in gpu_step.layout_trees(cfg, ONLY):
        sparse, _ = gpu_step._sparse_wte(grads, cfg)
        means = {}
        for variant, skip in (("off", False), ("watch", True)):
            gpu_step._clear_lowering_caches()
            launch._COMPILED.clear()
            tx = ftopt.adam(1e-3, skip_zeros=skip, **kw)
            for kind, g in (("dense", grads), ("sparse", sparse)):
                us, did = step_times(timing.donated_stepper(tx, params, g))
                means[(variant, kind)] = mean = sum(us) / len(us)
                by = collections.defaultdict(list)
                for t, x in zip(did, us):  # (which groups counted: their modes starred)
                    by[("counted" if any(s for _, s in t) else "ordinary",
                        tuple(f"{m}*" if s else m for m, s in t))].append(x)
                line = f"{name:42s} {variant:5s} {kind:6s} mean {mean:6.1f} us"
                if variant == "watch":
                    line += f" ({means[('off', kind)] / mean:.3f}x off's)"
                print(line, flush=True)
                kinds = []
                for (what, modes), xs in sorted(by.items(), key=lambda kv: -len(kv[1])):
                    print(f"    {len(xs):4d} {what:8s} steps, modes {modes}: median "
                          f"{statistics.median(xs):6.1f} us", flush=True)
                    kinds.append(dict(what=what, modes=list(modes), steps=len(xs),
                                      median_us=statistics.median(xs)))
                rows.append(dict(layout=name, variant=variant, grads=kind, mean_us=mean,
                                 us=us, by_step=kinds))
        del params, grads, sparse
        torch.cuda.empty_cache()
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    (out / "watch_steps.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
