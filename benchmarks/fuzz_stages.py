"""A fuzz example's chain, prefix by prefix: fused against eager against float64.

Where the fuzzed contract (``benchmarks/fuzz.py``) reports fused and eager apart, this
replays the example with the first 1, 2, ... transforms of its chain and prints, per
leaf, the relative distance of fused from eager and of each from float64, so the stage
where they part shows. The update is taken at step ``--step`` from the state that eager
steps reach (as the contract's check does).

    python3 benchmarks/fuzz_stages.py 22:644 --step 1 [--structures 30 --dtypes 2] [--device cpu]
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

import torch  # noqa: E402
from fuzz_cases import build  # noqa: E402
from fuzz_checks import _rel, _widen  # noqa: E402

import ftopt  # noqa: E402


def prefixes(case, step: int) -> list[str]:
    """One line per prefix and leaf."""
    st = case.structure
    lines = []
    for k in range(1, len(st.parts) + 1):
        tx = build(dataclasses.replace(st, parts=st.parts[:k], skip_at=min(st.skip_at, k)),
                   case.hparams[:k])
        p, s = case.params, tx.init(case.params)
        for i in range(step):
            p, s = ftopt.step(tx, p, case.grads[i], s, backend="eager")
        g = case.grads[step]
        wide = [_widen(x, None) for x in (p, g, s)]
        runs = [tx.update(g, s, p, backend="fused")[0], tx.update(g, s, p, backend="eager")[0],
                tx.update(wide[1], wide[2], wide[0], backend="eager")[0]]
        paths = ftopt.tree.flatten_with_paths(runs[0])[0]
        leaves = [ftopt.tree.flatten_with_paths(r)[1] for r in runs]
        for path, f, e, r in zip(paths, *leaves):
            if f is None or f.numel() == 0:
                continue
            line = (f"{k} {st.parts[k - 1].entry.name} {path}: fused-eager {_rel(f, e):.3g}, "
                    f"fused-f64 {_rel(f, r):.3g}, eager-f64 {_rel(e, r):.3g}")
            d = (f.double() - e.double()).abs().reshape(-1)
            if d.max() > 0:
                j = int(d.argmax())
                line += (f"; worst at {j}: fused {f.reshape(-1)[j].item():.9g}, eager "
                         f"{e.reshape(-1)[j].item():.9g}, f64 {r.reshape(-1)[j].item():.9g}")
            lines.append(line)
    return lines


def replayed_case(description: str, step: int, extra=None):
    """(the fuzz example named on the command line, the parsed arguments): SEED:INDEX,
    ``--step`` (default ``step``), ``--structures``, ``--dtypes``, ``--device``, and what
    ``extra(parser)`` adds."""
    import fuzz

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("replay", help="SEED:INDEX of a fuzz example")
    ap.add_argument("--step", type=int, default=step)
    ap.add_argument("--structures", type=int, default=30)
    ap.add_argument("--dtypes", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    if extra is not None:
        extra(ap)
    args = ap.parse_args()
    seed, index = (int(x) for x in args.replay.split(":"))
    case = fuzz.example(seed, index, fuzz.structure_pool(seed, args.structures, args.dtypes),
                        args.device)
    print(case.describe())
    return case, args


def main() -> None:
    case, args = replayed_case(__doc__.split("\n")[0], 0)
    print("\n".join(prefixes(case, args.step)))


if __name__ == "__main__":
    main()
