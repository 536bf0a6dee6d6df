"""The generated kernels vectorize their element loads and stores.

Compiled for sm_90 (Hopper) without a GPU: Triton lowers the generated source to PTX on
the host. Without 16-byte vector accesses the kernels still give the right numbers but
lose bandwidth (on an H200: 0.445 -> 0.453 ms on a 64M fp32 Adam step), which no
correctness test would notice. The same compilation checks the kernels with bf16 states
(vectorized too) and with 8-bit states (the arithmetic encoder's load count).

The cross-compilation runs in a subprocess with ``TRITON_INTERPRET`` unset and a cache
directory of its own. In this process the other tests run kernels in Triton's
interpreter, and the interpreter (Triton 3.6 to 3.9) leaves ``triton.language.core``
patched after a kernel calls a ``@triton.jit`` helper such as ``tl.sum``; ftopt undoes
that after each of its launches (``interpreter.patches_undone``, tested in
``test_interpreter.py``), and the subprocess keeps this test independent of whatever
else ran before it, with a cold cache every time, as on a new machine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

import ftopt
from ftopt.lowering import codegen
from ftopt.lowering.plan import plan_chain

CONSTEXPRS = {"N_LEAF_VALUES": 1, "N_REDUCTIONS": 1, "BLOCK": 512, "COUNT": False}


def _ptx(source: str) -> str:
    kernel = codegen.compile_source(source, "ftopt_main")
    fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)
    signature, constexprs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in CONSTEXPRS:
            signature[name], constexprs[(i,)] = "constexpr", CONSTEXPRS[name]
        elif name.startswith("sa"):
            signature[name] = "fp32"
        elif name == "block_leaf_ptr":
            signature[name] = "*i32"
        elif name.endswith("addr_ptr") or name in ("block_start_ptr", "numel_ptr"):
            signature[name] = "*i64"
        elif name.startswith("count"):
            signature[name] = "*i64"
        else:
            signature[name] = "*fp32"
    # Device tensors from the caching allocator: every pointer argument 16-byte aligned.
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if signature[name].startswith("*")}
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "enable_fp_fusion": False})
    return compiled.asm["ptx"]


CASES = [(dtype, donate) for dtype in ("float32", "bfloat16") for donate in (False, True)]


def dump_ptx(path: str) -> None:
    """Writes the PTX of every case to ``path`` (JSON); run in the subprocess."""
    out = {}
    for dtype_name, donate in CASES:
        dtype = getattr(torch, dtype_name)
        traced = plan_chain(ftopt.adam(1e-3)).traced(donate, "p")
        source = codegen.main_source(traced, codegen.Variant(dtype, dtype, True, True, 0))
        out[f"{dtype_name}-{donate}"] = _ptx(source)
    f32, bf16 = torch.float32, torch.bfloat16
    # 16-bit states: bf16 stored as its bits, rounded by integer arithmetic.
    traced = plan_chain(ftopt.adam(1e-3, state_dtype=bf16)).traced(False, "p")
    variant = codegen.Variant(f32, f32, True, True, 0, (("st0_mu", bf16), ("st0_nu", bf16)))
    out["bf16-states"] = _ptx(codegen.main_source(traced, variant))
    # 8-bit states, both encoders (QBLOCK 256, the 8-bit tile of 1024 elements).
    CONSTEXPRS.update({"QBLOCK": 256, "BLOCK": 1024})
    traced = plan_chain(ftopt.adam(1e-3, state_bits=8)).traced(False, "p")
    for encoder in ("arithmetic", "search"):
        variant = codegen.Variant(f32, f32, True, True, 256, encoder=encoder)
        source = codegen.main_source(traced, variant)
        out[f"8bit-{encoder}"] = _ptx(source)
    with open(path, "w") as f:
        json.dump(out, f)


@pytest.fixture(scope="module")
def ptx_of(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vectorized")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp / "triton-cache")
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path.insert(0, {here!r}); import test_vectorized; "
            f"test_vectorized.dump_ptx({str(tmp / 'ptx.json')!r})")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    with open(tmp / "ptx.json") as f:
        return json.load(f)


@pytest.mark.parametrize("dtype_name, donate", CASES)
def test_adam_kernel_accesses_are_16_byte_vectors(ptx_of, dtype_name, donate):
    ptx = ptx_of[f"{dtype_name}-{donate}"]

    def count(op, width):
        return len(re.findall(rf"{op}\.global(?:\.\w+)*\.v{width}\.b32", ptx))

    # The full-block path, 4 elements per thread at BLOCK 512 and 4 warps: g, p, mu, nu
    # read and p, mu, nu written as vectors, 16 bytes for fp32 (fp32 states always),
    # 8 bytes for bf16 g and p.
    wide, narrow = (4, 0) if dtype_name == "float32" else (2, 2)
    assert count("ld", 4) >= wide and count("ld", 2) >= narrow, ptx.count("ld.global")
    assert count("st", 4) >= wide - 1 and count("st", 2) >= narrow - 1, ptx.count("st.")


def test_bf16_states_are_8_byte_vectors(ptx_of):
    """The full-block path reads and writes mu and nu, 4 bf16 per thread, as 8 bytes."""
    ptx = ptx_of["bf16-states"]
    assert len(re.findall(r"ld\.global(?:\.\w+)*\.v2\.b32", ptx)) >= 2
    assert len(re.findall(r"st\.global(?:\.\w+)*\.v2\.b32", ptx)) >= 2


def test_arithmetic_8bit_encoder_loads_far_less(ptx_of):
    """Compiled for sm_90, the 8-bit kernel with the arithmetic encoder issues less than
    half the global loads of the binary search (2 map loads per element and state to
    encode instead of 10)."""
    loads = {e: len(re.findall(r"ld\.global", ptx_of[f"8bit-{e}"]))
             for e in ("arithmetic", "search")}
    assert 0 < 2 * loads["arithmetic"] < loads["search"], loads


@pytest.mark.parametrize("mode", ["foreach", "loop"])
@pytest.mark.parametrize("cond", [True, False])
def test_where_on_a_host_condition_gives_tensors(mode, cond):
    """``o.where(flag, 0.0, elem)`` with a host flag (Adan's first step) is element-wise:
    a number picked stands for a tensor of the element-wise side's shape and dtype, so a
    following ``lerp`` (which reads the items' dtypes) works."""
    from ftopt import eager

    o = eager.EagerOps(mode)
    x = eager.elem([torch.randn(3), torch.randn(2, 2)], mode)
    start = eager.elem([torch.randn(3), torch.randn(2, 2)], mode)
    picked = o.where(eager.scalar(cond, mode), 0.0, x)
    assert all(isinstance(t, torch.Tensor) for t in picked.items)
    out = o.lerp(start, picked, eager.scalar(0.25, mode))
    for got, s, xi in zip(out.items, start.items, x.items):
        want = torch.lerp(s, torch.zeros_like(xi) if cond else xi, 0.25)
        assert torch.equal(got, want)
