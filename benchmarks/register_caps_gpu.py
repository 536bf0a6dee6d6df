"""Which register cap each kernel compiles with (``ftopt.lowering.tiles.CAP_SPILLS`` and
``CAP_STEP``): each capped compile's cap, registers and spills (a kernel spilling more
than CAP_SPILLS compiles again at a higher cap), and every compiled kernel's registers,
spills, the cap it asked for and the one it compiled with, and its constants; each cap
search's compiles and seconds (cold where the Triton cache is). 8-bit and 32-bit
Adam, AdamW, AdEMAMix, Lion and LAMB, with and without skip_zeros, over a 1M-element
leaf and a 4096x768 one (dense, then most rows zero), three donated steps each.

    python3 benchmarks/register_caps_gpu.py
"""
from __future__ import annotations

import time

import torch

import ftopt
from ftopt.lowering import launch

NAMES = ("adam", "adamw", "ademamix", "lion", "lamb")
_spills = launch._spills
_fit_cap = launch._fit_cap


def _logged(compiled) -> int:
    spills = _spills(compiled)
    print(f"capped compile: {compiled.name} cap {getattr(compiled.metadata, 'maxnreg', None)} "
          f"registers {compiled.n_regs} spills {spills}")
    return spills


def _timed(kernel, args, grid, named) -> None:
    start = time.perf_counter()
    _fit_cap(kernel, args, grid, named)
    print(f"cap search: {time.perf_counter() - start:.1f} s, runs at "
          f"{named.get('maxnreg', 'uncapped')}")


def main() -> None:
    launch._spills = _logged
    launch._fit_cap = _timed
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in NAMES:
        for bits in (8, 32):
            for skip in (False, True):
                print(f"-- {name}, {bits}-bit states, skip_zeros={skip}")
                tx = getattr(ftopt, name)(1e-3, state_bits=bits, skip_zeros=skip)
                p = {"a": torch.randn(1 << 20, device="cuda", generator=gen),
                     "b": torch.randn(4096, 768, device="cuda", generator=gen)}
                s = tx.init(p)
                for sparse in (False, True):
                    g = {k: torch.randn(v.shape, device="cuda", generator=gen)
                         for k, v in p.items()}
                    if sparse:
                        g["b"][:3500] = 0
                    for _ in range(3):
                        p, s = ftopt.step(tx, p, g, s, donate=True)
    torch.cuda.synchronize()
    print("\nkernel | registers | spills | cap asked | compiled with | block | warps")
    for key, (compiled, _) in launch._COMPILED.items():
        consts = dict(key[1])
        print(f"{compiled.name} | {compiled.n_regs} | {compiled.n_spills} | "
              f"{consts.get('maxnreg')} | {getattr(compiled.metadata, 'maxnreg', None)} | "
              f"{consts.get('BLOCK')} | {consts.get('num_warps')}")


if __name__ == "__main__":
    main()
