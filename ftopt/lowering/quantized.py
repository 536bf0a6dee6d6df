"""Triton source for 8-bit blockwise state slots (SPEC §5), used by :mod:`codegen`.

A quantized slot is read as ``qmap[code] * absmax[block]`` and written by taking each
256-element block's new absmax, normalising, and picking the nearest code with an 8-step
binary search over the sorted 256-entry map (the rule of :func:`ftopt.quant.nearest_code`:
the upper neighbour only if strictly nearer). A block whose gradients are all zero keeps
its codes and absmax.
"""

from __future__ import annotations


def qmap_var(signed: bool) -> str:
    return "qmap_signed_ptr" if signed else "qmap_unsigned_ptr"


def load_lines(name: str, role: str, signed: bool, load_mask: str) -> list[str]:
    """Dequantize slot ``role`` into variable ``name``."""
    return [
        f"{name}_code = tl.load({role}_in + offs{load_mask}).to(tl.int32)",
        f"{name} = tl.load({qmap_var(signed)} + {name}_code) * "
        f"tl.load({role}_amax_in + offs // QBLOCK{load_mask})",
    ]


def store_lines(role: str, old: str, value: str, signed: bool, zero: str | None,
                tail: bool) -> list[str]:
    """Quantize ``value`` (fp32, one per lane) into slot ``role``'s codes and absmax."""
    q = f"q_{role}"
    qmap = qmap_var(signed)
    shape = "(BLOCK // QBLOCK, QBLOCK)"
    x = f"tl.where(in_range, {value}, 0.0)" if tail else value
    lines = [
        f"{q}_x = tl.reshape({x} + tl.zeros([BLOCK], tl.float32), {shape})",
        # The largest finite magnitude; NaN codes as 0, +-Inf as +-1 (ftopt.quant).
        f"{q}_abs = tl.abs({q}_x)",
        f"{q}_amax = tl.max(tl.where({q}_abs <= 3.4028234663852886e38, {q}_abs, 0.0), axis=1)",
        f"{q}_v = tl.div_rn({q}_x, tl.where({q}_amax > 0.0, {q}_amax, 1.0)[:, None])",
        f"{q}_v = tl.where({q}_v == {q}_v, {q}_v, 0.0)",
        f"{q}_v = tl.minimum(tl.maximum({q}_v, -1.0), 1.0)",
        f"{q}_pos = tl.zeros({shape}, tl.int32)",
    ]
    for step in (128, 64, 32, 16, 8, 4, 2, 1):
        lines.append(f"{q}_pos = tl.where(tl.load({qmap} + {q}_pos + {step - 1}) < {q}_v, "
                     f"{q}_pos + {step}, {q}_pos)")
    lines += [
        f"{q}_hi = tl.minimum(tl.maximum({q}_pos, 1), 255)",
        f"{q}_code = tl.where(tl.load({qmap} + {q}_hi) - {q}_v < "
        f"{q}_v - tl.load({qmap} + {q}_hi - 1), {q}_hi, {q}_hi - 1)",
        f"{q}_block = start // QBLOCK + tl.arange(0, BLOCK // QBLOCK)",
    ]
    block_mask = f", mask={q}_block * QBLOCK < n" if tail else ""
    if zero is not None:
        skipped = f"tl.where(in_range, {zero}, True)" if tail else zero
        lines += [
            f"{q}_all = tl.min(tl.reshape({skipped}.to(tl.int32), {shape}), axis=1) == 1",
            f"{q}_code = tl.where({q}_all[:, None], tl.reshape({old}_code, {shape}), "
            f"{q}_code)",
            f"{q}_amax = tl.where({q}_all, tl.load({role}_amax_in + {q}_block{block_mask}),"
            f" {q}_amax)",
        ]
    store_mask = ", mask=in_range" if tail else ""
    lines += [
        f"tl.store({role}_out + offs, tl.reshape({q}_code, (BLOCK,)).to(tl.uint8)"
        f"{store_mask})",
        f"tl.store({role}_amax_out + {q}_block, {q}_amax{block_mask})",
    ]
    return lines
