"""Where a skip_zeros group of one block a program should run its spanned alternate
(``tiles.SPAN_ALTERNATES``, ``tiles.SPAN_ABOVE``), on one GPU.

GPT-2 Adam per layout of ``gpu_step.LAYOUTS`` (``--layouts=16-bit states,8-bit``, the
keys of ``tiles.SKIP_MODES``), donated steps (``gpu_step.median_step_ms``) with dense
gradients, 90% of the embedding's rows zero ("sparse", z ~ 0.28 of the blocks all zero)
and a fraction of the rows of every matrix zero ("rows 0.3", "rows 0.5", "rows 0.9"), two rounds:
no skip_zeros ("off"), the layout's split mode with one block a program ("span 1") and
with its spanned alternate throughout ("span N"), the select alternates off in both, and
the default watch ("watch"). Prints each round and the medians, with the fraction of
all-zero blocks the watch counted; writes ``OUT/span_cross.json``.

    python3 benchmarks/span_cross_gpu.py OUT [--layouts=...]
"""
import json
import pathlib
import statistics
import sys

sys.path[:0] = [str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks")]
import gpu_step  # noqa: E402
import torch  # noqa: E402

import ftopt  # noqa: E402
from ftopt.lowering import launch, tiles  # noqa: E402
from ftopt.lowering.plan import plan_chain  # noqa: E402

ONLY = [x for a in sys.argv[2:] if a.startswith("--layouts=")
        for x in a.split("=", 1)[1].split(",")] or ["16-bit states", "8-bit"]
ROWS = (0.3, 0.5, 0.9)


def zero_rows(grads: dict, fraction: float, seed: int = 11) -> dict:
    """``grads`` with ``fraction`` of the rows of every matrix zero (drawn with ``seed``)."""
    gen = torch.Generator(device=next(iter(grads.values())).device).manual_seed(seed)
    out = {}
    for k, v in grads.items():
        if v.dim() < 2:
            out[k] = v
            continue
        rows = torch.rand(v.shape[0], generator=gen, device=v.device) < fraction
        out[k] = v.clone()
        out[k][rows] = 0
    return out


def _run(kw: dict, skip: bool, params: dict, grads: dict, span_above: float,
         select: bool) -> tuple[float, float | None]:
    """(median ms, the all-zero fraction the watch counted last, if any)."""
    gpu_step._clear_lowering_caches()
    launch._COMPILED.clear()
    tiles.SPAN_ABOVE = span_above
    tiles.DEFER_SELECT_ABOVE = 0.04 if select else 2.0
    tiles.SPLIT_SELECT_ABOVE_STATES = -0.08 if select else 1e9
    tiles.SPLIT_SELECT_ABOVE = 0.2 if select else 1e9
    tx = ftopt.adam(1e-3, skip_zeros=skip, **kw)
    ms = gpu_step.median_step_ms(tx, params, grads)
    watched = [g.watch for g in plan_chain(tx).prepared.groups if g.watch is not None]
    return ms, max((w.zero_fraction or 0.0 for w in watched), default=None)


def main() -> None:
    cfg = gpu_step.gpt2_tree_config(torch.device("cuda"))
    defaults = (tiles.SPAN_ABOVE, tiles.DEFER_SELECT_ABOVE, tiles.SPLIT_SELECT_ABOVE_STATES,
                tiles.SPLIT_SELECT_ABOVE)
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, kw, key, params, grads in gpu_step.layout_trees(cfg, ONLY):
        span = tiles.SPAN_ALTERNATES.get(key, 1)
        kinds = {"dense": grads, "sparse": gpu_step._sparse_wte(grads, cfg)[0]}
        kinds.update({f"rows {f}": zero_rows(grads, f) for f in ROWS})
        variants = (("off", False, 2.0, True), ("span 1", True, 2.0, False),
                    (f"span {span}", True, -1.0, False), ("watch", True, defaults[0], True))
        times: dict = {}
        zeros: dict = {}
        for rnd in range(2):
            for kind, g in kinds.items():
                for variant, skip, above, select in variants:
                    ms, z = _run(kw, skip, params, g, above, select)
                    times.setdefault((kind, variant), []).append(ms)
                    if z is not None:
                        zeros[kind] = z
                    print(f"{rnd} {name:30s} {kind:8s} {variant:7s} {ms:.4f} ms", flush=True)
        for (kind, variant), v in times.items():
            off = statistics.median(times[(kind, "off")])
            med = statistics.median(v)
            rows.append(dict(layout=name, grads=kind, variant=variant, ms=v, median=med,
                             vs_off=med / off, zero_fraction=zeros.get(kind)))
            print(f"{name:30s} {kind:8s} (z {zeros.get(kind, 0):.2f}) {variant:7s} median "
                  f"{med:.4f} ms ({off / med:.3f}x off)", flush=True)
        (out / "span_cross.json").write_text(json.dumps(rows, indent=1))
        del params, grads, kinds
        torch.cuda.empty_cache()
    (tiles.SPAN_ABOVE, tiles.DEFER_SELECT_ABOVE, tiles.SPLIT_SELECT_ABOVE_STATES,
     tiles.SPLIT_SELECT_ABOVE) = defaults


if __name__ == "__main__":
    main()
