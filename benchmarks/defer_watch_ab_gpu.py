"""What the "split+defer" watch costs (``ftopt.lowering.defer_watch``), A/B in one process.

GPT-2 8-bit Adam, donated steps (``gpu_step.median_step_ms``), dense gradients and 90% of
the embedding's rows zero, in four rounds: no skip_zeros, skip_zeros with the watch off
(``tiles.DEFER_SELECT_ABOVE = 2``: it never switches) and with it (the default). Prints
each round and the medians.

    python3 benchmarks/defer_watch_ab_gpu.py
"""
import pathlib
import statistics
import sys

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks")]
import gpu_step  # noqa: E402
import torch  # noqa: E402

import ftopt  # noqa: E402
from ftopt.lowering import launch, tiles  # noqa: E402

VARIANTS = (("off", tiles.DEFER_SELECT_ABOVE, False),
            ("split+defer, no watch", 2.0, True),
            ("split+defer + watch", tiles.DEFER_SELECT_ABOVE, True))


def main() -> None:
    dev = torch.device("cuda")
    cfg = gpu_step.gpt2_tree_config(dev)
    params, grads = gpu_step._tree(cfg, torch.float32, seed=21)
    sparse, _ = gpu_step._sparse_wte(grads, cfg)
    times: dict = {}
    for rnd in range(4):
        for name, above, skip in VARIANTS:
            tiles.DEFER_SELECT_ABOVE = above
            gpu_step._clear_lowering_caches()
            launch._COMPILED.clear()
            tx = ftopt.adam(1e-3, state_bits=8, skip_zeros=skip)
            for kind, g in (("dense", grads), ("sparse", sparse)):
                ms = gpu_step.median_step_ms(tx, params, g)
                times.setdefault((name, kind), []).append(ms)
                print(f"{rnd} {name:22s} {kind:6s} {ms:.4f} ms", flush=True)
    for (name, kind), v in times.items():
        print(f"{name:22s} {kind:6s} median {statistics.median(v):.4f} ms "
              f"({', '.join(f'{x:.4f}' for x in v)})")


if __name__ == "__main__":
    main()
