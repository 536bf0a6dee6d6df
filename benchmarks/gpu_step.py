"""GPU benchmark of ``ftopt.step`` (fused Triton kernels) against other optimizer steps.

Everything is measured in ONE run, so that ratios are same-run (absolute times drift by
10-15% between runs on the H200):

1. ``copy``: device copy bandwidth, ``dst.copy_(src)`` of a 2 GiB fp32 buffer
   (read + write bytes / time); every "of copy" column is relative to it.
2. ``single``: one 64M-element fp32 tensor, Adam (lr 1e-3, no weight decay): ftopt fused,
   torch.optim.Adam fused / foreach / torch.compile'd, bitsandbytes' Triton 32-bit
   kernel called directly, bitsandbytes' CUDA ``bnb.optim.Adam``, torch-optimi's Triton
   AdamW, flashoptim's fused FlashAdam (fp32 states).
3. ``gpt2_fp32``: GPT-2-small shapes (148 leaves, 124M params), fp32, the same peers.
4. ``gpt2_bf16``: the same tree with bf16 params and grads (ftopt and bitsandbytes keep
   fp32 states, torch / optimi / flashoptim keep bf16 states).
5. ``skip_zeros``: ftopt Adam with and without ``skip_zeros`` on (a) dense grads
   (the cost of the flag) and (b) grads whose embedding (wte) has 90% all-zero rows.
6. ``host``: host time of one ``ftopt.step`` call on the 148-leaf tree (sync, then
   ``perf_counter`` around the call: launches are asynchronous), vs torch fused/foreach.
8. ``layouts``: skip_zeros on every layout (fp32; bf16 params with fp32 or bf16 states;
   8-bit states), GPT-2 tree, dense grads and 90% all-zero embedding rows; bf16 states
   also against torch's fused Adam.
7. ``eight_bit``: 8-bit states: bitsandbytes ``Adam8bit`` (CUDA) and its Triton 8-bit
   kernel called directly, flashoptim (int8 states), ftopt ``adam(state_bits=8)`` with
   ``backend="auto"`` (which backend ran is recorded, with ``ftopt.explain``).

Timing: every variant gets its own params and state and is stepped like in training
(the outputs of one step are the inputs of the next; grads are shared and read-only).
After warm-up, ``--iters`` steps per variant are timed with a pair of CUDA events around
each step, in ``--rounds`` interleaved rounds (every variant runs a chunk of steps in
turn, so drift of the machine hits all alike); the tables show the median. "wall" is
``perf_counter`` over ``--iters`` back-to-back steps with one synchronize at the end;
"call" is the median of single calls timed whole (synchronize, ``perf_counter`` around
the call and a synchronize: host work and GPU time, as a caller waiting on the step sees
it); "call vs ftopt" compares those.
Effective bandwidth counts the nominal bytes of each variant (28 B/element for fp32 Adam:
read g, p, m, v; write p, m, v; 22 with bf16 p/g and fp32 states; 14 all-bf16; about
16.06 with 8-bit blockwise states); "vs ftopt" is the variant's time over ftopt's
(> 1: ftopt is faster). Before timing, each ftopt variant runs one step fused and one
``backend="eager"`` from the same inputs and prints the max relative error (max |a-b| /
max |b| per leaf, worst leaf).

Every peer is optional: a peer whose import or first step fails is recorded with the
exception text (see the "unavailable" lists in the outputs).

On the GPU machine, from the repo root (see /work/shared/gpu/README.md):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit;
    python3 benchmarks/gpu_step.py --out $OUT            # about 2.5 min on an H200
    python3 benchmarks/gpu_step.py --quick --out $OUT    # about 1 min

Most of the time is torch.compile of the two GPT-2 trees (~35 s each; --quick skips
them). ``--sections single,gpt2_fp32`` runs a subset; ``--tiles 512x4,1024x8`` adds ftopt
variants with other ``ftopt.lowering.tiles`` tiles, timed in the same run (see
``parse_tiles``; the environment variables FTOPT_BLOCK / FTOPT_NUM_WARPS /
FTOPT_IN_PLACE_TILE change ftopt's default instead).

Check on a CPU (Triton interpreter, tiny sizes; CUDA-only peers are recorded as
unavailable):

    TRITON_INTERPRET=1 .venv/bin/python benchmarks/gpu_step.py --smoke --out /tmp/bench_smoke
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import io
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

if "--smoke" in sys.argv:  # must precede the first import of triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ftopt  # noqa: E402
from ftopt import tree as tree_lib  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from timing import Clock, donated_step_ms  # noqa: E402

LR, B1, B2, EPS = 1e-3, 0.9, 0.999, 1e-8
MIN_8BIT = 4096  # bitsandbytes' and ftopt's default: smaller leaves keep fp32 states
QBLOCK = 256  # bitsandbytes' and ftopt's 8-bit block


# --------------------------------------------------------------------------- config


@dataclass
class Config:
    device: torch.device
    smoke: bool
    quick: bool
    iters: int
    warmup: int
    rounds: int
    copy_numel: int
    single_numel: int
    tree_dims: dict
    compile_single: bool
    compile_trees: bool
    tiles: list
    sections: list
    sparse_rows: float = 0.9
    copy_tbps: float | None = None


class Skip(Exception):
    """A peer deliberately not run (recorded with its reason)."""


# --------------------------------------------------------------------------- timing


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


# --------------------------------------------------------------------------- trees


def gpt2_shapes(vocab: int, d: int, ctx: int, n_layer: int) -> dict[str, tuple]:
    """GPT-2's parameter names and shapes (HF ``GPT2LMHeadModel``, tied head)."""
    shapes = {"transformer.wte.weight": (vocab, d), "transformer.wpe.weight": (ctx, d)}
    for i in range(n_layer):
        h = f"transformer.h.{i}."
        shapes.update({
            h + "ln_1.weight": (d,), h + "ln_1.bias": (d,),
            h + "attn.c_attn.weight": (d, 3 * d), h + "attn.c_attn.bias": (3 * d,),
            h + "attn.c_proj.weight": (d, d), h + "attn.c_proj.bias": (d,),
            h + "ln_2.weight": (d,), h + "ln_2.bias": (d,),
            h + "mlp.c_fc.weight": (d, 4 * d), h + "mlp.c_fc.bias": (4 * d,),
            h + "mlp.c_proj.weight": (4 * d, d), h + "mlp.c_proj.bias": (d,),
        })
    shapes.update({"transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,)})
    return shapes


def random_tree(shapes: dict, dtype, device, seed: int, scale: float) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)
    return {k: (torch.randn(s, generator=gen, device=device) * scale).to(dtype)
            for k, s in shapes.items()}


def numel_of(tree: dict) -> int:
    return sum(t.numel() for t in tree.values())


def clone_tree(tree: dict) -> dict:
    return {k: v.detach().clone() for k, v in tree.items()}


def adam_bytes(params: dict, grads: dict, state_bytes: Callable[[int, torch.dtype], float]):
    """Nominal bytes of one Adam step: read g, p, m, v; write p, m, v."""
    total = 0.0
    for k, p in params.items():
        n, pb, gb = p.numel(), p.element_size(), grads[k].element_size()
        total += n * (gb + 2 * pb + 4 * state_bytes(n, p.dtype))
    return total


def fp32_states(n, dtype):
    return 4.0


def param_dtype_states(n, dtype):
    return float(torch.empty((), dtype=dtype).element_size())


def bnb_8bit_states(n, dtype):
    return 1.0 + 4.0 / QBLOCK if n >= MIN_8BIT else 4.0


def flash_8bit_states(n, dtype):
    return 1.0 + 2.0 / 32  # int8 + one fp16 scale per 32 elements


# --------------------------------------------------------------------------- runners


@dataclass
class Runner:
    name: str
    step: Callable[[], None]
    bytes_per_step: float
    numel: int
    note: str = ""
    info: dict = field(default_factory=dict)
    keep: list = field(default_factory=list)  # objects to keep alive until the table ends
    enter: Callable | None = None  # called before each chunk of steps (not timed)
    exit: Callable | None = None  # called after each chunk


def _params_for_optim(params: dict, grads: dict) -> list:
    ps = []
    for k, p in params.items():
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = grads[k]
        ps.append(q)
    return ps


def _explain(tx, params, grads, backend: str) -> str:
    fn = getattr(ftopt, "explain", None)
    if fn is None:
        return "ftopt.explain does not exist in this version"
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            try:
                text = fn(tx, params, grads, backend=backend, file=buf)
            except TypeError:
                text = fn(tx, params)
    except Exception as e:  # noqa: BLE001 - recorded, not hidden
        return f"ftopt.explain raised {type(e).__name__}: {e}"
    return text if isinstance(text, str) and text else buf.getvalue()


def _max_rel(xs, ys) -> tuple[float, float]:
    """(max over leaves of max|a-b| / max|b|, max |a-b|)."""
    rel, absolute = 0.0, 0.0
    for x, y in zip(xs, ys):
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            continue
        if x.numel() == 0:
            continue
        x, y = x.detach().float(), y.detach().float()
        err = (x - y).abs().max().item()
        den = y.abs().max().item()
        absolute = max(absolute, err)
        rel = max(rel, err / den if den > 0 else err)
    return rel, absolute


def check_vs_eager(tx, params, grads, state, backend: str) -> dict:
    """One step ``backend`` vs ``backend="eager"`` from the same inputs (nothing donated)."""
    p_a, s_a = ftopt.step(tx, params, grads, state, donate=False, backend=backend)
    p_b, s_b = ftopt.step(tx, params, grads, state, donate=False, backend="eager")
    prel, pabs = _max_rel(tree_lib.leaves(p_a), tree_lib.leaves(p_b))
    differ = sum(int((p_a[k] != p_b[k]).sum()) for k in params)
    srel, sabs = _max_rel(tree_lib.leaves(s_a), tree_lib.leaves(s_b))
    upd = []
    for k in params:
        upd.append(((p_a[k].float() - params[k].float()), (p_b[k].float() - params[k].float())))
    urel, _ = _max_rel([a for a, _ in upd], [b for _, b in upd])
    del p_a, s_a, p_b, s_b, upd
    # fp32: a few ulps; 16-bit params: one rounding of the result may differ (1 ulp)
    low = any(p.element_size() < 4 for p in params.values())
    ok = prel <= (1e-2 if low else 1e-5) and srel <= 1e-4
    return {"backend": backend, "ok": ok, "param_rel_err": prel, "param_abs_err": pabs,
            "state_rel_err": srel, "state_abs_err": sabs, "update_rel_err": urel,
            "param_elements_differing": differ / max(1, numel_of(params))}


def backend_that_runs(tx, params, grads, state) -> str:
    """'fused', or 'eager (reason)': what ``backend="auto"`` does for this call."""
    try:
        out = ftopt.step(tx, params, grads, state, donate=False, backend="fused")
        del out
        return "fused"
    except RuntimeError as e:
        return f"eager ({e})"


def _clear_lowering_caches() -> None:
    """Clears every functools cache of ftopt.lowering (work tables, constants, kernels)."""
    for name, mod in list(sys.modules.items()):
        if not name.startswith("ftopt.lowering") or mod is None:
            continue
        for value in list(vars(mod).values()):
            if type(value).__name__ == "_lru_cache_wrapper":
                value.cache_clear()


def tile_hooks(tile) -> tuple[Callable, Callable]:
    """(enter, exit): set ftopt.lowering.tiles' tiles (BLOCK/NUM_WARPS, the in-place
    skip_zeros tile, whether one-leaf groups get their own kernel) to ``tile`` and back.

    The lowering caches tables and constants built with them, so both clear those
    caches; the harness calls them around chunks of steps (never inside a timed step)
    and runs one untimed step after ``enter``.
    """
    from ftopt.lowering import tiles as launch

    names = ("BLOCK", "NUM_WARPS", "IN_PLACE_TILE", "QUANT_TILE")
    if not all(hasattr(launch, n) for n in names):
        raise RuntimeError(f"ftopt.lowering.tiles lacks one of {names} to override")
    saved = []

    def enter():
        saved.append(tuple(getattr(launch, n) for n in names)
                     + (getattr(launch, "IN_PLACE_TILES", None),))
        block, warps, ip_block, ip_warps, q_block, q_warps = tile
        launch.BLOCK, launch.NUM_WARPS = block, warps
        launch.IN_PLACE_TILE, launch.QUANT_TILE = (ip_block, ip_warps), (q_block, q_warps)
        launch.IN_PLACE_TILES = {}  # (the tile asked for, on every layout)
        _clear_lowering_caches()

    def exit_():
        *values, per_layout = saved.pop()
        for n, v in zip(names, values):
            setattr(launch, n, v)
        if per_layout is not None:
            launch.IN_PLACE_TILES = per_layout
        _clear_lowering_caches()

    return enter, exit_


def ftopt_tile_now() -> tuple | None:
    try:
        from ftopt.lowering import tiles as launch

        return (launch.BLOCK, launch.NUM_WARPS, *launch.IN_PLACE_TILE, *launch.QUANT_TILE)
    except Exception:  # noqa: BLE001
        return None


def _tile_note(tile) -> str:
    block, warps, ip_block, ip_warps, q_block, q_warps = tile
    note = f"BLOCK={block}, warps={warps}"
    if (ip_block, ip_warps) != (block, warps):
        note += f"; in place {ip_block}/{ip_warps}"
    if (q_block, q_warps) != (block, warps):
        note += f"; 8-bit {q_block}/{q_warps}"
    return note


def make_ftopt(tx, params: dict, grads: dict, *, backend: str = "fused", tile=None,
               state_bytes=fp32_states, check_backend: str | None = None,
               record_backend: bool = False) -> Runner:
    p = clone_tree(params)
    state = tx.init(p)
    box = [p, state]

    def step():
        box[0], box[1] = ftopt.step(tx, box[0], grads, box[1], donate=True, backend=backend)

    enter, exit_ = tile_hooks(tile) if tile is not None else (None, None)
    info = {}
    if enter:
        enter()
    try:
        t0 = time.perf_counter()
        step()  # compiles the kernels; raises if backend="fused" cannot fuse
        info["first_step_s"] = time.perf_counter() - t0
        info["explain"] = _explain(tx, box[0], grads, backend)
        if record_backend:
            info["backend_ran"] = backend_that_runs(tx, box[0], grads, box[1])
        # after one step, so the states are not all zero
        info["check"] = check_vs_eager(tx, box[0], grads, box[1], check_backend or backend)
    finally:
        if exit_:
            exit_()
    c = info["check"]
    print(f"    check {c['backend']} vs eager: param rel err {c['param_rel_err']:.2e}, "
          f"state rel err {c['state_rel_err']:.2e}, update rel err {c['update_rel_err']:.2e}, "
          f"fraction of param elements differing {c['param_elements_differing']:.2e}"
          + ("" if c["ok"] else "  <-- CHECK FAILED"))
    if "backend_ran" in info:
        print(f"    backend='{backend}' ran: {info['backend_ran']}")
    tile_now = tile or ftopt_tile_now()
    note = _tile_note(tile_now) if tile_now else ""
    if info.get("backend_ran", "fused") != "fused":
        note = "ran eagerly (see the correctness lines)"
    if not c["ok"]:
        note += "; CHECK vs eager FAILED"
    return Runner("", step, adam_bytes(params, grads, state_bytes), numel_of(params), note,
                  info, keep=[box], enter=enter, exit=exit_)


def make_ftopt_update(tx, params: dict, grads: dict) -> Runner:
    """``tx.update`` (fused where it can be): reads g, m, v; writes new u, m, v tensors."""
    p = clone_tree(params)
    box = [tx.init(p)]

    def step():
        _, box[0] = tx.update(grads, box[0], p)

    step()
    n = numel_of(params)
    nbytes = sum(g.element_size() * g.numel() for g in grads.values()) + n * (4 + 16)
    return Runner("", step, nbytes, n, "tx.update, backend auto", keep=[p, box])


def _compiled_adam(params, grads, lr_device, cfg: Config):
    ps = _params_for_optim(params, grads)
    # lr as a tensor: a changing lr does not recompile (PyTorch's compiled-optimizer
    # recipe); dynamo turns on capturable for CUDA params.
    lr = torch.tensor(LR, device=lr_device)
    opt = torch.optim.Adam(ps, lr=lr, betas=(B1, B2), eps=EPS)

    @torch.compile(fullgraph=False)
    def compiled_step():
        opt.step()

    t0 = time.perf_counter()
    for _ in range(3):  # compiles (and recompiles once the state exists)
        compiled_step()
    Clock(cfg.device).sync()
    return opt, ps, compiled_step, time.perf_counter() - t0


def make_torch(params, grads, *, mode: str, cfg: Config) -> Runner:
    if mode == "compiled_skip":
        raise Skip("torch.compile peer skipped (--quick, --compile off, or not CUDA)")
    if mode == "compiled":
        for name, value in (("cache_size_limit", 64), ("recompile_limit", 64)):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, value)
        try:
            opt, ps, step, secs = _compiled_adam(params, grads, "cpu", cfg)
            note = "torch.compile(opt.step), lr = CPU tensor"
        except Exception as e:  # noqa: BLE001 - retry with the lr on the device
            first = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            _reset_dynamo()
            opt, ps, step, secs = _compiled_adam(params, grads, cfg.device, cfg)
            note = f"torch.compile(opt.step), lr = device tensor (CPU lr failed: {first})"
        note += f"; compile + 3 steps {secs:.1f} s"
    else:
        ps = _params_for_optim(params, grads)
        flag = {"fused": {"fused": True}, "foreach": {"foreach": True}}[mode]
        opt = torch.optim.Adam(ps, lr=LR, betas=(B1, B2), eps=EPS, **flag)
        step = opt.step
        note = f"{mode}=True"
    step()
    return Runner("", step, adam_bytes(params, grads, param_dtype_states), numel_of(params),
                  note, keep=[opt, ps])


