"""What a new process pays before its steps run at speed: the first fused steps of Adam
on the GPT-2 tree with an empty Triton cache (every kernel compiled) and again with the
cache the first run filled (kernels loaded), per layout, each in a process of its own.

Each run times every one of its first ``--steps`` (80) donated steps whole (synchronised)
and prints the first step, the sum of the steps past the first that took over 50 ms
(kernels compiled later: skip_zeros' counting variants, the watch's probe), and the
median step.

With ``--profile`` the filled-cache run of each layout also profiles its first step
(cProfile, host side) into ``OUT/profile_<layout>.txt``: the 40 costliest calls by
cumulative time, then by own time.

    python3 benchmarks/first_steps_gpu.py OUT [--steps=80] [--device=cuda] [--profile]
    [--layouts="fp32;8-bit states"]
"""

from __future__ import annotations

import cProfile
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
import timing  # noqa: E402
from gpu_step import gpt2_shapes, random_tree  # noqa: E402

import ftopt  # noqa: E402

LAYOUTS = {
    "fp32": {},
    "fp32, skip_zeros": {"skip_zeros": True},
    "bf16 params + states": {"state_dtype": "bfloat16", "param_dtype": "bfloat16"},
    "bf16 params + states, skip_zeros": {"state_dtype": "bfloat16",
                                         "param_dtype": "bfloat16", "skip_zeros": True},
    "8-bit states": {"state_bits": 8},
    "8-bit states, skip_zeros": {"state_bits": 8, "skip_zeros": True},
}
SLOW_MS = 50.0


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _profiled(fn, path: str):
    """``fn()`` under cProfile, its 40 costliest calls written to ``path``."""
    prof = cProfile.Profile()
    out = prof.runcall(fn)
    pathlib.Path(path).write_text(timing.profile_text(prof))
    return out


def child(layout: str, steps: int, device: str, profile: str = "") -> dict:
    kw = dict(LAYOUTS[layout])
    dtype = getattr(torch, kw.pop("param_dtype", "float32"))
    if "state_dtype" in kw:
        kw["state_dtype"] = getattr(torch, kw["state_dtype"])
    shapes = gpt2_shapes(50257, 768, 1024, 12)
    params = random_tree(shapes, dtype, device, seed=1, scale=0.02)
    grads = random_tree(shapes, dtype, device, seed=2, scale=1e-3)
    tx = ftopt.adam(1e-4, **kw)
    state = tx.init(params)
    _sync(device)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        if i == 0 and profile:
            def first(p=params, s=state):
                out = ftopt.step(tx, p, grads, s, donate=True)
                _sync(device)
                return out
            params, state = _profiled(first, profile)
        else:
            params, state = ftopt.step(tx, params, grads, state, donate=True)
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return {"first_ms": times[0], "later_slow_ms": sum(t for t in times[1:] if t > SLOW_MS),
            "later_slow_steps": [i for i, t in enumerate(times) if i and t > SLOW_MS],
            "median_ms": statistics.median(times[1:])}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]), sys.argv[4], *sys.argv[5:6])))
        return
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    opts = dict(a[2:].split("=", 1) for a in sys.argv[2:] if a.startswith("--") and "=" in a)
    steps, device = int(opts.get("steps", 80)), opts.get("device", "cuda")
    profile = "--profile" in sys.argv[2:]
    layouts = opts["layouts"].split(";") if "layouts" in opts else list(LAYOUTS)
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        sys.exit(f"unknown layouts {unknown}; they are {list(LAYOUTS)}, given as --layouts='a;b'")
    rows = {}
    print("| layout | cache | first step ms | later compiles ms (steps) | median step ms |")
    print("| --- | --- | ---: | ---: | ---: |")
    for layout in layouts:
        cache = tempfile.mkdtemp(prefix="triton-cold-")
        for kind in ("empty", "filled"):
            env = {**os.environ, "TRITON_CACHE_DIR": cache}
            prof = []
            if profile and kind == "filled":
                prof = [str(out / f"profile_{re.sub('[^A-Za-z0-9]+', '_', layout)}.txt")]
            run = subprocess.run([sys.executable, __file__, "--child", layout, str(steps),
                                  device, *prof],
                                 env=env, capture_output=True, text=True)
            if run.returncode:
                print(f"| {layout} | {kind} | failed: {run.stderr.strip()[-300:]} | | |")
                continue
            r = json.loads(run.stdout.strip().splitlines()[-1])
            rows[f"{layout} / {kind}"] = r
            print(f"| {layout} | {kind} | {r['first_ms']:.0f} | {r['later_slow_ms']:.0f} "
                  f"({r['later_slow_steps']}) | {r['median_ms']:.3f} |", flush=True)
    (out / "first_steps.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
