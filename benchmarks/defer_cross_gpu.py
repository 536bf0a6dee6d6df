"""8-bit skip_zeros with a zero in a fraction of the blocks, per mode, on one GPU.

Donated 8-bit Adam steps on the GPT-2 tree (``gpu_step.median_step_ms``) with a zero
gradient in one 256-element block of every ``1 / f`` (f = 0 to 1: every block then part
zero), for no skip_zeros ("off"), "split+defer" (the default, with its
``ftopt.lowering.skip_watch``: it runs "split+select" while more than
``tiles.DEFER_SELECT_ABOVE`` of the blocks are deferred; ``FTOPT_DEFER_SELECT_ABOVE=2``
times split+defer alone) and "split+select": where the two modes cross, and what the
watch costs. Two rounds; writes ``OUT/defer_cross.json``.

    python3 benchmarks/defer_cross_gpu.py OUT
"""
import json
import pathlib
import sys

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks")]
import gpu_step  # noqa: E402
import torch  # noqa: E402

import ftopt  # noqa: E402
from ftopt.lowering import launch, tiles  # noqa: E402

FRACTIONS = (0, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 1.0)
MODES = ("off", "split+defer", "split+select")


def part_zero(grads: dict, fraction: float) -> dict:
    """``grads`` with one zero (lane 37) in one 256-element block of every
    ``round(1 / fraction)``."""
    if fraction == 0:
        return grads
    every = max(1, round(1 / fraction))
    out = {}
    for k, v in grads.items():
        flat = v.clone().view(-1)
        at = torch.arange(0, flat.numel(), 256 * every, device=v.device) + 37
        flat[at[at < flat.numel()]] = 0.0
        out[k] = flat.view_as(v)
    return out


def main() -> None:
    dev = torch.device("cuda")
    cfg = gpu_step.gpt2_tree_config(dev)
    params, grads = gpu_step._tree(cfg, torch.float32, seed=21)
    by_fraction = {f: part_zero(grads, f) for f in FRACTIONS}
    rows = []
    for rnd in range(2):
        for mode in MODES:
            tiles.SKIP_MODES["8-bit"] = "select" if mode == "off" else mode
            gpu_step._clear_lowering_caches()
            launch._COMPILED.clear()
            tx = ftopt.adam(1e-3, state_bits=8, skip_zeros=mode != "off")
            for f in FRACTIONS:
                ms = gpu_step.median_step_ms(tx, params, by_fraction[f])
                rows.append(dict(round=rnd, mode=mode, fraction=f, step_ms=ms,
                                 select_above=tiles.DEFER_SELECT_ABOVE))
                print(f"{rnd} {mode:13s} fraction {f:5.2f} step {ms:.3f} ms", flush=True)
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    (out / "defer_cross.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
