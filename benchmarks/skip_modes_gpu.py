"""skip_zeros per layout and mode on one GPU (``ftopt.lowering.tiles.SKIP_MODES``).

For each layout of ``gpu_step.LAYOUTS`` and each way a donated step may skip zero
gradients, the time of Adam with skip_zeros against without, with dense gradients and with
90% of the embedding's rows zero (GPT-2 tree); then each compiled kernel's registers.

    python3 benchmarks/skip_modes_gpu.py OUT [MODES]     # MODES: e.g. "select,chunks"

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
ONLY = sys.argv[2].split(",") if len(sys.argv) > 2 else []


res = []
for name, (dtype, kw, _) in gpu_step.LAYOUTS.items():
    key = ("8-bit" if "state_bits" in kw else "16-bit states" if "state_dtype" in kw
           else "fp32" if name == "fp32" else "16-bit")
    params, grads = gpu_step._tree(cfg, dtype, seed=21)
    sparse, frac = gpu_step._sparse_wte(grads, cfg)
    pairs = (("dense", grads), ("sparse", sparse))
    base = {g: t(ftopt.adam(1e-3, **kw), params, gr) for g, gr in pairs}
    modes = (["select", "stores", "split+select", "split+stores"] if key == "8-bit"
             else ["in_place", "select", "stores", "in_place+stores", "chunks",
                   "split+in_place", "split+select", "split+stores"])
    modes = [m for m in modes if not ONLY or m in ONLY]
    for mode in modes:
        tiles.SKIP_MODES[key] = mode
        gpu_step._clear_lowering_caches()
        for g, gr in (("dense", grads), ("sparse", sparse)):
            ms = t(ftopt.adam(1e-3, skip_zeros=True, **kw), params, gr)
            res.append(dict(layout=name, mode=mode, grads=g, base=base[g], skip=ms))
            print(f"{name:26s} {mode:15s} {g:6s} base {base[g]:.3f} skip {ms:.3f} "
                  f"({(ms / base[g] - 1) * 100:+.1f}%)", flush=True)
    del params, grads, sparse
    torch.cuda.empty_cache()
out = pathlib.Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
(out / "skipmodes.json").write_text(json.dumps(res, indent=1))

from ftopt.lowering import codegen  # noqa: E402

for key, mod in codegen._MODULES.items():
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
