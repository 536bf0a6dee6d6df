"""Register caps only where a kernel fits them (``tiles.CAP_SPILLS``).

The caps of the 8-bit and in-place kernels were tuned on kernels that fit them; a long
chain of 8-bit transforms does not. Past its cap ptxas miscompiled such chains: spilling
174 registers (AdEMAMix -> Adadelta -> AMSGrad, 8-bit: a moment wrong in a sixth of its
elements) and 44 (AdEMAMix -> stddev -> Lion: Lion's moment wrong in most elements;
``tests/test_fuzz.py``), so a capped kernel that spills more than ``CAP_SPILLS`` (16)
registers runs at the lowest cap ``CAP_STEP`` apart (up to 128) that fits, found by
bisection, else at the compiler's choice. On a CPU the interpreter has no registers: the policy is
tested with a stand-in kernel, and the chain runs fused against eager (on a GPU with the
cap and its fallback).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from step_checks import fresh_generator

import ftopt
from ftopt.lowering import launch, tiles

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class _Compiled:
    def __init__(self, spills: int):
        self.n_spills, self.handles = -1, spills

    def _init_handles(self):
        self.n_spills = self.handles


class _Kernel:
    """Stands in for a JITFunction: records the options of each compile and launch;
    ``spills``: the registers it spills at each cap (none uncapped)."""

    arg_names = ["x_ptr", "BLOCK"]

    def __init__(self, spills):
        self.spills, self.warmups, self.launches = spills, [], []

    def warmup(self, *args, grid, **named):
        self.warmups.append(dict(named))
        return _Compiled(self.spills(named["maxnreg"]) if "maxnreg" in named else 0)

    def __getitem__(self, grid):
        def run(*args, **named):
            self.launches.append(dict(named))
        return run


def _run(kernel, cap: int = 64) -> None:
    constants = (("BLOCK", 256), ("num_warps", 1), ("maxnreg", cap))
    launch._launch(kernel, (3,), [object()], constants, torch.device("cpu"), ("spills",))
    assert len(kernel.launches) == 1
    assert kernel.launches[0]["BLOCK"] == 256 and kernel.launches[0]["num_warps"] == 1


def _caps(kernel) -> tuple[list, object]:
    """The caps compiled at, and the one launched with (None: uncapped)."""
    return [w.get("maxnreg") for w in kernel.warmups], kernel.launches[0].get("maxnreg")


@pytest.fixture
def gpu_policy(monkeypatch):
    monkeypatch.setattr(tiles, "INTERPRETING", False)
    monkeypatch.setattr(tiles, "CAP_SPILLS", 16)
    monkeypatch.setattr(tiles, "CAP_STEP", 16)


@pytest.mark.parametrize("spills", [0, 16])
def test_a_kernel_that_fits_its_cap_keeps_it(spills, gpu_policy):
    kernel = _Kernel(lambda cap: spills)
    _run(kernel)
    assert _caps(kernel) == ([64], 64)


@pytest.mark.parametrize("fits_at,caps", [
    # (the lowest cap it fits, caps compiled at): bisection over 64, 80, ..., 128
    (80, [64, 128, 96, 80]),
    (96, [64, 128, 96, 80]),
    (112, [64, 128, 96, 112]),
    (128, [64, 128, 96, 112]),
])
def test_a_kernel_that_spills_past_the_limit_compiles_at_higher_caps(fits_at, caps,
                                                                     gpu_policy):
    kernel = _Kernel(lambda cap: 17 + (fits_at - cap) if cap < fits_at else 16)
    _run(kernel)
    assert _caps(kernel) == (caps, fits_at)


def test_the_gpu_spills_of_8bit_adam_pick_its_caps_in_five_compiles(gpu_policy,
                                                                    monkeypatch):
    """Registers spilled on the H100 (ptxas 12.8, ``benchmarks/register_caps_gpu.py``)
    by 8-bit Adam's two skip_zeros kernels past their cap of 72, at step 8: the deferred
    kernel fits at 120, the select kernel at 96 (stepping up one at a time: 7 and 4
    compiles)."""
    monkeypatch.setattr(tiles, "CAP_STEP", 8)
    deferred = {72: 98, 80: 72, 88: 66, 96: 52, 104: 38, 112: 18, 120: 6, 128: 2}
    select = {72: 48, 80: 34, 88: 18, 96: 4, 104: 0, 112: 0, 120: 0, 128: 0}
    for spills, caps in [(deferred, [72, 128, 96, 112, 120]), (select, [72, 128, 96, 80, 88])]:
        kernel = _Kernel(spills.__getitem__)
        _run(kernel, 72)
        assert _caps(kernel) == (caps, min(c for c in spills if spills[c] <= 16))


@pytest.mark.parametrize("step", [8, 16, 24])
def test_bisection_picks_the_lowest_cap_that_fits(step, gpu_policy, monkeypatch):
    """For any spills that fall as the cap rises: the lowest cap of the grid that fits,
    as stepping up one at a time finds it, in at most 2 + log2(steps) compiles."""
    monkeypatch.setattr(tiles, "CAP_STEP", step)
    gen = fresh_generator()
    for base in (56, 64, 72):
        grid = list(range(base, 129, step))
        for _ in range(40):
            drops = torch.randint(0, 40, (len(grid),), generator=gen).tolist()
            spills = dict(zip(grid, reversed(list(itertools.accumulate(drops)))))
            kernel = _Kernel(spills.__getitem__)
            _run(kernel, base)
            fitting = [c for c in grid if spills[c] <= 16]
            compiled, launched = _caps(kernel)
            assert launched == (fitting[0] if fitting and len(grid) > 1 else None)
            assert len(compiled) <= 2 + math.ceil(math.log2(max(len(grid) - 1, 1)))


def test_spills_that_do_not_fall_steadily_still_launch_a_cap_that_fits(gpu_policy,
                                                                        monkeypatch):
    """ptxas's spills need not fall at every step (8-bit AdEMAMix's select kernel: 6 at
    112, 8 at 120): whatever cap the bisection launches compiled within the limit, and
    it runs uncapped only where the top cap spills past it."""
    monkeypatch.setattr(tiles, "CAP_STEP", 8)
    gen = fresh_generator()
    grid = list(range(72, 129, 8))
    for _ in range(200):
        spills = dict(zip(grid, torch.randint(0, 34, (len(grid),), generator=gen).tolist()))
        kernel = _Kernel(spills.__getitem__)
        _run(kernel, 72)
        compiled, launched = _caps(kernel)
        if launched is None:
            assert spills[72] > 16 and spills[128] > 16 and compiled == [72, 128]
        else:
            assert launched in compiled and spills[launched] <= 16


def test_past_128_registers_the_kernel_runs_uncapped(gpu_policy):
    kernel = _Kernel(lambda cap: 174)
    _run(kernel)
    assert _caps(kernel) == ([64, 128], None)


def test_without_a_step_a_spilling_kernel_runs_uncapped(gpu_policy, monkeypatch):
    monkeypatch.setattr(tiles, "CAP_STEP", 0)
    kernel = _Kernel(lambda cap: 44 if cap < 96 else 0)
    _run(kernel)
    assert _caps(kernel) == ([64], None)


def test_the_spill_limit_is_16_registers_and_the_step_none_unless_set():
    import os

    assert tiles.CAP_SPILLS == int(os.environ.get("FTOPT_CAP_SPILLS", 16))
    assert tiles.CAP_STEP == int(os.environ.get("FTOPT_CAP_STEP", 0))


def test_an_uncapped_kernel_compiles_once(monkeypatch):
    monkeypatch.setattr(tiles, "INTERPRETING", False)
    kernel = _Kernel(lambda cap: 500)
    launch._launch(kernel, (3,), [object()], (("BLOCK", 256), ("num_warps", 1)),
                   torch.device("cpu"), ("spills",))
    assert kernel.warmups == [] and len(kernel.launches) == 1


@pytest.mark.parametrize("skip", [False, True])
def test_a_long_8bit_chain_fused_matches_eager(skip):
    """The chain that ptxas miscompiled at its cap: each param within 2 ulps of eager's
    (bf16 ulps of the largest of the param before the step, after it, and the step: where
    a param crosses zero the step is the larger), each code within one step."""
    gen = fresh_generator()
    seed = gen.initial_seed()
    links = [ftopt.scale_by_ademamix(b1=0.999, b2=0.0, b3=0.876, alpha=9.3, eps=1e-3,
                                     eps_root=6.6e-7),
             ftopt.identity(), ftopt.scale_by_adadelta(rho=0.81, eps=1.9e-6),
             ftopt.scale_by_amsgrad(b1=0.35, b2=0.053, eps=1.1e-5, eps_root=4.1e-7,
                                    bias_correction_mu=False, bias_correction_nu=False)]
    tx = ftopt.quantize_states(ftopt.chain(*links, *([ftopt.skip_zeros()] if skip else [])),
                               8, min_size=1)
    params = {"w": torch.randn(2, 260, generator=gen).to(DEVICE, torch.bfloat16)}
    g = torch.randn(2, 260, generator=gen) * (torch.rand(2, 260, generator=gen) > 0.3)
    grads = {"w": g.to(DEVICE, torch.bfloat16)}
    state = tx.init(params)
    pf, sf = ftopt.step(tx, params, grads, state, backend="fused")
    pe, se = ftopt.step(tx, params, grads, state, backend="eager")
    before, after, fused = (x["w"].float() for x in (params, pe, pf))
    largest = torch.stack([before.abs(), after.abs(), (after - before).abs()]).amax(0)
    far = (fused - after).abs() > 2 * torch.finfo(torch.bfloat16).eps * largest
    assert not far.any(), f"seed {seed}: {int(far.sum())} of 520 elements > 2 ulps apart"
    codes = [(a, b) for a, b in zip(ftopt.tree.leaves(sf), ftopt.tree.leaves(se))
             if a.dtype == torch.uint8]
    assert len(codes) == 8
    for i, (a, b) in enumerate(codes):
        far = int(((a.int() - b.int()).abs() > 1).sum())
        assert far == 0, f"state {i}: {far} codes more than one step from eager's"
