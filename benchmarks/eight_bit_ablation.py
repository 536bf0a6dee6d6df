"""8-bit encoder ablation on one GPU: times variants of the 8-bit Adam kernel.

Each variant is an encoder of ``ftopt.lowering.quantized.ENCODERS``, optionally with parts
of the generated source edited out (``+nothreshold``: the encoder's gather of the code
boundary becomes a constant; ``+nodecode``: the decode gathers become the code itself;
both give wrong codes: cost estimates only), at each tile (elements x warps) and register
cap (``maxnreg``; "none": the compiler's choice), on one 64M fp32 tensor and the GPT-2
tree. ``FTOPT_FAST_MATH`` applies as set.

    python3 benchmarks/eight_bit_ablation.py OUT poly-rcp,poly-exp-rcp 256x1,256x2 none,64,72
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
from ftopt.lowering import kernel_files, quantized, tiles  # noqa: E402

dev = torch.device("cuda")
orig_store, orig_load = quantized.store_lines, quantized.load_lines


def patched_store(role, old, value, signed, zero, tail, encoder="arithmetic", *rest):
    base, *mods = encoder.split("+")
    lines = orig_store(role, old, value, signed, zero, tail, base, *rest)
    if "nothreshold" in mods:
        q, qmap = f"q_{role}", quantized.qmap_var(signed)
        lines = [ln.replace(f"tl.load({qmap} + 256 + {q}_lo)", "0.5") for ln in lines]
    return lines


def patched_load(name, role, signed, load_mask):
    lines = orig_load(name, role, signed, load_mask)
    if "nodecode" in quantized.ENCODER:
        gather = f"tl.load({quantized.qmap_var(signed)} + {name}_code)"
        lines = [ln.replace(gather, f"{name}_code.to(tl.float32)") for ln in lines]
    return lines


quantized.store_lines, quantized.load_lines = patched_store, patched_load


def trees():
    g = torch.Generator(device=dev).manual_seed(0)
    one = {"w": torch.randn(64 * 2**20, device=dev, generator=g)}
    shapes = gpu_step.gpt2_shapes(50257, 768, 1024, 12)
    gpt = {k: torch.randn(s, device=dev, generator=g) for k, s in shapes.items()}
    return {"64M": one, "gpt2": gpt}


def time_variant(params, grads, encoder, tile, cap, n=40, reps=5):
    quantized.ENCODER = encoder
    tiles.QUANT_TILE, tiles.QUANT_MAXNREG = tile, cap
    gpu_step._clear_lowering_caches()
    ts = donated_step_ms(ftopt.adam(1e-3, state_bits=8), params, grads, n, reps)
    return statistics.median(ts), min(ts)


def registers() -> list[str]:
    out = []
    for key, mod in kernel_files._MODULES.items():
        fn = getattr(mod, "ftopt_main", None)
        for cache in (fn.device_caches.values() if fn is not None else ()):
            out += [f"{key[:8]} regs {k.n_regs} spills {k.n_spills}"
                    for k in cache[0].values()]
    return out


def main():
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    variants = sys.argv[2].split(",")
    tiles_ = [tuple(int(x) for x in t.split("x")) for t in sys.argv[3].split(",")]
    caps = [None if c == "none" else int(c)
            for c in (sys.argv[4] if len(sys.argv) > 4 else "72").split(",")]
    res = []
    for name, params in trees().items():
        grads = {k: torch.randn_like(v) * 1e-2 for k, v in params.items()}
        for tile in tiles_:
            for cap in caps:
                for enc in variants:
                    if "+" in enc and (tile != tiles_[0] or cap != caps[0]):
                        continue  # ablations at the first tile and cap only
                    med, best = time_variant(params, grads, enc, tile, cap)
                    res.append(dict(tree=name, encoder=enc, tile=tile, maxnreg=cap,
                                    median_ms=med, best_ms=best))
                    print(f"{name:5s} {enc:28s} {tile} cap {cap} {med:.4f} {best:.4f}",
                          flush=True)
    print("\n".join(sorted(set(registers()))))
    (out / "ablate8.json").write_text(json.dumps(res, indent=1))


main()