def _needs_cuda(cfg: Config, what: str):
    if cfg.device.type != "cuda":
        raise Skip(f"{what} needs a CUDA device (device is {cfg.device})")


def bnb_info() -> dict:
    import bitsandbytes as bnb

    info = {"version": getattr(bnb, "__version__", "?")}
    try:
        ce = bnb.cextension
        lib = ce.lib
        info["backend"] = getattr(ce, "BNB_BACKEND", "?")
        info["native_library"] = type(lib).__name__
        info["native_library_path"] = getattr(getattr(lib, "_lib", None), "_name", None)
    except Exception as e:  # noqa: BLE001
        info["error"] = f"{type(e).__name__}: {e}"
    return info


def make_bnb_cuda(params, grads, *, bits: int, cfg: Config) -> Runner:
    _needs_cuda(cfg, "bitsandbytes' CUDA optimizer")
    import bitsandbytes as bnb

    ps = _params_for_optim(params, grads)
    if bits == 32:
        opt = bnb.optim.Adam(ps, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=0.0,
                             optim_bits=32)
        sb = fp32_states
    else:
        opt = bnb.optim.Adam8bit(ps, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=0.0,
                                 min_8bit_size=MIN_8BIT)
        sb = bnb_8bit_states
    opt.step()
    info = bnb_info()
    note = (f"bnb.optim.{type(opt).__name__}, one launch + torch.cuda.synchronize per tensor; "
            f"lib {info.get('native_library')}")
    return Runner("", opt.step, adam_bytes(params, grads, sb), numel_of(params), note, info,
                  keep=[opt, ps])


