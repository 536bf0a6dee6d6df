"""What a GPU's Triton conversions do to a 16-bit NaN's bits: each fp16 and bf16 quiet
NaN (signs and payloads) widened to fp32 and, after ``+ 0.0``, narrowed back. Where the
widening gives the canonical NaN, a fused kernel keeps the loaded 16-bit bits beside the
fp32 value (``ftopt.lowering.lanes.half_load_lines``).

    python3 benchmarks/nan_widen_gpu.py
"""
import torch
import triton
import triton.language as tl

PATTERNS = {torch.float16: [0xFE00, 0x7E01, 0x7FFF, 0xFFFF],
            torch.bfloat16: [0xFFC1, 0x7FC0, 0x7FFF, 0xFFFF]}


@triton.jit
def _widen(x_ptr, wide_ptr, back_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    wide = x.to(tl.float32)
    tl.store(wide_ptr + offs, wide, mask=mask)
    tl.store(back_ptr + offs, (wide + 0.0).to(x.dtype), mask=mask)


def main() -> None:
    for dtype, patterns in PATTERNS.items():
        x = torch.tensor(patterns, dtype=torch.int32).to(torch.int16).cuda().view(dtype)
        wide = torch.empty(len(patterns), dtype=torch.float32, device="cuda")
        back = torch.empty_like(x)
        _widen[(1,)](x, wide, back, len(patterns), BLOCK=4)
        print(dtype, "bits", [hex(p) for p in patterns],
              "widened", [hex(v & 0xFFFFFFFF) for v in wide.view(torch.int32).tolist()],
              "round trip", [hex(v & 0xFFFF) for v in back.view(torch.int16).tolist()])


if __name__ == "__main__":
    main()
