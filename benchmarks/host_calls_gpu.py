"""Host time of a donated step, per call, for GPT-2 8-bit Adam: 90% of the embedding's
rows zero with skip_zeros (the carve: five launches on two streams), dense with
skip_zeros (three launches) and without (two). The device is synchronized before each
call and only the call is timed (median of 300), the native tensor check loaded first.
Run it in two checkouts in turn to compare them (``LABEL`` names the line).
``--profile=DIR``: each case's 300 calls also run under cProfile, the 40 costliest
functions by cumulative time and by own time in ``DIR/host_<case>.txt``.

    python3 benchmarks/host_calls_gpu.py LABEL [--profile=DIR]
"""
import cProfile
import pathlib
import statistics
import sys
import time

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parent)]
import gpu_step  # noqa: E402
import timing  # noqa: E402
import torch  # noqa: E402

import ftopt  # noqa: E402
from ftopt.lowering import native  # noqa: E402

PROFILE = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--profile=")), "")


def _profile(step, path: pathlib.Path) -> None:
    """300 calls of ``step`` under cProfile (the device synchronized before each, not
    profiled), the costliest functions written to ``path``."""
    prof = cProfile.Profile()
    for _ in range(300):
        torch.cuda.synchronize()
        prof.enable()
        step()
        prof.disable()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(timing.profile_text(prof))


def main() -> None:
    native.module(wait=True)
    cfg = gpu_step.gpt2_tree_config(torch.device("cuda"))
    params, grads = gpu_step._tree(cfg, torch.float32, seed=21)
    sparse, _ = gpu_step._sparse_wte(grads, cfg)
    out = []
    for name, g, skip in (("8-bit sparse watch", sparse, True),
                          ("8-bit dense watch", grads, True), ("8-bit off", grads, False)):
        step = timing.donated_stepper(ftopt.adam(1e-3, skip_zeros=skip, state_bits=8),
                                      params, g)
        for _ in range(40):  # (the watch's mode taken)
            step()
        times = []
        for _ in range(300):
            torch.cuda.synchronize()
            t = time.perf_counter_ns()
            step()
            times.append(time.perf_counter_ns() - t)
        out.append(f"{name} {statistics.median(times) / 1e3:.0f}")
        if PROFILE:
            _profile(step, pathlib.Path(PROFILE) / f"host_{name.replace(' ', '_')}.txt")
    label = next((a for a in sys.argv[1:] if not a.startswith("--")), "")
    print(label, "; ".join(out), flush=True)


if __name__ == "__main__":
    main()
