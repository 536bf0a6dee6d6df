"""skip_zeros per layout and mode on one GPU (``ftopt.lowering.tiles.SKIP_MODES``).

For each layout of ``gpu_step.LAYOUTS`` and each way a donated step may skip zero
gradients, the time of Adam with skip_zeros against without, with dense gradients and with
90% of the embedding's rows zero (GPT-2 tree); with all gradients zero (the default
mode), against the time of reading the gradients at the copy bandwidth; then each
compiled kernel's registers.

    python3 benchmarks/skip_modes_gpu.py OUT [MODES] [--interleave=0,16] [--layouts=8-bit]
    # MODES: e.g. "select,chunks", or "defaults" (each layout's own); --interleave: the
    # main kernels' program orders to time in turn (tiles.INTERLEAVE; 0: in order);
    # --layouts: only those (keys of tiles.SKIP_MODES: fp32, 16-bit, "16-bit states",
    # 8-bit)

Gradients: "dense"; "sparse" (90% of the embedding's rows zero, the same rows every
step); "moving" (as sparse, but other rows each step: 8 draws in turn, the worst case
for a mode that keeps what it saw at the last step); "mixed" (one gradient in 97 zero:
every block part zero).

("tiles" and "in_place+tiles" were measured before and lost on every layout: see
benchmarks/RESULTS.md; this run compares the others with "stores" and "chunks".)
"""
import json
import pathlib
import sys

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks")]
import gpu_step  # noqa: E402
import torch  # noqa: E402

import ftopt  # noqa: E402
from ftopt.lowering import tiles  # noqa: E402

dev = torch.device("cuda")
cfg = gpu_step.gpt2_tree_config(dev)


t = gpu_step.median_step_ms
# python3 benchmarks/skip_modes_gpu.py OUT [MODE,MODE...]: only those modes
ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]


def _option(name: str, default: int) -> list[int]:
    return [int(x) for a in sys.argv[1:] if a.startswith(f"--{name}=")
            for x in a.split("=", 1)[1].split(",")] or [default]


ORDERS = _option("interleave", tiles.INTERLEAVE)
# --layouts=8-bit,fp32: only the layouts of those keys of tiles.SKIP_MODES
LAYOUTS = [x for a in sys.argv[1:] if a.startswith("--layouts=")
           for x in a.split("=", 1)[1].split(",")]
ONLY = ARGS[1].split(",") if len(ARGS) > 1 else []


def _copy_tbps() -> float:
    """The device's copy bandwidth (read + write), one 1 GiB fp32 copy, median of 20."""
    src = torch.rand(2**28, device=dev)
    dst = torch.empty_like(src)
    times = []
    for _ in range(25):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return 2 * src.numel() * 4 / (sorted(times[5:])[10] * 1e-3) / 1e12


DEFAULTS = dict(tiles.SKIP_MODES)
COPY_TBPS = _copy_tbps()
res = []
for order in ORDERS:
    tiles.INTERLEAVE = order
    gpu_step._clear_lowering_caches()
    for name, kw, key, params, grads in gpu_step.layout_trees(cfg, LAYOUTS):
        sparse, frac = gpu_step._sparse_wte(grads, cfg)
        moving, mixed = gpu_step._moving_wte(grads, cfg), gpu_step._scattered_zeros(grads)
        pairs = (("dense", grads), ("sparse", sparse), ("moving", moving), ("mixed", mixed))
        base = {g: t(ftopt.adam(1e-3, **kw), params, gr) for g, gr in pairs}
        modes = (["select", "stores", "split+select", "split+stores", "split+defer"]
                 if key == "8-bit"
                 else ["in_place", "select", "stores", "in_place+stores", "chunks",
                       "split+in_place", "split+select", "split+stores", "split+defer"])
        modes = ([DEFAULTS[key]] if ONLY == ["defaults"] else
                 [m for m in modes if not ONLY or m in ONLY])
        for mode in modes:
            tiles.SKIP_MODES[key] = mode
            gpu_step._clear_lowering_caches()
            for g, gr in pairs:
                ms = t(ftopt.adam(1e-3, skip_zeros=True, **kw), params, gr)
                res.append(dict(interleave=order, layout=name, mode=mode,
                                grads=g, base=base[g], skip=ms))
                print(f"{order:3d} {name:26s} {mode:15s} {g:6s} base {base[g]:.3f} "
                      f"skip {ms:.3f} ({(ms / base[g] - 1) * 100:+.1f}%)", flush=True)
        # All gradients zero, the default mode: every program returns after reading its
        # gradients, so the floor is those bytes at the copy bandwidth; the excess is what
        # the programs cost beyond their bytes (their latency).
        tiles.SKIP_MODES[key] = DEFAULTS[key]
        gpu_step._clear_lowering_caches()
        zeros = {k: torch.zeros_like(v) for k, v in grads.items()}
        ms = t(ftopt.adam(1e-3, skip_zeros=True, **kw), params, zeros)
        floor = sum(v.numel() * v.element_size() for v in zeros.values()) / COPY_TBPS / 1e9
        res.append(dict(interleave=order, layout=name, mode=DEFAULTS[key],
                        grads="zero", skip=ms, floor=floor))
        print(f"{order:3d} {name:26s} {DEFAULTS[key]:15s} zero   skip {ms:.3f} "
              f"floor {floor:.3f} (copy {COPY_TBPS:.2f} TB/s)", flush=True)
        del params, grads, sparse, zeros, moving, mixed
        torch.cuda.empty_cache()
out = pathlib.Path(ARGS[0])
out.mkdir(parents=True, exist_ok=True)
(out / "skipmodes.json").write_text(json.dumps(res, indent=1))

from ftopt.lowering import kernel_files  # noqa: E402

for key, mod in kernel_files._MODULES.items():
    src = open(mod.__file__).read()
    tags = " ".join(t for t, on in (
        ("8bit", "qmap" in src), ("tiles", "if tl.sum((tl.load(g_ptr" in src),
        ("inplace", "mask=keep" in src or "& keep" in src), ("bf16", "uint16" in src),
        ("split", "live_lanes" in src)) if on)
    fn = getattr(mod, "ftopt_main", None)
    for cache in (fn.device_caches.values() if fn is not None else ()):
        for k in cache[0].values():
            print(f"kernel {key[:8]} {tags:24s} regs {k.n_regs} spills {k.n_spills} "
                  f"warps {k.metadata.num_warps}")
