"""8-bit encoder ablation on one GPU: times variants of the 8-bit Adam kernel.

Each variant is an encoder of ``ftopt.lowering.quantized.ENCODERS``, optionally with parts
of the generated source edited out (``+nodiv``: an approximate division by the block's
absmax; ``+noclean``: no NaN test or clamps; both give wrong codes: cost estimates only),
at each tile (elements x warps), on one 64M fp32 tensor and the GPT-2 tree.

    python3 benchmarks/eight_bit_ablation.py OUT arithmetic,log2,log2-rcp 256x1,256x2
"""
import json
import pathlib
import statistics
import sys

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks")]
import gpu_step  # noqa: E402
import torch  # noqa: E402
from timing import donated_step_ms  # noqa: E402

import ftopt  # noqa: E402
from ftopt.lowering import quantized, tiles  # noqa: E402

dev = torch.device("cuda")
orig_store = quantized.store_lines


def nodiv(lines):
    out = []
    for line in lines:
        if "tl.div_rn(" in line:
            pre, rest = line.split("tl.div_rn(", 1)
            a, b = rest[:-1].split(", ", 1)
            line = f"{pre}({a}) * (1.0 / ({b}))"
        out.append(line)
    return out


def noclean(lines):  # drop the NaN test and clamps
    return [ln for ln in lines if "_v == " not in ln and ", -1.0), 1.0)" not in ln]


def patched(role, old, value, signed, zero, tail, encoder="arithmetic"):
    base, *mods = encoder.split("+")
    lines = orig_store(role, old, value, signed, zero, tail, base)
    for m in mods:
        lines = {"nodiv": nodiv, "noclean": noclean}[m](lines)
    return lines


quantized.store_lines = patched


def trees():
    g = torch.Generator(device=dev).manual_seed(0)
    one = {"w": torch.randn(64 * 2**20, device=dev, generator=g)}
    shapes = gpu_step.gpt2_shapes(50257, 768, 1024, 12)
    gpt = {k: torch.randn(s, device=dev, generator=g) for k, s in shapes.items()}
    return {"64M": one, "gpt2": gpt}


def time_variant(params, encoder, tile, n=40, reps=5):
    quantized.ENCODER = encoder
    tiles.QUANT_TILE = tile
    gpu_step._clear_lowering_caches()
    grads = {k: torch.randn_like(v) * 1e-2 for k, v in params.items()}
    ts = donated_step_ms(ftopt.adam(1e-3, state_bits=8), params, grads, n, reps)
    return statistics.median(ts), min(ts)


def main():
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    variants = sys.argv[2].split(",")
    tiles_ = [tuple(int(x) for x in t.split("x")) for t in sys.argv[3].split(",")]
    res = []
    for name, params in trees().items():
        for tile in tiles_:
            for enc in variants:
                med, best = time_variant(params, enc, tile)
                res.append(dict(tree=name, encoder=enc, tile=tile, median_ms=med, best_ms=best))
                print(f"{name:5s} {enc:28s} {tile} {med:.4f} {best:.4f}", flush=True)
    (out / "ablate8.json").write_text(json.dumps(res, indent=1))


main()
