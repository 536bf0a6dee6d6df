"""Where the time of a mostly-zero leaf's skip_zeros step goes, measured with stand-alone
kernels before building any of them into the generated ones.

GPT-2's embedding (50257 x 768) with bf16 params, gradients and Adam states, 90% of its
rows zero (as ``gpu_step._sparse_wte``), one step with skip_zeros semantics (an element
with a zero gradient keeps its bytes). Timed by ``triton.testing.do_bench`` (medians, L2
flushed between calls), us:

* ``read floor``: a read of the gradients alone, the floor of any zero check;
* ``spanned``: programs of ``span`` blocks of 512 that check all their gradients at once
  and update their live blocks one after another (as ``ftopt.lowering.split.spanned``),
  with a work table per block (``table=True``, as a group of several leaves) or from the
  program's number (one leaf: ``codegen.Variant.one_leaf``);
* ``scan`` + ``update``: a scan that lists the live blocks (an atomic count a program),
  then a persistent kernel of ``P`` programs that takes the list in turn and resets its
  count (the last program to finish);
* ``wide``/``wide_scalar``/``wide_nomask``: one 2-D program of ``R`` rows of ``ROW``
  lanes that loads every row's gradients, and its live rows' params and states masked by
  row (or all of them: ``wide_nomask``), updated in one body, no loop.

Checks each form's bytes against another's (or torch's). Without a GPU, under
``TRITON_INTERPRET=1``, runs those checks at a small size only.

    python3 benchmarks/zero_stretch_gpu.py OUT     # OUT/zero_stretch.json
"""
import json
import pathlib
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

