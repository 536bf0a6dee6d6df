"""8-bit Adam on one GPU: registers per thread (``maxnreg``), tile and skip_zeros mode.

The 8-bit kernels are bound by latency at the occupancy their registers allow (96 a
thread without skip_zeros, 120-128 with it, one warp a program). For each register cap
(``tiles.QUANT_MAXNREG``), 8-bit tile (``tiles.QUANT_TILE``) and skip_zeros mode
(off, "select", "stores"), the donated step time of the GPT-2 tree with dense gradients
and with 90% of the embedding's rows zero, then each compiled kernel's registers and
spills. Also with every block part zero ("mixed": one gradient in 97 zero), where a
"split" mode runs its select body everywhere.

    python3 benchmarks/quant_regs_gpu.py OUT [CAPS [TILES [MODES]]]
    # e.g. none,64,72 256x1,256x2 off,split+select (the defaults below)
"""
import itertools
import json
import pathlib
import sys

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks")]
import gpu_step  # noqa: E402
import torch  # noqa: E402

import ftopt  # noqa: E402
from ftopt.lowering import kernel_files, tiles  # noqa: E402

dev = torch.device("cuda")
cfg = gpu_step.gpt2_tree_config(dev)
ARGS = sys.argv[2:] + [""] * 3
CAPS = [None if c == "none" else int(c) for c in (ARGS[0] or "none,64,72,80,96").split(",")]
TILES = [tuple(int(x) for x in t.split("x")) for t in (ARGS[1] or "256x1,256x2").split(",")]
MODES = (ARGS[2] or "off,select,stores").split(",")


t = gpu_step.median_step_ms


params, grads = gpu_step._tree(cfg, torch.float32, seed=21)
sparse, frac = gpu_step._sparse_wte(grads, cfg)
# Every 8-bit block part zero (one gradient in 97 zero): the worst case of a "split" mode.
mixed = {k: v.clone().view(-1).index_fill_(0, torch.arange(0, v.numel(), 97, device=dev),
                                           0.0).view_as(v) for k, v in grads.items()}
res = []
for cap, tile, mode in itertools.product(CAPS, TILES, MODES):
    tiles.QUANT_MAXNREG = tiles.QUANT_SKIP_MAXNREG = tiles.QUANT_DEFER_MAXNREG = cap
    tiles.QUANT_TILE = tile
    tiles.SKIP_MODES["8-bit"] = "select" if mode == "off" else mode
    gpu_step._clear_lowering_caches()
    tx = ftopt.adam(1e-3, state_bits=8, skip_zeros=mode != "off")
    row = dict(maxnreg=cap, tile=f"{tile[0]}x{tile[1]}", mode=mode,
               dense=t(tx, params, grads), sparse=t(tx, params, sparse),
               mixed=t(tx, params, mixed))
    res.append(row)
    print(f"maxnreg {str(cap):5s} tile {row['tile']:6s} {mode:12s} dense {row['dense']:.3f} "
          f"sparse {row['sparse']:.3f} mixed {row['mixed']:.3f}", flush=True)
regs = []
for key, mod in kernel_files._MODULES.items():
    fn = getattr(mod, "ftopt_main", None)
    for cache in (fn.device_caches.values() if fn is not None else ()):
        for k in cache[0].values():
            regs.append(dict(kernel=key[:8], regs=k.n_regs, spills=k.n_spills,
                             warps=k.metadata.num_warps,
                             maxnreg=getattr(k.metadata, "maxnreg", None)))
            print(regs[-1])
out = pathlib.Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
(out / "quant_regs.json").write_text(json.dumps({"runs": res, "kernels": regs}, indent=1))
