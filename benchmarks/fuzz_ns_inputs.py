"""A fuzz example's Newton-Schulz inputs and outputs, fused against eager, chain by chain.

Where a fuzz example with a Muon stage (``scale_by_muon``) finds fused and eager apart
after it, this records what the orthogonalisation (:func:`ftopt.transforms.muon.
newton_schulz`) received and returned in the update of step ``--step`` (from the state
eager steps reach), for the chain's first ``k`` stages and the whole chain, on each
backend, and prints how far apart they are; then the same call recomputed on the
recorded input in other memory layouts, and the whole update's distance.

    python3 benchmarks/fuzz_ns_inputs.py 22:644 [--step 1] [--prefix 4] [--device cpu]

(A prefix's inputs differ from the whole chain's: the eager steps before ``--step`` move
the params differently. Compare fused with eager within one chain.)
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

import torch  # noqa: E402
from fuzz_cases import build  # noqa: E402
from fuzz_stages import replayed_case  # noqa: E402

import ftopt  # noqa: E402
from ftopt.transforms import muon  # noqa: E402

_CALLS: list = []
_ORIGINAL = muon.newton_schulz


def _recorded(x, *args, **kwargs):
    y = _ORIGINAL(x, *args, **kwargs)
    _CALLS.append((x.detach().clone(), y.detach().clone(), args, kwargs))
    return y


def run(case, k: int, backend: str, step: int):
    """(the Newton-Schulz calls, the update) of the first ``k`` stages on ``backend``."""
    st = case.structure
    tx = build(dataclasses.replace(st, parts=st.parts[:k], skip_at=min(st.skip_at, k)),
               case.hparams[:k])
    p, s = case.params, tx.init(case.params)
    for i in range(step):
        p, s = ftopt.step(tx, p, case.grads[i], s, backend="eager")
    _CALLS.clear()
    update = tx.update(case.grads[step], s, p, backend=backend)[0]
    return list(_CALLS), update


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def main() -> None:
    case, args = replayed_case(__doc__.split("\n")[0], 1, lambda ap: ap.add_argument(
        "--prefix", type=int, default=None, help="also the first K stages"))
    muon.newton_schulz = _recorded
    whole = len(case.structure.parts)
    for k in sorted({args.prefix or whole, whole}):
        got = {b: run(case, k, b, args.step) for b in ("fused", "eager")}
        for i, (f, e) in enumerate(zip(got["fused"][0], got["eager"][0])):
            print(f"{k} stages, call {i} {tuple(f[0].shape)}: input fused-eager "
                  f"{_gap(f[0], e[0]):.3g}, output {_gap(f[1], e[1]):.3g}")
        if got["fused"][0]:
            x, _, a, kw = got["fused"][0][0]
            ref = _ORIGINAL(x.contiguous(), *a, **kw)
            for name, xx in (("as recorded", x), ("a copy", x.clone())):
                print(f"{k} stages, recomputed on the fused input ({name}): "
                      f"{_gap(_ORIGINAL(xx, *a, **kw), ref):.3g} from contiguous")
        for key, f in got["fused"][1].items():
            if f is not None and f.numel():
                print(f"{k} stages, update {key}: fused-eager "
                      f"{_gap(f, got['eager'][1][key]):.3g}")


if __name__ == "__main__":
    main()
