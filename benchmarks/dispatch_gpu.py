"""The GPU's rate of starting programs, on one GPU: a floor under every kernel of tiny
programs.

Launches a Triton kernel whose programs each load one byte and end (no store: every
flag is zero), over a grid of the GPT-2 tree's 8-bit programs (485k, one 256-element
block each) and of a half and a quarter of them, with 1, 2, 4 and 8 warps a program.
Where the time per program does not change with the warps (so neither registers nor
warps a multiprocessor decide it), it is the rate at which the GPU starts programs: any
kernel of that many programs takes at least that long, whatever its programs do, and
an all-zero stretch of a skip_zeros step, whose programs return after their gradients'
check, runs at it.

    python3 benchmarks/dispatch_gpu.py OUT      # prints a table, writes OUT/dispatch.json
"""
import json
import pathlib
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _one_load(flags_ptr, out_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if tl.load(flags_ptr + pid) != 0:
        tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), tl.zeros([BLOCK], tl.float32))


def _ms(fn, n: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n


def main() -> None:
    programs = 485_000  # GPT-2 small's 124M elements in 256-element blocks
    flags = torch.zeros(programs, dtype=torch.uint8, device="cuda")
    out = torch.empty(programs * 256, device="cuda")
    rows = []
    print("| programs | warps | us | ns a program |\n| --- | --- | --- | --- |")
    for warps in (1, 2, 4, 8):
        for part in (1, 2, 4):
            n = programs // part
            ms = _ms(lambda n=n, w=warps: _one_load[(n,)](flags, out, BLOCK=256, num_warps=w))
            rows.append(dict(programs=n, warps=warps, us=ms * 1e3, ns_per_program=ms * 1e6 / n))
            print(f"| {n} | {warps} | {ms * 1e3:.1f} | {ms * 1e6 / n:.3f} |", flush=True)
    dest = pathlib.Path(sys.argv[1])
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "dispatch.json").write_text(json.dumps(
        dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