CPU = not torch.cuda.is_available()
DEV = torch.device("cpu" if CPU else "cuda")
ROWS, COLS, BLOCK = (300 if CPU else 50257), 768, 512
N = ROWS * COLS
NB = -(-N // BLOCK)
LR = 1e-3


def bench(res: dict, name: str, fn) -> None:
    """``fn``'s median time (us) into ``res[name]`` (on a CPU: one call, untimed)."""
    fn()
    if CPU:
        return
    torch.cuda.synchronize()
    res[name] = do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3
    print(f"{name:44s} {res[name]:8.1f} us", flush=True)


def tree() -> tuple:
    """(p, g, m, v, the address table of the four): 90% of g's rows zero, some of them
    -0.0."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows = torch.rand(ROWS, 1, device=DEV, generator=gen) < 0.1
    g = (torch.randn(ROWS, COLS, device=DEV, generator=gen) * rows).to(torch.bfloat16)
    p = torch.randn(N, device=DEV, generator=gen).to(torch.bfloat16)
    m = torch.zeros(N, device=DEV, dtype=torch.bfloat16)
    v = torch.zeros(N, device=DEV, dtype=torch.bfloat16)
    g = g.reshape(-1)
    addr = torch.tensor([t.data_ptr() for t in (p, g, m, v)], dtype=torch.int64, device=DEV)
    return p, g, m, v, addr


def reset(p, m, v, p0) -> None:
    p.copy_(p0)
    m.fill_(0.5)
    v.fill_(0.25)


@triton.jit
def read_floor(g_ptr, out_ptr, n, CH: tl.constexpr):
    offs = tl.program_id(0) * CH + tl.arange(0, CH)
    g = tl.load(g_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum((g != 0.0).to(tl.int32)))


@triton.jit
def ptr(addr_tab, leaf, k: tl.constexpr):
    """The address of tensor ``k`` (p, g, m, v) of ``leaf``."""
    return tl.multiple_of(tl.load(addr_tab + 4 * leaf + k).to(tl.pointer_type(tl.bfloat16)),
                          16)


@triton.jit
def adam(pp, mp, vp, g, mask, lr, MASKED: tl.constexpr):
    """Adam with bf16 states on the elements at ``pp``, ``mp``, ``vp`` (the gradients
    ``g`` loaded), those with a zero gradient kept; loads and stores masked (``MASKED``)."""
    if MASKED:
        p = tl.load(pp, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(mp, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(vp, mask=mask, other=0.0).to(tl.float32)
    else:
        p = tl.load(pp).to(tl.float32)
        m = tl.load(mp).to(tl.float32)
        v = tl.load(vp).to(tl.float32)
    keep = g != 0.0
    m2 = 0.9 * m + 0.1 * g
    v2 = 0.999 * v + 0.001 * g * g
    p2 = p - lr * m2 / (tl.sqrt_rn(v2) + 1e-8)
    if MASKED:
        tl.store(pp, tl.where(keep, p2, p).to(tl.bfloat16), mask=mask)
        tl.store(mp, tl.where(keep, m2, m).to(tl.bfloat16), mask=mask)
        tl.store(vp, tl.where(keep, v2, v).to(tl.bfloat16), mask=mask)
    else:
        tl.store(pp, tl.where(keep, p2, p).to(tl.bfloat16))
        tl.store(mp, tl.where(keep, m2, m).to(tl.bfloat16))
        tl.store(vp, tl.where(keep, v2, v).to(tl.bfloat16))


@triton.jit
def adam_block(addr_tab, leaf, offs, n, lr):
    """One block of ``leaf`` (its gradients again, from the cache)."""
    mask = offs < n
    g = tl.load(ptr(addr_tab, leaf, 1) + offs, mask=mask, other=0.0).to(tl.float32)
    adam(ptr(addr_tab, leaf, 0) + offs, ptr(addr_tab, leaf, 2) + offs,
         ptr(addr_tab, leaf, 3) + offs, g, mask, lr, True)


@triton.jit
def locate(leaf_tab, start_tab, block, BLOCK: tl.constexpr, TABLE: tl.constexpr):
    """(leaf, start) of ``block`` (a number or a tensor of them): from the work table, or
    from the number (the blocks of one leaf in order)."""
    if TABLE:
        return tl.load(leaf_tab + block), tl.load(start_tab + block)
    return block * 0, block * BLOCK


@triton.jit
def spanned(leaf_tab, start_tab, numel_tab, addr_tab, lr, SPAN: tl.constexpr,
            BLOCK: tl.constexpr, TABLE: tl.constexpr):
    leaf, starts = locate(leaf_tab, start_tab, tl.program_id(0) * SPAN + tl.arange(0, SPAN),
                          BLOCK, TABLE)
    n = tl.load(numel_tab + leaf)
    gp = tl.load(addr_tab + 4 * leaf + 1).to(tl.pointer_type(tl.bfloat16))
    offs = starts[:, None] + tl.arange(0, BLOCK)[None, :]
    g = tl.load(gp[:, None] + offs, mask=offs < n[:, None], other=0.0).to(tl.float32)
    if tl.max(tl.max((g != 0.0).to(tl.int32), 1), 0) > 0:
        for sub in range(SPAN):
            lf, st = locate(leaf_tab, start_tab, tl.program_id(0) * SPAN + sub, BLOCK, TABLE)
            nn = tl.load(numel_tab + lf)
            o = st + tl.arange(0, BLOCK)
            gs = tl.load(ptr(addr_tab, lf, 1) + o, mask=o < nn, other=0.0).to(tl.float32)
            if tl.sum((gs != 0.0).to(tl.int32)) > 0:
                adam_block(addr_tab, lf, o, nn, lr)


@triton.jit
def scan(g_ptr, n, list_ptr, counter_ptr, CH: tl.constexpr, BLOCK: tl.constexpr):
    blocks = tl.program_id(0) * CH + tl.arange(0, CH)
    offs = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    g = tl.load(g_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    live = tl.max((g != 0.0).to(tl.int32), 1)
    count = tl.sum(live)
    if count > 0:
        base = tl.atomic_add(counter_ptr, count)
        tl.store(list_ptr + base + tl.cumsum(live, 0) - live, blocks, mask=live > 0)


@triton.jit
def update(list_ptr, counter_ptr, done_ptr, leaf_tab, start_tab, numel_tab, addr_tab, lr,
           NPROG: tl.constexpr, BLOCK: tl.constexpr, TABLE: tl.constexpr):
    total = tl.load(counter_ptr, volatile=True)
    for i in range(tl.program_id(0), total, NPROG):
        lf, st = locate(leaf_tab, start_tab, tl.load(list_ptr + i), BLOCK, TABLE)
        adam_block(addr_tab, lf, st + tl.arange(0, BLOCK), tl.load(numel_tab + lf), lr)
    if tl.atomic_add(done_ptr, 1) == NPROG - 1:  # (every program has read the count)
        tl.store(counter_ptr, 0)
        tl.store(done_ptr, 0)


@triton.jit
def wide(leaf_tab, start_tab, numel_tab, addr_tab, lr, R: tl.constexpr, ROW: tl.constexpr,
         TABLE: tl.constexpr):
    """Rows of ROW lanes, each its own leaf and start (a pointer per row)."""
    leaf, starts = locate(leaf_tab, start_tab, tl.program_id(0) * R + tl.arange(0, R), ROW,
                          TABLE)
    starts = tl.multiple_of(starts, ROW)
    n = tl.load(numel_tab + leaf)
    offs = starts[:, None] + tl.arange(0, ROW)[None, :]
    inr = offs < n[:, None]
    g = tl.load(ptr(addr_tab, leaf, 1)[:, None] + offs, mask=inr, other=0.0).to(tl.float32)
    live = tl.max((g != 0.0).to(tl.int32), 1) > 0
    if tl.max(live.to(tl.int32), 0) > 0:
        adam(ptr(addr_tab, leaf, 0)[:, None] + offs, ptr(addr_tab, leaf, 2)[:, None] + offs,
             ptr(addr_tab, leaf, 3)[:, None] + offs, g, live[:, None] & inr, lr, True)


@triton.jit
def wide_scalar(leaf_tab, start_tab, numel_tab, addr_tab, lr, R: tl.constexpr,
                ROW: tl.constexpr):
    """A program's rows in one leaf: its leaf and start scalars from the table; rows
    masked by their gradients."""
    leaf = tl.load(leaf_tab + tl.program_id(0))
    start = tl.multiple_of(tl.load(start_tab + tl.program_id(0)), R * ROW)
    offs = start + tl.arange(0, R)[:, None] * ROW + tl.arange(0, ROW)[None, :]
    g = tl.load(ptr(addr_tab, leaf, 1) + offs).to(tl.float32)
    live = tl.max((g != 0.0).to(tl.int32), 1) > 0
    if tl.max(live.to(tl.int32), 0) > 0:
        adam(ptr(addr_tab, leaf, 0) + offs, ptr(addr_tab, leaf, 2) + offs,
             ptr(addr_tab, leaf, 3) + offs, g, live[:, None], lr, True)


@triton.jit
def wide_nomask(leaf_tab, start_tab, numel_tab, addr_tab, lr, R: tl.constexpr,
                ROW: tl.constexpr):
    """As wide_scalar, every row of a live program loaded."""
    leaf = tl.load(leaf_tab + tl.program_id(0))
    start = tl.multiple_of(tl.load(start_tab + tl.program_id(0)), R * ROW)
    offs = start + tl.arange(0, R * ROW)
    g = tl.load(ptr(addr_tab, leaf, 1) + offs).to(tl.float32)
    if tl.max((g != 0.0).to(tl.int32), 0) > 0:
        adam(ptr(addr_tab, leaf, 0) + offs, ptr(addr_tab, leaf, 2) + offs,
             ptr(addr_tab, leaf, 3) + offs, g, None, lr, False)


def compact_and_spans(res: dict) -> None:
    p, g, m, v, addr = tree()
    leaf_tab = torch.zeros(NB + 64, dtype=torch.int32, device=DEV)
    start_tab = torch.arange(NB + 64, dtype=torch.int32, device=DEV) * BLOCK
    numel = torch.tensor([N], dtype=torch.int64, device=DEV)
    listed = torch.zeros(NB, dtype=torch.int32, device=DEV)
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    done = torch.zeros(1, dtype=torch.int32, device=DEV)
    out = torch.zeros(N // 1024 + 1, dtype=torch.int32, device=DEV)
    sms = 2 if CPU else torch.cuda.get_device_properties(DEV).multi_processor_count
    print(f"gradients {N * 2 / 1e6:.0f} MB: {N * 2 / 4.1e12 * 1e6:.1f} us at 4.1 TB/s")
    for ch in () if CPU else (4096, 8192, 16384):
        bench(res, f"read floor CH={ch}", lambda ch=ch: read_floor[(-(-N // ch),)](
            g, out, N, CH=ch, num_warps=8))
    for table in () if CPU else (True, False):
        for span in (1, 2, 4, 8):
            bench(res, f"spanned span={span} table={table}",
                  lambda s=span, t=table: spanned[(-(-NB // s),)](
                      leaf_tab, start_tab, numel, addr, LR, SPAN=s, BLOCK=BLOCK, TABLE=t,
                      num_warps=4))
    for ch, w in () if CPU else ((8, 4), (16, 4), (16, 8), (32, 8)):
        bench(res, f"scan CH={ch} w={w} (+reset)", lambda ch=ch, w=w: (
            scan[(-(-NB // ch),)](g, N, listed, counter, CH=ch, BLOCK=BLOCK, num_warps=w),
            counter.zero_()))
    scan[(-(-NB // 16),)](g, N, listed, counter, CH=16, BLOCK=BLOCK, num_warps=4)
    live = int(counter.item())
    counter.zero_()
    blocks = torch.nn.functional.pad(g.float(), (0, NB * BLOCK - N)).view(NB, BLOCK)
    assert live == int((blocks != 0).any(1).sum())
    print(f"live blocks {live} of {NB}")

    def both(programs: int, table: bool) -> None:
        scan[(-(-NB // 16),)](g, N, listed, counter, CH=16, BLOCK=BLOCK, num_warps=4)
        update[(programs,)](listed, counter, done, leaf_tab, start_tab, numel, addr, LR,
                            NPROG=programs, BLOCK=BLOCK, TABLE=table, num_warps=4)

    for table in () if CPU else (True, False):
        for k in (4, 8, 16):
            bench(res, f"scan16+update P={k}xSM table={table}",
                  lambda k=k, t=table: both(sms * k, t))
    # the same bytes both ways, the zero gradients' elements kept (and the others not)
    p0 = torch.randn(N, device=DEV).to(torch.bfloat16)
    outs = []
    for way in range(2):
        reset(p, m, v, p0)
        if way == 0:
            spanned[(-(-NB // 4),)](leaf_tab, start_tab, numel, addr, LR, SPAN=4, BLOCK=BLOCK,
                                    TABLE=True, num_warps=4)
        else:
            both(sms * 8, True)
        outs.append((p.clone(), m.clone(), v.clone()))
    assert counter.item() == 0 and done.item() == 0
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert torch.equal(outs[0][0][g == 0], p0[g == 0]) and not torch.equal(outs[0][0], p0)
    print("scan + update == spanned: ok")


def wide_tiles(res: dict) -> None:
    p, g, m, v, addr = tree()
    numel = torch.tensor([N], dtype=torch.int64, device=DEV)

    def tables(rows: int, step: int) -> tuple:
        return (torch.zeros(rows, dtype=torch.int32, device=DEV),
                torch.arange(rows, dtype=torch.int32, device=DEV) * step)

    for row, r, w in () if CPU else ((128, 8, 4), (128, 16, 4), (128, 32, 4), (128, 32, 8),
                                     (128, 64, 8), (512, 4, 4), (512, 8, 8), (256, 8, 4),
                                     (256, 16, 8)):
        lt, st = tables(-(-N // row) + 4096, row)
        for table in (True, False):
            bench(res, f"wide row={row} R={r} w={w} table={table}",
                  lambda lt=lt, st=st, row=row, r=r, w=w, t=table: wide[(-(-N // (row * r)),)](
                      lt, st, numel, addr, LR, R=r, ROW=row, TABLE=t, num_warps=w))
    for row, r, w in () if CPU else ((128, 4, 4), (128, 8, 4), (128, 16, 4), (128, 16, 8),
                                     (128, 32, 8), (512, 2, 4), (512, 4, 4), (512, 4, 8),
                                     (512, 8, 8), (256, 4, 4), (256, 8, 8)):
        programs = N // (row * r)  # (the leaf's last partial tile left out: timing only)
        lt, st = tables(programs, row * r)
        for name, kernel in (("wide_scalar", wide_scalar), ("wide_nomask", wide_nomask)):
            bench(res, f"{name} row={row} R={r} w={w}",
                  lambda k=kernel, lt=lt, st=st, row=row, r=r, w=w, n=programs: k[(n,)](
                      lt, st, numel, addr, LR, R=r, ROW=row, num_warps=w))
    # wide (tables) against torch, one step: within a bf16 rounding (the interpreter
    # rounds toward zero), zero gradients' elements kept
    p0 = torch.randn(N, device=DEV).to(torch.bfloat16)
    reset(p, m, v, p0)
    lt, st = tables(-(-N // 128) + 8, 128)
    wide[(-(-N // 1024),)](lt, st, numel, addr, LR, R=8, ROW=128, TABLE=True, num_warps=4)
    gf = g.float()
    m2 = 0.9 * 0.5 + 0.1 * gf
    v2 = 0.999 * 0.25 + 0.001 * gf * gf
    keep = gf != 0
    ref = torch.where(keep, (p0.float() - LR * m2 / (v2.sqrt() + 1e-8)).to(torch.bfloat16), p0)
    assert torch.equal(p[~keep], p0[~keep]) and bool((m[~keep] == 0.5).all())
    assert bool(((p.float() - ref.float()).abs() <= 2**-6 * ref.float().abs() + 1e-6).all())
    assert bool(((m.float() - m2)[keep].abs() <= 2**-7 * m2[keep].abs()).all())
    first = p.clone(), m.clone(), v.clone()
    programs = N // 1024
    for kernel in (wide_scalar, wide_nomask):
        reset(p, m, v, p0)
        kernel[(programs,)](*tables(programs, 1024), numel, addr, LR, R=8, ROW=128,
                            num_warps=4)
        assert all(torch.equal(a[:programs * 1024], b[:programs * 1024])
                   for a, b in zip(first, (p, m, v)))
    print("wide, wide_scalar, wide_nomask: ok", flush=True)


def main() -> None:
    res: dict = {}
    compact_and_spans(res)
    wide_tiles(res)
    if not CPU:
        out = pathlib.Path(sys.argv[1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "zero_stretch.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
