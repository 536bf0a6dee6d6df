"""The cases the fuzz found, pinned by their structures (``tests/test_fuzz_pinned.py``
replays them, and ``tests/test_fuzz.py`` uses some to test its checks), and the GPU
runner (``benchmarks/fuzz.py``) that draws them.

A seed's pool is drawn from the registry, which grows, so SEED:INDEX names another case
once entries are added; the case's own draws (hyperparameters, params, gradients) come
from its key and are the same given its structure. Written from the pools of 2026-12-03
(before scale_by_schedule). To pin a case: its structure from
``benchmarks/fuzz.py --replay SEED:INDEX`` under its key here, and a test in
``tests/test_fuzz_pinned.py`` saying what it found.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib

import torch
from fuzz_cases import Case, Part, Structure

__all__ = ["PINNED", "pinned", "runner"]


@functools.cache
def runner():
    """``benchmarks/fuzz.py`` as a module."""
    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "fuzz.py"
    spec = importlib.util.spec_from_file_location("fuzz_runner", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pinned(seed: int, index: int, device: str) -> Case:
    """The fuzz's case ``seed:index`` of :data:`PINNED`: a pool of its structure only, so
    that the example's pick lands on it."""
    return runner().example(seed, index, [PINNED[seed, index]] * 30, device)


