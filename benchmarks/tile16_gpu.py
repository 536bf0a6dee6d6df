"""Tiles of the 16-bit layouts on one GPU: bf16 params with fp32 and with bf16 states.

For each tile (elements x warps per program, ``tiles.BLOCK``/``tiles.NUM_WARPS``) the
donated Adam step of the GPT-2 tree, without and with skip_zeros (dense gradients and 90%
of the embedding's rows zero), and the fraction of the copy bandwidth at the layout's
bytes per element.

    python3 benchmarks/tile16_gpu.py OUT
"""
import json
import pathlib
import statistics
import sys

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks")]
import gpu_step  # noqa: E402
import torch  # noqa: E402
from timing import event_ms  # noqa: E402

import ftopt  # noqa: E402
from ftopt.lowering import tiles  # noqa: E402

dev = torch.device("cuda")
cfg = gpu_step.gpt2_tree_config(dev)
TILES = [(512, 4), (1024, 4), (1024, 8), (2048, 8), (512, 2), (256, 2), (4096, 8)]
LAYOUTS = {"bf16 params, fp32 states": ({}, 22), "bf16 params, bf16 states":
           ({"state_dtype": torch.bfloat16}, 14)}


t = gpu_step.median_step_ms


def copy_tb_s() -> float:
    src = torch.empty(1 << 29, device=dev)
    dst = torch.empty_like(src)
    ms = statistics.median(event_ms(lambda: dst.copy_(src), 20, 3))
    return 2 * src.numel() * 4 / ms / 1e9


copy_bw = copy_tb_s()
print(f"copy {copy_bw:.3f} TB/s")
res = []
params, grads = gpu_step._tree(cfg, torch.bfloat16, seed=21)
sparse, _ = gpu_step._sparse_wte(grads, cfg)
numel = sum(p.numel() for p in params.values())
for name, (kw, nbytes) in LAYOUTS.items():
    for block, warps in TILES:
        tiles.BLOCK, tiles.NUM_WARPS = block, warps
        gpu_step._clear_lowering_caches()
        row = dict(layout=name, tile=f"{block}x{warps}",
                   off=t(ftopt.adam(1e-3, **kw), params, grads),
                   skip_dense=t(ftopt.adam(1e-3, skip_zeros=True, **kw), params, grads),
                   off_sparse=t(ftopt.adam(1e-3, **kw), params, sparse),
                   skip_sparse=t(ftopt.adam(1e-3, skip_zeros=True, **kw), params, sparse))
        row["of_copy"] = nbytes * numel / row["off"] / 1e9 / copy_bw
        res.append(row)
        cost = (row["skip_dense"] / row["off"] - 1) * 100
        print(f"{name:26s} {row['tile']:8s} off {row['off']:.3f} ({row['of_copy']:.2f} of "
              f"copy) skip {row['skip_dense']:.3f} ({cost:+.1f}%) sparse off "
              f"{row['off_sparse']:.3f} skip {row['skip_sparse']:.3f} "
              f"({row['off_sparse'] / row['skip_sparse']:.2f}x)", flush=True)
out = pathlib.Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
(out / "tile16.json").write_text(json.dumps({"copy_tb_s": copy_bw, "runs": res}, indent=1))
