"""What a skip_zeros step would gain by running a mostly-zero leaf in a group of its own
with spans (``tiles.SPANS``), measured before building it.

GPT-2 Adam, per layout of ``gpu_step.LAYOUTS`` (``--layouts=8-bit,16-bit states``), 90%
of the embedding's rows zero ("sparse"), donated steps (``gpu_step.median_step_ms``), in
two rounds: the whole tree without skip_zeros ("off") and with it (as shipped: one group,
the layout's span), the tree without the embedding with skip_zeros ("rest"), and the
embedding alone with skip_zeros at each span of ``--spans=1,2,4,8`` ("wte span s").
Each is timed as a step (CUDA events) and by its kernels' device time (the
profiler: a step of the embedding alone is bound by its host time); "rest" plus the best
"wte span s", by kernels, estimates a step of two groups. Prints each round and the medians,
writes ``OUT/leaf_split.json``.

    python3 benchmarks/leaf_split_gpu.py OUT [--layouts=...] [--spans=1,2,4,8]
"""
import json
import pathlib
import statistics
import sys

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks")]
import gpu_step  # noqa: E402
import timing  # noqa: E402
import torch  # noqa: E402

import ftopt  # noqa: E402
from ftopt.lowering import launch, tiles  # noqa: E402

WTE = "transformer.wte.weight"


def _arg(name: str, default: str) -> list[str]:
    return [x for a in sys.argv[2:] if a.startswith(f"--{name}=")
            for x in a.split("=", 1)[1].split(",")] or default.split(",")


def _ms(kw: dict, skip: bool, params: dict, grads: dict) -> tuple[float, float]:
    """(median ms of a step, us of its kernels by the profiler)."""
    gpu_step._clear_lowering_caches()
    launch._COMPILED.clear()
    tx = ftopt.adam(1e-3, skip_zeros=skip, **kw)
    kernels = timing.kernel_us(tx, params, grads)
    return (gpu_step.median_step_ms(tx, params, grads),
            sum(k["per_step"] * k["mean_us"] for k in kernels.values()))


def main() -> None:
    cfg = gpu_step.gpt2_tree_config(torch.device("cuda"))
    spans = [int(s) for s in _arg("spans", "1,2,4,8")]
    rows = []
    for name, kw, key, params, grads in gpu_step.layout_trees(
            cfg, _arg("layouts", "8-bit,16-bit states")):
        sparse, _ = gpu_step._sparse_wte(grads, cfg)
        rest_p = {k: v for k, v in params.items() if k != WTE}
        rest_g = {k: v for k, v in sparse.items() if k != WTE}
        wte_p, wte_g = {WTE: params[WTE]}, {WTE: sparse[WTE]}
        shipped = tiles.SPANS.get(key)
        times: dict = {}
        kernel: dict = {}
        for rnd in range(2):
            runs = [("off", False, params, sparse, shipped),
                    ("skip", True, params, sparse, shipped),
                    ("rest", True, rest_p, rest_g, shipped)]
            runs += [(f"wte span {s}", True, wte_p, wte_g, s) for s in spans]
            for label, skip, p, g, span in runs:
                tiles.SPANS.pop(key, None)
                if span and span > 1:
                    tiles.SPANS[key] = span
                ms, us = _ms(kw, skip, p, g)
                times.setdefault(label, []).append(ms)
                kernel.setdefault(label, []).append(us)
                print(f"{rnd} {name:30s} {label:12s} {ms:.4f} ms, kernels {us:.1f} us",
                      flush=True)
        tiles.SPANS.pop(key, None)
        if shipped:
            tiles.SPANS[key] = shipped
        med = {k: statistics.median(v) for k, v in times.items()}
        kus = {k: statistics.median(v) for k, v in kernel.items()}
        best = min((k for k in kus if k.startswith("wte")), key=kus.get)
        two = kus["rest"] + kus[best]
        print(f"{name}: kernels (us) off {kus['off']:.1f}, one group {kus['skip']:.1f} "
              f"({kus['off'] / kus['skip']:.3f}x), rest + {best} {two:.1f} "
              f"({kus['off'] / two:.3f}x); steps (ms) off {med['off']:.4f}, one group "
              f"{med['skip']:.4f} ({med['off'] / med['skip']:.3f}x)", flush=True)
        rows.append(dict(layout=name, times=times, medians=med, kernel_us=kernel,
                         kernel_medians=kus, best=best, two_groups_us=two,
                         one_group_x=kus["off"] / kus["skip"], two_groups_x=kus["off"] / two))
        del params, grads, sparse, rest_p, rest_g, wte_p, wte_g
        torch.cuda.empty_cache()
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    (out / "leaf_split.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