PINNED = {
    (17, 8920): (Structure(parts=(
        Part("scale_by_yogi", ()), Part("scale_by_adan", ()),
        Part("scale_by_rms", (("eps_in_sqrt", True),)), Part("scale_by_adan", ()),
        Part("identity", ())), skip="off", skip_at=0, bits=8, quant="wrapper", min_size=200,
        state_dtype="", tensors=False, schedules=False, named=False), ("fp16", "bf16")),
    (22, 644): (Structure(parts=(
        Part("scale_by_adam", (("nesterov", False),)), Part("scale_by_trust_ratio", ()),
        Part("scale_by_muon", (("adaptive", False), ("nesterov", True),
                               ("ns_dtype", torch.float32), ("ns_steps", 2))),
        Part("scale_by_optimistic_gradient", ()), Part("scale_by_ademamix", ())),
        skip="off", skip_at=4, bits=8, quant="wrapper", min_size=0, state_dtype="",
        tensors=False, schedules=False, named=True), ("bf16", "fp32")),
    (22, 2453): (Structure(parts=(
        Part("scale_by_yogi", ()), Part("scale_by_optimistic_gradient", ()),
        Part("trace", (("nesterov", True),)), Part("keep_params_nonnegative", ()),
        Part("scale_by_amsgrad", (("bias_correction_mu", True),
                                  ("bias_correction_nu", False)))),
        skip="marker", skip_at=4, bits=32, quant="wrapper", min_size=0, state_dtype="",
        tensors=False, schedules=False, named=True), ("bf16", "fp16")),
    (86, 1840): (Structure(parts=(
        Part("scale_by_ademamix", ()), Part("normalize_by_update_norm", ()),
        Part("scale_by_rms", (("eps_in_sqrt", False),)), Part("scale_by_sign", ()),
        Part("scale_by_stddev[bias_correction]", (("eps_in_sqrt", False),))),
        skip="wrap", skip_at=5, bits=32, quant="wrapper", min_size=0,
        state_dtype="float16", tensors=False, schedules=False, named=False),
        ("fp16", "fp32")),
    # ADOPT's first update is zero, so normalize's 0/0 makes the params NaN; the next
    # step's skipped elements must keep those NaNs' bits (torch's CPU conversions of 16-bit
    # floats to fp32 and back do not).
    (94, 516): (Structure(parts=(
        Part("scale_by_adopt", (("nesterov", False), ("use_clipping", True))),
        Part("scale_by_factored_rms", (("factored", True), ("min_dim_size_to_factor", 2))),
        Part("trace", (("nesterov", False),)), Part("scale_by_ademamix", ()),
        Part("normalize", ())), skip="marker", skip_at=0, bits=8, quant="wrapper",
        min_size=64, state_dtype="", tensors=False, schedules=False, named=False),
        ("bf16", "fp16")),
    # A global norm summed over rows whose places moved with the groups' padding: the
    # skip_zeros chain's extra reduction (DoG's count of non-zero gradients) padded the
    # 32-bit group's rows differently, so the 8-bit leaf's row sat elsewhere in the sum.
    (110, 508): (Structure(parts=(
        Part("normalize_by_update_norm", ()), Part("scale_by_distance_over_gradients", ()),
        Part("scale_by_stddev", (("eps_in_sqrt", False),)),
        Part("scale_by_ademamix[warmup]", (("warmup", 1),))),
        skip="marker", skip_at=4, bits=8, quant="wrapper", min_size=200, state_dtype="",
        tensors=False, schedules=True, named=False), ("bf16", "fp32")),
    # A leaf passed through the segment before Muon's matrix stage (the decay's mask
    # leaves 1-D leaves out) came back cast to its fp16 gradient's dtype, and the next
    # segment read those bytes as fp32.
    (165, 27): (Structure(parts=(
        Part("add_decayed_weights", (("mask", "ndim"),)),
        Part("muon[dims]", (("adaptive", True), ("nesterov", False),
                            ("ns_dtype", torch.float32), ("weight_decay_mask", "none")))),
        skip="wrap", skip_at=2, bits=32, quant="wrapper", min_size=0, state_dtype="",
        tensors=False, schedules=False, named=False), ("fp32", "fp16")),
    # Six 8-bit states in one kernel: at its register cap of 64 the split+defer main kernel
    # spilled 44 registers, and ptxas (Triton 3.6, sm_90) miscompiled it: Lion's moment
    # wrong in 148 of 257 elements of a donated step, the params right.
    (102, 9637): (Structure(parts=(
        Part("scale_by_ademamix[warmup]", (("warmup", 1),)),
        Part("scale_by_stddev[bias_correction]", (("eps_in_sqrt", False),)),
        Part("scale_by_lion", ())), skip="wrap", skip_at=3, bits=8, quant="wrapper",
        min_size=200, state_dtype="", tensors=False, schedules=False, named=False), None),
    # A snapshot's sum over updates that cancel: fused and eager 5e-4 apart, relative.
    (197, 768): (Structure(parts=(
        Part("normalize_by_update_norm", ()), Part("scale_by_adan", ()),
        Part("snapshot", (("measure", "sum"),)), Part("weight_decay", (("mask", "none"),))),
        skip="wrap", skip_at=2, bits=32, quant="wrapper", min_size=0, state_dtype="",
        tensors=True, schedules=False, named=False), ("fp32", "fp16")),
    # A bf16 element stepped from -0.0 to -4.6e-8, where eager's draws scatter two ulps
    # either side of float64 and eager sits two off; fused is at float64.
    (207, 482): (Structure(parts=(
        Part("normuon", (("nesterov", True), ("ns_dtype", torch.float32),
                         ("weight_decay_mask", "none"))),),
        skip="marker", skip_at=1, bits=8, quant="wrapper", min_size=200, state_dtype="",
        tensors=False, schedules=False, named=False), ("bf16", "fp32")),
    # fp16 states after Muon: subnormal elements (2e-5) of a leaf whose largest is 0.14,
    # six of their ulps apart, over which eager's own draws scatter.
    (210, 318): (Structure(parts=(
        Part("scale_by_muon", (("adaptive", False), ("nesterov", False),
                               ("ns_dtype", torch.float32), ("ns_steps", 5))),
        Part("add_cautious_weight_decay[schedule]", (("mask", "none"), ("schedule", "cosine"))),
        Part("scale_by_adan", ()), Part("weight_decay", (("mask", "none"),))),
        skip="marker", skip_at=3, bits=32, quant="wrapper", min_size=0,
        state_dtype="float16", tensors=False, schedules=False, named=False), ("bf16", "fp16")),
    # SOAP's first eigenbases from Kronecker factors 1.7e-7 apart (fused and eager), two
    # of 16 eigenvectors negated by LAPACK: the bases are signed now.
    (213, 639): (Structure(parts=(
        Part("scale_by_stddev[bias_correction]", (("eps_in_sqrt", False),)),
        Part("centralize", ()),
        Part("scale_by_soap", (("max_precond_dim", 10000), ("precondition_1d", True),
                               ("precondition_frequency", 1))),
        Part("scale_by_param_block_norm", ()), Part("scale_by_radam", (("nesterov", False),))),
        skip="marker", skip_at=3, bits=8, quant="wrapper", min_size=64, state_dtype="",
        tensors=True, schedules=False, named=False), ("fp16", "bf16")),
    # Every elementwise state 8-bit and Rprop's signs before NorMuon: eager's draws moved
    # nothing the Newton-Schulz iteration amplifies until the absmax moved too.
    (219, 631): (Structure(parts=(
        Part("scale_by_ademamix[warmup]", (("warmup", 10),)), Part("scale_by_adamax", ()),
        Part("normalize", ()), Part("scale_by_rprop", ()),
        Part("scale_by_normuon", (("nesterov", False), ("ns_coeffs", (3.4445, -4.775, 2.0315)),
                                  ("ns_dtype", torch.float32)))),
        skip="marker", skip_at=0, bits=8, quant="wrapper", min_size=64,
        state_dtype="bfloat16", tensors=False, schedules=False, named=False), ("fp16", "bf16")),
    # LAMB's u cancelling 33-fold (0.861 - 0.835) in a one-element fp16 leaf with 8-bit
    # states: the trust ratio's norm was taken of a u rounded otherwise than the u it
    # scaled (the reduction kernel without the main kernel's fast math), on a GPU only.
    (106, 3544): (Structure(parts=(Part("lamb", (("mask", "none"),)),), skip="marker",
                            skip_at=1, bits=8, quant="wrapper", min_size=0,
                            state_dtype="float16", tensors=False, schedules=False,
                            named=False), None),
    # A bias-corrected stddev whose variance cancels, then SM3: its accumulator is
    # two-valued at the ulp level, and eager's first eight draws all landed on one value.
    (226, 840): (Structure(parts=(
        Part("normalize", ()), Part("scale_by_stddev[bias_correction]", (("eps_in_sqrt", True),)),
        Part("centralize", ()), Part("scale_by_sm3", ())), skip="wrap", skip_at=2, bits=32,
        quant="wrapper", min_size=0, state_dtype="", tensors=False, schedules=False,
        named=False), ("fp16", "fp32")),
    # normalize's 0/0 of all-zero gradients before SOAP's first step: LAPACK's eigh
    # refused the NaN factors ("failed to converge") in the chain without skip_zeros.
    (248, 234): (Structure(parts=(
        Part("normalize", ()), Part("scale_by_dog", (("init_step", ("learning_rate", 0.001)),)),
        Part("scale_by_novograd", ()),
        Part("scale_by_soap", (("max_precond_dim", 10000), ("precondition_1d", True),
                               ("precondition_frequency", 3))),
        Part("trace", (("nesterov", True),))), skip="wrap", skip_at=4, bits=32,
        quant="wrapper", min_size=0, state_dtype="", tensors=True, schedules=False,
        named=True), ("fp32", "fp16")),
    (268, 1551): (Structure(parts=(
        Part("set_to_zero", ()), Part("scale_by_param_block_norm", ()),
        Part("scale_by_distance_over_gradients", ()), Part("normalize", ()),
        Part("scale_by_simplified_ademamix", ())), skip="marker", skip_at=4, bits=32,
        quant="wrapper", min_size=0, state_dtype="", tensors=True, schedules=False,
        named=False), None),
    # bf16 params, which eager's draws do not move, through Muon's momentum (its lerp an
    # ulp apart between the backends) into Newton-Schulz: NorMuon's row moments 1e-5
    # apart, past the bound of two float64 draws' spread, within that of eight.
    (330, 640): (Structure(parts=(
        Part("keep_params_nonnegative", ()), Part("identity", ()),
        Part("scale_by_normuon", (("nesterov", False), ("ns_coeffs", (3.4445, -4.775, 2.0315)),
                                  ("ns_dtype", torch.float32))),
        Part("scale_by_sm3", ())), skip="off", skip_at=2, bits=32, quant="wrapper",
        min_size=0, state_dtype="bfloat16", tensors=True, schedules=True, named=False),
        ("bf16", "fp32")),
}


PINNED[110, 150] = PINNED[110, 508]
