"""8-bit skip_zeros modes on one GPU, each kernel timed by the profiler.

Donated 8-bit Adam steps on the GPT-2 tree, for each 8-bit skip_zeros mode
(``tiles.SKIP_MODES["8-bit"]``; "off": no skip_zeros) and five kinds of gradients:
dense, 90% of the embedding's rows zero ("sparse"; "moving": other rows each step, 8
draws in turn), every 8-bit block part zero (one gradient in 97: "mixed", where a
"split" mode runs its select body everywhere), and every gradient zero.
Prints the median step time (``gpu_step.median_step_ms``) and the mean device time of
each kernel the step launches (torch.profiler: the 8-bit group's main kernel, the
small fp32 group's, and "split+defer"'s deferred kernel, each named by its place in
the step's launches), and writes them to
``OUT/skip8_profile.json``.

    python3 benchmarks/skip8_profile_gpu.py OUT [MODES [FLAGS [SKIP_CAPS]]]
    # e.g. off,split+select,split+defer 8,32,64 72,96 (the defaults: the first of each)
"""
import json
import pathlib
import sys

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks")]
import gpu_step  # noqa: E402
import timing  # noqa: E402
import torch  # noqa: E402

import ftopt  # noqa: E402
from ftopt.lowering import launch, tiles  # noqa: E402

dev = torch.device("cuda")
ARGS = sys.argv[2:] + [""] * 3
MODES = (ARGS[0] or "off,split+select,split+defer").split(",")
FLAGS = [int(x) for x in (ARGS[1] or str(tiles.DEFER_FLAGS)).split(",")]
CAPS = [int(x) for x in (ARGS[2] or str(tiles.QUANT_SKIP_MAXNREG)).split(",")]


def main() -> None:
    cfg = gpu_step.gpt2_tree_config(dev)
    params, grads = gpu_step._tree(cfg, torch.float32, seed=21)
    sparse, _ = gpu_step._sparse_wte(grads, cfg)
    moving, mixed = gpu_step._moving_wte(grads, cfg), gpu_step._scattered_zeros(grads)
    zero = {k: torch.zeros_like(v) for k, v in grads.items()}
    rows = []
    for mode in MODES:
        for flags in (FLAGS if mode == "split+defer" else FLAGS[:1]):
            for cap in (CAPS if mode != "off" else CAPS[:1]):
                tiles.SKIP_MODES["8-bit"] = "select" if mode == "off" else mode
                tiles.DEFER_FLAGS, tiles.QUANT_SKIP_MAXNREG = flags, cap
                gpu_step._clear_lowering_caches()
                launch._COMPILED.clear()
                tx = ftopt.adam(1e-3, state_bits=8, skip_zeros=mode != "off")
                for name, g in (("dense", grads), ("sparse", sparse), ("moving", moving),
                                ("mixed", mixed), ("zero", zero)):
                    row = dict(mode=mode, flags=flags, skip_cap=cap, grads=name,
                               step_ms=gpu_step.median_step_ms(tx, params, g),
                               kernels=timing.kernel_us(tx, params, g))
                    rows.append(row)
                    print(f"{mode:13s} flags {flags:4d} cap {cap:3d} {name:6s} step "
                          f"{row['step_ms']:.3f} ms | " + "; ".join(
                              f"{k} x{v['per_step']:.0f} {v['mean_us']:.1f} us"
                              for k, v in row["kernels"].items()), flush=True)
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    (out / "skip8_profile.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