def make_bnb_triton(params, grads, *, bits: int, cfg: Config) -> Runner:
    """bitsandbytes' Triton kernels (its XPU path), called directly, one launch per tensor."""
    from bitsandbytes.backends.triton import kernels_optim as ko

    dev = cfg.device
    upd32 = ko.optimizer_update_32bit_impl
    upd8 = ko.optimizer_update_8bit_blockwise_impl
    q1 = q2 = None
    if bits == 8:
        import bitsandbytes.functional as F

        q1 = F.create_dynamic_map(signed=True).to(dev)
        q2 = F.create_dynamic_map(signed=False).to(dev)
    leaves = []
    for k, p in params.items():
        p = p.detach().clone()
        n = p.numel()
        if bits == 8 and n >= MIN_8BIT:
            nb = -(-n // QBLOCK)
            leaves.append((8, p, grads[k], torch.zeros_like(p, dtype=torch.uint8),
                           torch.zeros_like(p, dtype=torch.uint8),
                           torch.zeros(nb, dtype=torch.float32, device=dev),
                           torch.zeros(nb, dtype=torch.float32, device=dev)))
        else:
            leaves.append((32, p, grads[k], torch.zeros_like(p, dtype=torch.float32),
                           torch.zeros_like(p, dtype=torch.float32), None, None))
    count = [0]

    def step():
        count[0] += 1
        t = count[0]
        for bits_, p, g, s1, s2, a1, a2 in leaves:
            if bits_ == 32:
                upd32(optimizer_name="adam", g=g, p=p, state1=s1, state2=s2, unorm_vec=None,
                      max_unorm=0.0, param_norm=0.0, beta1=B1, beta2=B2, beta3=0.0,
                      alpha=0.0, eps=EPS, weight_decay=0.0, step=t, lr=LR, gnorm_scale=1.0)
            else:
                upd8(optimizer_name="adam", g=g, p=p, state1=s1, state2=s2, beta1=B1,
                     beta2=B2, beta3=0.0, alpha=0.0, eps=EPS, step=t, lr=LR, qmap1=q1,
                     qmap2=q2, absmax1=a1, absmax2=a2, weight_decay=0.0, gnorm_scale=1.0)

    step()
    fn = "optimizer_update_32bit_impl" + (" / optimizer_update_8bit_blockwise_impl"
                                           if bits == 8 else "")
    note = f"bitsandbytes.backends.triton.kernels_optim.{fn}, BLOCK 256, 2 warps, per tensor"
    sb = bnb_8bit_states if bits == 8 else fp32_states
    return Runner("", step, adam_bytes(params, grads, sb), numel_of(params), note,
                  keep=[leaves])


def make_optimi(params, grads, *, cfg: Config) -> Runner:
    import optimi

    ps = _params_for_optim(params, grads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = optimi.AdamW(ps, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=0.0,
                           kahan_sum=False, triton=True)
        opt.step()
    note = "optimi.AdamW(triton=True, weight_decay=0, kahan_sum=False), per tensor; " \
           "states in param dtype"
    return Runner("", opt.step, adam_bytes(params, grads, param_dtype_states),
                  numel_of(params), note, {"version": optimi.__version__}, keep=[opt, ps])


def make_flash(params, grads, *, quantize: bool, cfg: Config) -> Runner:
    _needs_cuda(cfg, "flashoptim's fused/quantized step")
    import flashoptim

    ps = _params_for_optim(params, grads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # master_weight_bits=None with bf16 params warns
        opt = flashoptim.FlashAdam(ps, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=0.0,
                                   quantize=quantize, master_weight_bits=None, fused=True,
                                   check_numerics=False)
        opt.step()
    note = f"flashoptim.FlashAdam(quantize={quantize}, master_weight_bits=None), per tensor"
    sb = flash_8bit_states if quantize else param_dtype_states
    return Runner("", opt.step, adam_bytes(params, grads, sb), numel_of(params), note,
                  {"version": flashoptim.__version__}, keep=[opt, ps])


# --------------------------------------------------------------------------- tables


def _free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build(name: str, factory: Callable[[], Runner]) -> tuple[Runner | None, dict | None]:
    print(f"  setting up {name} ...", flush=True)
    try:
        r = factory()
    except Skip as e:
        print(f"    skipped: {e}")
        return None, {"name": name, "available": False, "reason": f"skipped: {e}"}
    except Exception as e:  # noqa: BLE001 - every peer is optional; the reason is recorded
        reason = f"{type(e).__name__}: {e}".strip()
        print(f"    unavailable: {reason.splitlines()[0][:300]}")
        return None, {"name": name, "available": False, "reason": reason[:4000],
                      "traceback": traceback.format_exc()[-4000:]}
    r.name = name
    return r, None


def _chunk(r: Runner, fn: Callable):
    """Runs ``fn`` (a chunk of steps of ``r``) after ``r.enter`` and one untimed step."""
    if r.enter:
        r.enter()
    try:
        r.step()
        return fn()
    finally:
        if r.exit:
            r.exit()


def measure_table(title: str, specs: list, cfg: Config, clk: Clock, ref: str | None) -> dict:
    """Builds each (name, factory), warms up, times in interleaved rounds; one table."""
    print(f"\n== {title}", flush=True)
    runners, rows = [], {}
    order = [name for name, _ in specs]
    for name, factory in specs:
        r, failed = build(name, factory)
        if r is None:
            rows[name] = failed
            _free()
            continue
        try:
            _chunk(r, lambda r=r: [r.step() for _ in range(cfg.warmup)])
            clk.sync()
        except Exception as e:  # noqa: BLE001
            rows[name] = {"name": name, "available": False,
                          "reason": f"warm-up failed: {type(e).__name__}: {e}"[:4000],
                          "traceback": traceback.format_exc()[-4000:]}
            print(f"    warm-up failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        runners.append(r)
    times = {r.name: [] for r in runners}
    per_round = max(1, math.ceil(cfg.iters / cfg.rounds))
    dead: dict[str, str] = {}
    for _ in range(cfg.rounds):
        for r in runners:
            if r.name in dead:
                continue
            try:
                times[r.name] += _chunk(r, lambda r=r: clk.time_steps(r.step, per_round))
            except Exception as e:  # noqa: BLE001
                dead[r.name] = f"timing failed: {type(e).__name__}: {e}"
    walls, calls = {}, {}
    for r in runners:
        if r.name in dead:
            continue
        try:
            walls[r.name] = _chunk(r, lambda r=r: clk.wall(r.step, cfg.iters))
            calls[r.name] = statistics.median(_chunk(r, lambda r=r: clk.call(r.step,
                                                                             cfg.iters)))
        except Exception as e:  # noqa: BLE001
            dead[r.name] = f"wall timing failed: {type(e).__name__}: {e}"
    for r in runners:
        if r.name in dead:
            rows[r.name] = {"name": r.name, "available": False, "reason": dead[r.name][:4000]}
            continue
        ts = times[r.name]
        ms = statistics.median(ts)
        tbps = r.bytes_per_step / (ms * 1e-3) / 1e12
        rows[r.name] = {
            "name": r.name, "available": True, "ms": ms, "ms_min": min(ts),
            "ms_p10": _pct(ts, 0.1), "ms_p90": _pct(ts, 0.9), "ms_wall": walls[r.name],
            "ms_call": calls[r.name],
            "n_timed": len(ts), "numel": r.numel,
            "bytes_per_elem": r.bytes_per_step / r.numel, "tbps": tbps,
            "of_copy": tbps / cfg.copy_tbps if cfg.copy_tbps else None,
            "note": r.note, "info": r.info,
        }
    ref_ms = rows.get(ref, {}).get("ms") if ref else None
    ref_call = rows.get(ref, {}).get("ms_call") if ref else None
    for row in rows.values():
        if row.get("available") and ref_ms:
            row["vs_ftopt"] = row["ms"] / ref_ms
            row["call_vs_ftopt"] = row["ms_call"] / ref_call
    del runners
    _free()
    table = {"title": title, "reference": ref, "rows": [rows[n] for n in order]}
    print(format_table(table))
    return table


def format_table(table: dict) -> str:
    head = ["variant", "ms (events)", "ms (wall)", "ms (call)", "B/elem", "TB/s", "of copy",
            "vs ftopt", "call vs ftopt"]
    lines = []
    for row in table["rows"]:
        if not row.get("available"):
            continue
        lines.append([
            row["name"], f"{row['ms']:.3f}", f"{row['ms_wall']:.3f}", f"{row['ms_call']:.3f}",
            f"{row['bytes_per_elem']:.2f}", f"{row['tbps']:.2f}",
            f"{row['of_copy']:.2f}" if row.get("of_copy") else "-",
            f"{row['vs_ftopt']:.2f}x" if row.get("vs_ftopt") else "-",
            f"{row['call_vs_ftopt']:.2f}x" if row.get("call_vs_ftopt") else "-",
        ])
    widths = [max(len(h), *(len(x[i]) for x in lines)) if lines else len(h)
              for i, h in enumerate(head)]
    out = ["  " + "  ".join(h.ljust(w) for h, w in zip(head, widths))]
    for x in lines:
        out.append("  " + "  ".join(c.ljust(w) for c, w in zip(x, widths)))
    for row in table["rows"]:
        if not row.get("available"):
            out.append(f"  - {row['name']}: unavailable: {row['reason'].splitlines()[0][:200]}")
    return "\n".join(out)


# --------------------------------------------------------------------------- sections


def section_copy(cfg: Config, clk: Clock) -> dict:
    print("\n== 1. device copy bandwidth", flush=True)
    n = cfg.copy_numel
    src = torch.empty(n, dtype=torch.float32, device=cfg.device).uniform_()
    dst = torch.empty_like(src)
    fn = lambda: dst.copy_(src)
    for _ in range(max(3, cfg.warmup)):
        fn()
    ts = clk.time_steps(fn, cfg.iters)
    wall = clk.wall(fn, cfg.iters)
    ms = statistics.median(ts)
    nbytes = 2 * n * 4
    tbps = nbytes / (ms * 1e-3) / 1e12
    cfg.copy_tbps = tbps
    print(f"  copy_ of {n * 4 / 2**30:.3f} GiB fp32: {ms:.3f} ms -> {tbps:.3f} TB/s "
          f"(read+write); wall {wall:.3f} ms")
    return {"title": "1. device copy bandwidth (dst.copy_(src), fp32)", "numel": n,
            "gib": n * 4 / 2**30, "ms": ms, "ms_min": min(ts), "ms_wall": wall,
            "bytes": nbytes, "tbps": tbps}


def _tile_label(tile) -> str:
    return f"ftopt fused [{_tile_note(tile)}]"


def ftopt_specs(tx_fn, params, grads, cfg: Config, label="ftopt fused", **kw) -> list:
    specs = [(label, lambda: make_ftopt(tx_fn(), params, grads, **kw))]
    for tile in cfg.tiles:
        specs.append((_tile_label(tile) + label[len("ftopt fused"):],
                      lambda tile=tile: make_ftopt(tx_fn(), params, grads, tile=tile, **kw)))
    return specs


def peer_specs(params, grads, cfg: Config, compile_ok: bool, bf16: bool = False) -> list:
    cmode = "compiled" if compile_ok else "compiled_skip"
    fused_name = "torch Adam fused" + (" (bf16 states)" if bf16 else "")
    foreach_name = "torch Adam foreach" + (" (bf16 states)" if bf16 else "")
    comp_name = "torch Adam compiled" + (" (bf16 states)" if bf16 else "")
    return [
        (fused_name, lambda: make_torch(params, grads, mode="fused", cfg=cfg)),
        (foreach_name, lambda: make_torch(params, grads, mode="foreach", cfg=cfg)),
        (comp_name, lambda: make_torch(params, grads, mode=cmode, cfg=cfg)),
        ("bnb Triton 32-bit (direct)",
         lambda: make_bnb_triton(params, grads, bits=32, cfg=cfg)),
        ("bnb CUDA Adam 32-bit", lambda: make_bnb_cuda(params, grads, bits=32, cfg=cfg)),
        ("optimi AdamW triton" + (" (bf16 states)" if bf16 else ""),
         lambda: make_optimi(params, grads, cfg=cfg)),
        ("flashoptim FlashAdam" + (" (bf16 states)" if bf16 else " (fp32 states)"),
         lambda: make_flash(params, grads, quantize=False, cfg=cfg)),
    ]


def _one_tensor(cfg: Config, seed: int) -> tuple[dict, dict]:
    """(params, grads) of one ``cfg.single_numel``-element fp32 leaf."""
    gen = torch.Generator(device=cfg.device).manual_seed(seed)
    params = {"w": torch.randn(cfg.single_numel, generator=gen, device=cfg.device) * 0.02}
    grads = {"w": torch.randn(cfg.single_numel, generator=gen, device=cfg.device) * 0.01}
    return params, grads


def section_single(cfg: Config, clk: Clock) -> dict:
    n = cfg.single_numel
    params, grads = _one_tensor(cfg, 0)
    specs = ftopt_specs(lambda: ftopt.adam(LR), params, grads, cfg)
    specs += peer_specs(params, grads, cfg, cfg.compile_single)
    title = f"2. one {n / 2**20:.0f}M-element fp32 tensor, Adam"
    table = measure_table(title, specs, cfg, clk, "ftopt fused")
    del params, grads
    _reset_dynamo()
    return table


def _tree(cfg: Config, dtype, seed=1):
    shapes = gpt2_shapes(**cfg.tree_dims)
    assert len(shapes) == 12 * cfg.tree_dims["n_layer"] + 4, len(shapes)  # 148 for GPT-2
    params = random_tree(shapes, dtype, cfg.device, seed, 0.02)
    grads = random_tree(shapes, dtype, cfg.device, seed + 1, 0.01)
    return params, grads


def section_tree(cfg: Config, clk: Clock, dtype) -> dict:
    params, grads = _tree(cfg, dtype)
    bf16 = dtype == torch.bfloat16
    specs = ftopt_specs(lambda: ftopt.adam(LR), params, grads, cfg)
    if not bf16:
        specs.append(("ftopt fused tx.update (pure: new u, m, v)",
                      lambda p=params, g=grads: make_ftopt_update(ftopt.adam(LR), p, g)))
    specs += peer_specs(params, grads, cfg, cfg.compile_trees, bf16=bf16)
    n = numel_of(params)
    if bf16:
        title = (f"4. GPT-2-small shapes, {len(params)} leaves, {n / 1e6:.1f}M params, bf16 "
                 "params and grads (ftopt/bnb: fp32 states; torch/optimi/flashoptim: bf16 "
                 "states)")
    else:
        title = f"3. GPT-2-small shapes, {len(params)} leaves, {n / 1e6:.1f}M params, fp32"
    table = measure_table(title, specs, cfg, clk, "ftopt fused")
    del params, grads
    _reset_dynamo()
    return table


def section_skip(cfg: Config, clk: Clock) -> dict:
    params, grads = _tree(cfg, torch.float32)
    plain = lambda: ftopt.adam(LR)
    skip = lambda: ftopt.adam(LR, skip_zeros=True)
    specs = ftopt_specs(plain, params, grads, cfg)
    specs += ftopt_specs(skip, params, grads, cfg, label="ftopt fused skip_zeros")
    dense = measure_table("5a. skip_zeros, dense random grads (no zeros), GPT-2 fp32",
                          specs, cfg, clk, "ftopt fused")
    sparse_grads = dict(grads)
    wte = "transformer.wte.weight"
    gen = torch.Generator(device=cfg.device).manual_seed(7)
    rows = torch.rand(grads[wte].shape[0], generator=gen, device=cfg.device) < cfg.sparse_rows
    g = grads[wte].clone()
    g[rows] = 0
    sparse_grads[wte] = g
    frac = rows.float().mean().item()
    specs = ftopt_specs(plain, params, sparse_grads, cfg)
    specs += ftopt_specs(skip, params, sparse_grads, cfg, label="ftopt fused skip_zeros")
    specs.append(("torch Adam fused",
                  lambda: make_torch(params, sparse_grads, mode="fused", cfg=cfg)))
    sparse = measure_table(f"5b. skip_zeros, {frac:.0%} of wte rows all-zero, GPT-2 fp32 "
                           "(TB/s and 'of copy' count the dense 28 B/element)",
                           specs, cfg, clk, "ftopt fused")
    summary = {}
    for key, table in (("dense", dense), ("sparse", sparse)):
        by = {r["name"]: r for r in table["rows"] if r.get("available")}
        for tile in [None, *cfg.tiles]:
            base = "ftopt fused" if tile is None else _tile_label(tile)
            a, b = by.get(base), by.get(base + " skip_zeros")
            if a and b:
                summary[f"{key}: {base}"] = {
                    "ms_without": a["ms"], "ms_with": b["ms"],
                    "cost_pct": (b["ms"] / a["ms"] - 1) * 100,
                    "speedup": a["ms"] / b["ms"]}
    for k, v in summary.items():
        print(f"  {k}: without {v['ms_without']:.3f} ms, with skip_zeros {v['ms_with']:.3f} ms "
              f"({v['cost_pct']:+.1f}%, speedup {v['speedup']:.2f}x)")
    return {"title": "5. skip_zeros", "zero_row_fraction": frac, "dense": dense,
            "sparse": sparse, "summary": summary}


def section_host(cfg: Config, clk: Clock) -> dict:
    params, grads = _tree(cfg, torch.float32)
    print(f"\n== 6. host time per step, {len(params)}-leaf GPT-2 tree fp32", flush=True)
    specs = [("ftopt fused", lambda: make_ftopt(ftopt.adam(LR), params, grads)),
             ("torch Adam fused", lambda: make_torch(params, grads, mode="fused", cfg=cfg)),
             ("torch Adam foreach",
              lambda: make_torch(params, grads, mode="foreach", cfg=cfg))]
    rows = []
    for name, factory in specs:
        r, failed = build(name, factory)
        if r is None:
            rows.append(failed)
            continue
        try:
            for _ in range(cfg.warmup):
                r.step()
            ts = clk.host(r.step, cfg.iters)
        except Exception as e:  # noqa: BLE001
            rows.append({"name": name, "available": False,
                         "reason": f"{type(e).__name__}: {e}"[:4000]})
            continue
        row = {"name": name, "available": True, "host_ms": statistics.median(ts),
               "host_ms_min": min(ts), "host_ms_p10": _pct(ts, 0.1),
               "host_ms_p90": _pct(ts, 0.9), "note": r.note}
        rows.append(row)
        print(f"  {name}: host {row['host_ms']:.3f} ms (median; p10 {row['host_ms_p10']:.3f}, "
              f"p90 {row['host_ms_p90']:.3f})")
        del r
        _free()
    return {"title": "6. host time of one step call (sync, perf_counter around the call)",
            "rows": rows}


def eight_bit_specs(params, grads, cfg: Config) -> list:
    kw = dict(backend="auto", state_bytes=bnb_8bit_states, check_backend="auto",
              record_backend=True)
    return [
        ("ftopt adam(state_bits=8) auto",
         lambda: make_ftopt(ftopt.adam(LR, state_bits=8), params, grads, **kw)),
        *[(_tile_label(tile) + " 8-bit",
           lambda tile=tile: make_ftopt(ftopt.adam(LR, state_bits=8), params, grads,
                                        tile=tile, **kw)) for tile in cfg.tiles],
        ("bnb Triton 8-bit (direct)", lambda: make_bnb_triton(params, grads, bits=8, cfg=cfg)),
        ("bnb CUDA Adam8bit", lambda: make_bnb_cuda(params, grads, bits=8, cfg=cfg)),
        ("flashoptim FlashAdam (int8 states)",
         lambda: make_flash(params, grads, quantize=True, cfg=cfg)),
        ("ftopt fused 32-bit (reference)",
         lambda: make_ftopt(ftopt.adam(LR), params, grads)),
    ]


def section_eight_bit(cfg: Config, clk: Clock) -> dict:
    n = cfg.single_numel
    params, grads = _one_tensor(cfg, 3)
    single = measure_table(f"7a. 8-bit states, one {n / 2**20:.0f}M-element fp32 tensor",
                           eight_bit_specs(params, grads, cfg), cfg, clk,
                           "ftopt adam(state_bits=8) auto")
    del params, grads
    _free()
    params, grads = _tree(cfg, torch.float32, seed=11)
    tree = measure_table("7b. 8-bit states, GPT-2-small shapes fp32 (leaves < 4096 elements "
                         "keep fp32 states)", eight_bit_specs(params, grads, cfg), cfg, clk,
                         "ftopt adam(state_bits=8) auto")
    del params, grads
    _free()
    return {"title": "7. 8-bit states", "single": single, "tree": tree}


def _sparse_wte(grads: dict, cfg: Config, seed: int = 7) -> tuple[dict, float]:
    """``grads`` with ``cfg.sparse_rows`` of the embedding's rows all zero (drawn with
    ``seed``)."""
    wte = "transformer.wte.weight"
    gen = torch.Generator(device=cfg.device).manual_seed(seed)
    rows = torch.rand(grads[wte].shape[0], generator=gen, device=cfg.device) < cfg.sparse_rows
    g = grads[wte].clone()
    g[rows] = 0
    return {**grads, wte: g}, rows.float().mean().item()


def _moving_wte(grads: dict, cfg: Config) -> list[dict]:
    """8 draws of :func:`_sparse_wte`'s zero rows (none with its default seed), to take
    in turn: rows that move every step."""
    return [_sparse_wte(grads, cfg, seed)[0] for seed in range(100, 108)]


def _scattered_zeros(grads: dict) -> dict:
    """``grads`` with one element in 97 zero: every block of every leaf part zero."""
    return {k: v.clone().view(-1).index_fill_(
        0, torch.arange(0, v.numel(), 97, device=v.device), 0.0).view_as(v)
        for k, v in grads.items()}


LAYOUTS = {
    # name: (param dtype, adam kwargs, state bytes per element for the nominal traffic)
    "fp32": (torch.float32, {}, fp32_states),
    "bf16 params, fp32 states": (torch.bfloat16, {}, fp32_states),
    "bf16 params, bf16 states": (torch.bfloat16, {"state_dtype": torch.bfloat16},
                                 param_dtype_states),
    "bf16 params, bf16 states, stochastic rounding": (
        torch.bfloat16, {"state_dtype": torch.bfloat16, "state_rounding": "stochastic"},
        param_dtype_states),
    "fp32 params, 8-bit states": (torch.float32, {"state_bits": 8}, bnb_8bit_states),
}


def layout_key(name: str, kw: dict) -> str:
    """The key of ``ftopt.lowering.tiles.SKIP_MODES`` of a layout of :data:`LAYOUTS`."""
    return ("8-bit" if "state_bits" in kw else "16-bit states" if "state_dtype" in kw
            else "fp32" if name == "fp32" else "16-bit")


def layout_trees(cfg: Config, only: list, names: list = ()) -> Iterator[tuple]:
    """(name, adam kwargs, key, params, grads) of each layout of :data:`LAYOUTS` whose
    ``tiles.SKIP_MODES`` key (:func:`layout_key`) is in ``only`` and whose name is in
    ``names`` (empty: every one): the GPT-2 tree, seed 21, one layout at a time."""
    for name, (dtype, kw, _) in LAYOUTS.items():
        key = layout_key(name, kw)
        if (not only or key in only) and (not names or name in names):
            yield (name, kw, key, *_tree(cfg, dtype, seed=21))


def section_layouts(cfg: Config, clk: Clock) -> dict:
    """skip_zeros on every state layout (GPT-2 tree): dense grads (its cost) and 90%
    all-zero embedding rows (its gain); bf16 states also against torch's fused Adam (which
    keeps bf16 states for bf16 params)."""
    out, summary = {}, {}
    for name, (dtype, kw, sbytes) in LAYOUTS.items():
        params, grads = _tree(cfg, dtype, seed=21)
        plain = lambda kw=kw: ftopt.adam(LR, **kw)
        skip = lambda kw=kw: ftopt.adam(LR, skip_zeros=True, **kw)
        for key, g in (("dense", grads), ("sparse", None)):
            frac = 0.0
            if g is None:
                g, frac = _sparse_wte(grads, cfg)
            specs = ftopt_specs(plain, params, g, cfg, state_bytes=sbytes)
            specs += ftopt_specs(skip, params, g, cfg, label="ftopt fused skip_zeros",
                                 state_bytes=sbytes)
            if "bf16 states" in name:
                specs.append(("torch Adam fused (bf16 states)",
                              lambda p=params, g=g: make_torch(p, g, mode="fused", cfg=cfg)))
            what = "dense grads" if key == "dense" else f"{frac:.0%} of wte rows all-zero"
            table = measure_table(f"8. {name}, GPT-2, {what}", specs, cfg, clk, "ftopt fused")
            out[f"{name}: {key}"] = table
            by = {r["name"]: r for r in table["rows"] if r.get("available")}
            a, b = by.get("ftopt fused"), by.get("ftopt fused skip_zeros")
            if a and b:
                summary[f"{name}: {key}"] = {
                    "ms_without": a["ms"], "ms_with": b["ms"],
                    "cost_pct": (b["ms"] / a["ms"] - 1) * 100, "speedup": a["ms"] / b["ms"]}
        del params, grads
        _free()
    for k, v in summary.items():
        print(f"  {k}: without {v['ms_without']:.3f} ms, with skip_zeros {v['ms_with']:.3f} ms "
              f"({v['cost_pct']:+.1f}%, speedup {v['speedup']:.2f}x)")
    return {"title": "8. layouts and skip_zeros", "tables": out, "summary": summary}


def _reset_dynamo():
    with contextlib.suppress(Exception):
        torch._dynamo.reset()
    _free()


# --------------------------------------------------------------------------- output


def _versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "ftopt": getattr(ftopt, "__version__", "?")}
    for dist in ("triton", "bitsandbytes", "torch-optimi", "flashoptim", "optree"):
        try:
            out[dist] = metadata.version(dist)
        except Exception as e:  # noqa: BLE001
            out[dist] = f"not installed ({type(e).__name__})"
    return out


def _device_info(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"name": f"{platform.processor() or 'cpu'} (Triton interpreter)"
                if os.environ.get("TRITON_INTERPRET") else "cpu"}
    p = torch.cuda.get_device_properties(device)
    return {"name": p.name, "total_memory_gib": p.total_memory / 2**30,
            "sm_count": p.multi_processor_count,
            "l2_cache_mib": getattr(p, "L2_cache_size", 0) / 2**20,
            "cuda": torch.version.cuda}


def _md_table(table: dict) -> list[str]:
    lines = [f"### {table['title']}", "",
             "| variant | ms (median, events) | ms (wall) | ms (call) | min ms | B/elem | TB/s "
             "| of copy | vs ftopt | call vs ftopt | notes |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in table["rows"]:
        if not row.get("available"):
            continue
        lines.append(
            f"| {row['name']} | {row['ms']:.3f} | {row['ms_wall']:.3f} | {row['ms_call']:.3f} "
            f"| {row['ms_min']:.3f} | {row['bytes_per_elem']:.2f} | {row['tbps']:.2f} | "
            + (f"{row['of_copy']:.2f}" if row.get("of_copy") else "-") + " | "
            + (f"{row['vs_ftopt']:.2f}x" if row.get("vs_ftopt") else "-") + " | "
            + (f"{row['call_vs_ftopt']:.2f}x" if row.get("call_vs_ftopt") else "-")
            + f" | {row.get('note', '')} |")
    missing = [r for r in table["rows"] if not r.get("available")]
    if missing:
        lines += ["", "Unavailable:"]
        for r in missing:
            reason = r["reason"].replace("\n", " ")[:500]
            lines.append(f"- {r['name']}: `{reason}`")
    checks = [(r["name"], r["info"]) for r in table["rows"]
              if r.get("available") and r.get("info", {}).get("check")]
    if checks:
        lines += ["", "Correctness (one step vs backend='eager', same inputs; max|a-b|/max|b|, "
                  "worst leaf):"]
        for name, info in checks:
            c = info["check"]
            lines.append(f"- {name}: params {c['param_rel_err']:.2e}, states "
                         f"{c['state_rel_err']:.2e}, updates {c['update_rel_err']:.2e}, "
                         f"fraction of param elements differing "
                         f"{c['param_elements_differing']:.2e}"
                         + (f"; backend ran: {info['backend_ran']}"
                            if "backend_ran" in info else ""))
    lines.append("")
    return lines


def write_outputs(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_results.json").write_text(json.dumps(results, indent=1, default=str))
    meta = results["meta"]
    md = ["# ftopt GPU step benchmark", "",
          f"- date: {meta['date']}", f"- command: `{meta['command']}`",
          f"- device: {meta['device']}", f"- versions: {meta['versions']}",
          f"- ftopt tiles: {_tile_note(meta['ftopt_tile']) if meta['ftopt_tile'] else '-'}",
          f"- timing: median of {meta['iters']} steps per variant after {meta['warmup']} "
          f"warm-up steps, {meta['timer']} around each step, {meta['rounds']} interleaved "
          "rounds; 'wall' = perf_counter over back-to-back steps, one sync at the end",
          f"- run time: {meta.get('total_seconds', 0):.0f} s; per section (s): "
          + ", ".join(f"{k} {v:.0f}" for k, v in meta.get("section_seconds", {}).items()),
          "- 'vs ftopt' = variant time / ftopt time (> 1: ftopt faster); TB/s at each "
          "variant's nominal bytes per element", ""]
    sec = results["sections"]
    if "copy" in sec:
        c = sec["copy"]
        md += [f"### {c['title']}", "",
               f"{c['gib']:.2f} GiB: {c['ms']:.3f} ms, **{c['tbps']:.3f} TB/s** (read + write)",
               ""]
    for key in ("single", "gpt2_fp32", "gpt2_bf16"):
        if key in sec:
            md += _md_table(sec[key])
    if "skip_zeros" in sec:
        s = sec["skip_zeros"]
        md += ["## " + s["title"], ""]
        md += _md_table(s["dense"]) + _md_table(s["sparse"])
        for k, v in s["summary"].items():
            md.append(f"- {k}: without {v['ms_without']:.3f} ms, with {v['ms_with']:.3f} ms: "
                      f"{v['cost_pct']:+.1f}% ({v['speedup']:.2f}x)")
        md.append("")
    if "host" in sec:
        h = sec["host"]
        md += [f"### {h['title']}", "", "| variant | host ms (median) | p10 | p90 |",
               "| --- | --- | --- | --- |"]
        for r in h["rows"]:
            if r.get("available"):
                md.append(f"| {r['name']} | {r['host_ms']:.3f} | {r['host_ms_p10']:.3f} | "
                          f"{r['host_ms_p90']:.3f} |")
            else:
                md.append(f"| {r['name']} | unavailable: {r['reason'][:200]} | | |")
        md.append("")
    if "eight_bit" in sec:
        e = sec["eight_bit"]
        md += ["## " + e["title"], ""] + _md_table(e["single"]) + _md_table(e["tree"])
    if "layouts" in sec:
        lay = sec["layouts"]
        md += ["## " + lay["title"], ""]
        for table in lay["tables"].values():
            md += _md_table(table)
        for k, v in lay["summary"].items():
            md.append(f"- {k}: without {v['ms_without']:.3f} ms, with {v['ms_with']:.3f} ms: "
                      f"{v['cost_pct']:+.1f}% ({v['speedup']:.2f}x)")
        md.append("")
    explains = []
    for key, table in _all_tables(sec):
        for row in table["rows"]:
            ex = row.get("info", {}).get("explain") if row.get("available") else None
            if ex:
                explains.append((f"{key} / {row['name']}", ex))
    if explains:
        md += ["## ftopt.explain", ""]
        seen = set()
        for label, ex in explains:
            if ex in seen:
                continue
            seen.add(ex)
            md += [f"{label}:", "", "```", ex.rstrip(), "```", ""]
    if results.get("errors"):
        md += ["## Section errors", ""]
        for k, v in results["errors"].items():
            md += [f"- {k}: `{v.splitlines()[-1] if v else ''}`"]
    (out / "gpu_results.md").write_text("\n".join(md) + "\n")


def _all_tables(sec: dict):
    for key in ("single", "gpt2_fp32", "gpt2_bf16"):
        if key in sec:
            yield key, sec[key]
    if "skip_zeros" in sec:
        yield "skip_zeros dense", sec["skip_zeros"]["dense"]
        yield "skip_zeros sparse", sec["skip_zeros"]["sparse"]
    if "eight_bit" in sec:
        yield "8-bit single", sec["eight_bit"]["single"]
        yield "8-bit tree", sec["eight_bit"]["tree"]
    if "layouts" in sec:
        yield from sec["layouts"]["tables"].items()


# --------------------------------------------------------------------------- main

SECTIONS = ("copy", "single", "gpt2_fp32", "gpt2_bf16", "skip_zeros", "host", "eight_bit",
            "layouts")


def gpt2_tree_config(device: torch.device) -> Config:
    """The GPT-2 small tree of the layout and skip_zeros sweeps (``skip_modes_gpu.py``,
    ``quant_regs_gpu.py``, ``tile16_gpu.py``): quick timing, no compiled peers."""
    return Config(device=device, smoke=False, quick=True, iters=30, warmup=3, rounds=1,
                  copy_numel=1, single_numel=1,
                  tree_dims={"vocab": 50257, "d": 768, "ctx": 1024, "n_layer": 12},
                  compile_single=False, compile_trees=False, tiles=[], sections=[])


def median_step_ms(tx, params: dict, grads: dict | list) -> float:
    """Median ms of a donated fused step of ``tx`` (40 steps, 3 rounds)."""
    return statistics.median(donated_step_ms(tx, params, grads, 40, 3))


def parse_tiles(text: str) -> list:
    """``1024x4``: that tile for every kernel; ``1024x4/512x4``: in-place skip_zeros
    kernels get the second (8-bit kernels always the first)."""
    tiles = []
    for part in filter(None, (p.strip().lower() for p in text.split(","))):
        main, _, in_place = part.partition("/")
        block, warps = (int(x) for x in main.split("x"))
        ip_block, ip_warps = (int(x) for x in (in_place or main).split("x"))
        tiles.append((block, warps, ip_block, ip_warps, block, warps))
    return tiles


def make_config(args) -> Config:
    device = torch.device("cpu" if args.smoke else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available: use --smoke to check the script on a CPU")
    compile_flag = args.compile
    if compile_flag == "auto":
        compile_flag = "on" if device.type == "cuda" else "off"
    if args.smoke:
        iters, warmup, rounds = 2, 0, 1
        copy_numel, single_numel = 1 << 20, 1 << 15
        # 2 layers (28 leaves) keep the interpreter fast; wte and c_fc still get 8-bit states
        dims = {"vocab": 257, "d": 32, "ctx": 64, "n_layer": 2}
    elif args.quick:
        iters, warmup, rounds = 20, 3, 2
        copy_numel, single_numel = 1 << 29, 1 << 26
        dims = {"vocab": 50257, "d": 768, "ctx": 1024, "n_layer": 12}
    else:
        iters, warmup, rounds = 50, 5, 5
        copy_numel, single_numel = 1 << 29, 1 << 26
        dims = {"vocab": 50257, "d": 768, "ctx": 1024, "n_layer": 12}
    iters = args.iters or iters
    rounds = min(args.rounds or rounds, iters)
    sections = [s.strip() for s in args.sections.split(",")] if args.sections else list(SECTIONS)
    for s in sections:
        if s not in SECTIONS:
            raise SystemExit(f"unknown section {s!r}; choose from {', '.join(SECTIONS)}")
    return Config(device=device, smoke=args.smoke, quick=args.quick, iters=iters,
                  warmup=warmup, rounds=rounds, copy_numel=copy_numel,
                  single_numel=single_numel, tree_dims=dims,
                  compile_single=compile_flag == "on",
                  compile_trees=compile_flag == "on" and not args.quick,
                  tiles=parse_tiles(args.tiles or ""), sections=sections)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True,
                    help="folder for gpu_results.json and gpu_results.md")
    ap.add_argument("--device", default="cuda", help="device (default: cuda)")
    ap.add_argument("--quick", action="store_true",
                    help="20 timed steps, 2 rounds, no torch.compile on the GPT-2 trees (<2 min)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, tiny sizes, Triton interpreter: checks that the script runs")
    ap.add_argument("--iters", type=int, default=0, help="timed steps per variant")
    ap.add_argument("--rounds", type=int, default=0, help="interleaved timing rounds")
    ap.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                    help="torch.compile peer (auto: on for CUDA; --quick: 64M tensor only)")
    ap.add_argument("--tiles", default="",
                    help="extra ftopt tile variants, e.g. '512x4,1024x4/1024x4,1024x4-multi'"
                         " (see parse_tiles): set around their steps")
    ap.add_argument("--sections", default="",
                    help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    args = ap.parse_args(argv)
    cfg = make_config(args)
    clk = Clock(cfg.device)
    torch.manual_seed(0)
    t_start = time.perf_counter()
    results = {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "device": _device_info(cfg.device), "versions": _versions(),
            "ftopt_tile": ftopt_tile_now(), "extra_tiles": cfg.tiles,
            "iters": cfg.iters, "warmup": cfg.warmup, "rounds": cfg.rounds,
            "smoke": cfg.smoke, "quick": cfg.quick,
            "timer": "CUDA events" if clk.cuda else "perf_counter (no CUDA)",
            "triton_interpret": os.environ.get("TRITON_INTERPRET"),
            "sizes": {"copy_numel": cfg.copy_numel, "single_numel": cfg.single_numel,
                      "gpt2": cfg.tree_dims},
            "hyperparameters": {"lr": LR, "b1": B1, "b2": B2, "eps": EPS,
                                "weight_decay": 0.0},
        },
        "sections": {}, "errors": {},
    }
    with contextlib.suppress(Exception):
        results["meta"]["bitsandbytes"] = bnb_info()
    print(f"ftopt GPU step benchmark on {results['meta']['device']['name']}; "
          f"versions {results['meta']['versions']}")
    runs = {
        "copy": lambda: section_copy(cfg, clk),
        "single": lambda: section_single(cfg, clk),
        "gpt2_fp32": lambda: section_tree(cfg, clk, torch.float32),
        "gpt2_bf16": lambda: section_tree(cfg, clk, torch.bfloat16),
        "skip_zeros": lambda: section_skip(cfg, clk),
        "host": lambda: section_host(cfg, clk),
        "eight_bit": lambda: section_eight_bit(cfg, clk),
        "layouts": lambda: section_layouts(cfg, clk),
    }
    with torch.no_grad():
        for name in SECTIONS:
            if name not in cfg.sections:
                continue
            t0 = time.perf_counter()
            try:
                results["sections"][name] = runs[name]()
            except Exception:  # noqa: BLE001 - one broken section must not lose the others
                tb = traceback.format_exc()
                print(f"\nsection {name} failed:\n{tb}")
                results["errors"][name] = tb
            results["meta"].setdefault("section_seconds", {})[name] = time.perf_counter() - t0
            _free()
            write_outputs(results, args.out)  # partial results survive a later crash
    results["meta"]["total_seconds"] = time.perf_counter() - t_start
    write_outputs(results, args.out)
    print(f"\nwrote {args.out / 'gpu_results.json'} and {args.out / 'gpu_results.md'} "
          f"in {results['meta']['total_seconds']:.0f} s")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
