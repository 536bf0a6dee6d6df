"""Tiles of the 16-bit layouts on one GPU: 16-bit params or states.

For each tile (elements x warps per program, ``tiles.BLOCK``/``tiles.NUM_WARPS``, for
every kernel: the tiles of 16-bit params' kernels, ``ftopt.lowering.half_tiles``, are
set aside) the donated step of the GPT-2 tree, without and with skip_zeros (dense
gradients and 90% of the embedding's rows zero), and the fraction of the copy bandwidth
at the layout's bytes per element; then the same with the defaults (``default``).

    python3 benchmarks/tile16_gpu.py OUT [--tiles=512x4,512x2] [--opts=adam,lion]
        [--layouts=bf16 states,fp16 states] [--off-only]

``--layouts``: of ``bf16 params`` (fp32 states), ``bf16 states`` (bf16 params),
``fp16 states`` (bf16 params), ``fp32 params bf16 states``; ``--opts``: ftopt aliases
(learning rate 1e-3, their defaults); ``--off-only``: no skip_zeros rows.
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
from ftopt.lowering import half_tiles, tiles  # noqa: E402

TILES = ["512x4", "1024x4", "1024x8", "2048x8", "512x2", "256x2", "4096x8"]
# name -> (param dtype, alias options, state bytes per element per state slot)
LAYOUTS = {"bf16 params": (torch.bfloat16, {}, 4),
           "bf16 states": (torch.bfloat16, {"state_dtype": torch.bfloat16}, 2),
           "fp16 states": (torch.bfloat16, {"state_dtype": torch.float16}, 2),
           "fp32 params bf16 states": (torch.float32, {"state_dtype": torch.bfloat16}, 2)}
SLOTS = {"adam": 2, "adamw": 2, "lion": 1, "ademamix": 3, "rmsprop": 1, "adagrad": 1,
         "sgd": 1}


def options(argv: list[str]) -> dict:
    opts = {"tiles": TILES, "opts": ["adam"], "layouts": ["bf16 params", "bf16 states"],
            "off_only": False}
    for arg in argv:
        if arg == "--off-only":
            opts["off_only"] = True
        elif arg.startswith("--") and "=" in arg:
            key, _, value = arg[2:].partition("=")
            opts[key] = value.split(",")
    return opts


def alias(name: str, **kw):
    if name == "sgd":
        return ftopt.sgd(1e-3, momentum=0.9, **kw)
    return getattr(ftopt, name)(1e-3, **kw)


def copy_tb_s(dev) -> float:
    src = torch.empty(1 << 29, device=dev)
    dst = torch.empty_like(src)
    ms = statistics.median(event_ms(lambda: dst.copy_(src), 20, 3))
    return 2 * src.numel() * 4 / ms / 1e9


def main() -> None:
    dev = torch.device("cuda")
    out = pathlib.Path(sys.argv[1])
    opts = options(sys.argv[2:])
    cfg = gpu_step.gpt2_tree_config(dev)
    copy_bw = copy_tb_s(dev)
    print(f"copy {copy_bw:.3f} TB/s")
    t = gpu_step.median_step_ms
    defaults = (tiles.BLOCK, tiles.NUM_WARPS, half_tiles.PLAIN, half_tiles.SELECT)
    res = []
    for layout in opts["layouts"]:
        dtype, kw, state_bytes = LAYOUTS[layout]
        params, grads = gpu_step._tree(cfg, dtype, seed=21)
        sparse, _ = gpu_step._sparse_wte(grads, cfg)
        numel = sum(p.numel() for p in params.values())
        p_bytes = next(iter(params.values())).element_size()
        for name in opts["opts"]:
            nbytes = 3 * p_bytes + 2 * state_bytes * SLOTS[name]  # read g, p; write p
            for tile in [*opts["tiles"], "default"]:
                if tile == "default":
                    tiles.BLOCK, tiles.NUM_WARPS, half_tiles.PLAIN, half_tiles.SELECT = defaults
                else:
                    tiles.BLOCK, tiles.NUM_WARPS = (int(x) for x in tile.split("x"))
                    half_tiles.PLAIN, half_tiles.SELECT = {}, {}
                gpu_step._clear_lowering_caches()
                row = dict(layout=layout, opt=name, tile=tile,
                           off=t(alias(name, **kw), params, grads))
                row["of_copy"] = nbytes * numel / row["off"] / 1e9 / copy_bw
                line = (f"{layout:26s} {name:9s} {tile:8s} off {row['off']:.3f} "
                        f"({row['of_copy']:.2f} of copy)")
                if not opts["off_only"]:
                    row.update(skip_dense=t(alias(name, skip_zeros=True, **kw), params, grads),
                               off_sparse=t(alias(name, **kw), params, sparse),
                               skip_sparse=t(alias(name, skip_zeros=True, **kw), params,
                                             sparse))
                    cost = (row["skip_dense"] / row["off"] - 1) * 100
                    line += (f" skip {row['skip_dense']:.3f} ({cost:+.1f}%) sparse off "
                             f"{row['off_sparse']:.3f} skip {row['skip_sparse']:.3f} "
                             f"({row['off_sparse'] / row['skip_sparse']:.2f}x)")
                res.append(row)
                print(line, flush=True)
    tiles.BLOCK, tiles.NUM_WARPS, half_tiles.PLAIN, half_tiles.SELECT = defaults
    out.mkdir(parents=True, exist_ok=True)
    (out / "tile16.json").write_text(json.dumps({"copy_tb_s": copy_bw, "runs": res},
                                                indent=1))


if __name__ == "__main__":
    main()
