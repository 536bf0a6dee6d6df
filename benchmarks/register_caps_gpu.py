"""Which kernels keep their register cap (``ftopt.lowering.tiles.CAP_SPILLS``): each capped
compile's registers and spills, whether the kernel then ran capped or at the compiler's
choice, and every compiled kernel's registers, spills and constants. 8-bit and 32-bit
Adam, AdamW, AdEMAMix, Lion and LAMB, with and without skip_zeros, over a 1M-element
leaf and a 4096x768 one (dense, then most rows zero), three donated steps each.

    python3 benchmarks/register_caps_gpu.py
"""
from __future__ import annotations

import torch

import ftopt
from ftopt.lowering import launch

NAMES = ("adam", "adamw", "ademamix", "lion", "lamb")
_capped = launch._spills_at_cap


def _logged(compiled) -> bool:
    uncapped = _capped(compiled)
    print(f"capped compile: {compiled.name} registers {compiled.n_regs} spills "
          f"{compiled.n_spills} -> {'uncapped' if uncapped else 'kept'}")
    return uncapped


def main() -> None:
    launch._spills_at_cap = _logged
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
