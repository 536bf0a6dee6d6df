"""Regressions the fuzz found (``tests/test_fuzz.py``, ``benchmarks/fuzz.py``), each
replayed from its pinned structure (``tests/fuzz_pins.py``) on this machine's backend:
the Triton interpreter on a CPU, the kernels themselves on a GPU."""

from __future__ import annotations

import fuzz_checks as checks
import optree
import pytest
import torch
from fuzz_cases import Structure
from fuzz_pins import pinned

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.skipif(DEVICE != "cpu", reason="the Triton interpreter runs on the CPU only")
@pytest.mark.parametrize("wd", [1e-40, 1e-149])
def test_tiny_hyperparameter_in_the_interpreter(wd):
    """Found by the fuzz (b1 and weight_decay ~1e-149 in an AdEMAMix/rss chain): a
    hyperparameter inside its domain but below fp32's smallest normal. Triton types such
    a Python float as an fp64 argument; the fused path passes the per-step scalars as an
    fp32 buffer then."""
    import ftopt

    gen = torch.Generator().manual_seed(3)
    p = {"w": torch.randn(8, generator=gen)}
    g = {"w": torch.randn(8, generator=gen)}
    tx = ftopt.chain(ftopt.add_decayed_weights(wd), ftopt.scale_by_rss(0.1, 1e-7))
    fused, _ = ftopt.step(tx, p, g, tx.init(p), backend="fused")
    eager, _ = ftopt.step(tx, p, g, tx.init(p), backend="eager")
    torch.testing.assert_close(fused, eager, rtol=1e-6, atol=0)


def test_stddev_variance_cancels_alike_on_every_backend():
    """Found by the H200's fuzz (seed 86 example 1840: ... -> scale_by_sign ->
    scale_by_stddev with bias correction, fp16 states). After the sign the inputs are
    exact, and the variance n̂ − m̂² cancels: fused rounded m̂ = mu/bc as mu·(1/bc),
    eager divides, and the cancellation magnified that ulp to 1.3e-5 (fused 14x farther
    from float64 than eager). The variance is now (nu·bc − mu²)/bc², whose cancelling
    terms are products every backend rounds alike; the whole contract holds."""
    import ftopt

    case = pinned(86, 1840, DEVICE)
    assert {k: v for k, v in checks.run_all(case).items() if v} == {}
    for decay in (0.048, 0.3):  # mostly one sign: n̂ − m̂² ≪ n̂, often 0 (before: 0.27 apart)
        gen = torch.Generator().manual_seed(15)
        p = {"w": torch.randn(4096, generator=gen).to(DEVICE)}
        tx = ftopt.chain(ftopt.scale_by_sign(),
                         ftopt.scale_by_stddev(decay, 1e-8, bias_correction=True))
        s_f = s_e = tx.init(p)
        for _ in range(4):
            g = {"w": (torch.randn(4096, generator=gen) + 1.5).to(DEVICE)}
            u_f, s_f = tx.update(g, s_f, p, backend="fused")
            u_e, s_e = tx.update(g, s_e, p, backend="eager")
            torch.testing.assert_close(u_f["w"], u_e["w"], rtol=1e-6, atol=0)


@pytest.mark.skipif(DEVICE != "cpu", reason="the Triton interpreter runs on the CPU only")
def test_seed94_case516_nan_params_keep_their_bits_where_skipped():
    """Found by the CPU fuzz (seed 94, example 516): normalize's 0/0 after ADOPT's zero
    first update makes 16-bit params NaN, and the next step's zero-gradient elements came
    back as other NaNs (fp16 0xFE00 as 0x7FFF: torch's CPU conversion to fp32 and back).
    A NaN param now keeps its bits through ``p + u``; the whole contract holds."""
    case = pinned(94, 516, "cpu")
    assert {k: v for k, v in checks.run_all(case).items() if v} == {}


def test_seed165_case27_a_16bit_leaf_passed_through_a_segment_reaches_the_next_as_fp32():
    """Found by the CPU fuzz (seed 165, example 27; 10 of its 494 examples): a decay
    masked to matrices in front of Muon, fp16 params. The segment before Muon's matrix
    stage passed the 1-D leaf through and cast its update back to fp16, as an update's
    output is; the last segment read it as fp32, past the tensor's bytes (fused params
    and Adam moments from memory no one wrote). Segment outputs now stay fp32
    (``tests/test_muon_fused.py`` checks each such chain at each dtype)."""
    case = pinned(165, 27, DEVICE)
    assert {k: v for k, v in checks.run_all(case).items() if v} == {}


@pytest.mark.parametrize("index", [508, 150])
def test_seed110_a_global_norm_sums_its_leaves_in_the_same_order_with_skip_zeros(index):
    """Found by the CPU fuzz (seed 110, examples 150 and 508): a global norm's sum over
    the leaves' rows took the rows where each group's padding put them, and the
    skip_zeros chain's extra reduction padded them differently, so its params and states
    differed from the plain chain's by a few ulps off the zeros. The sum now runs in the
    leaves' order in the tree."""
    case = pinned(110, index, DEVICE)
    assert checks.run_all(case)["skip_zeros"] is None


def test_seed197_a_sum_that_cancels_is_checked_against_float64():
    """Found by the CPU fuzz (seed 197, example 768): a snapshot's sum of the updates
    (nine near 0.4 that cancel to -7.09e-4) 5e-4 from eager's, relative; fused is no
    farther from float64 than eager's draws are (``fuzz_checks._as_near_float64_as_moved``)."""
    case = pinned(197, 768, DEVICE)
    assert case.structure.tensors and case.structure.parts[2].name == "snapshot"
    assert checks.run_all(case)["fused_vs_eager"] is None


def test_seed210_fp16_state_subnormals_eager_scatters_over_pass():
    """Found by the CPU fuzz (seed 210, example 318): Muon, cautious decay, Adan and
    decay with fp16 states; twelve subnormal elements of Adan's state beyond an ulp."""
    case = pinned(210, 318, DEVICE)
    assert case.structure.state_dtype == "float16"
    assert checks.run_all(case)["fused_vs_eager"] is None


def test_seed213_soaps_bases_agree_in_sign_between_backends():
    """Found by the CPU fuzz (seed 213, example 639): SOAP's eigenbasis of one leaf had
    two columns negated between fused and eager (``eigh`` of factors 1.7e-7 apart); the
    update was the same, the state not. The bases are signed
    (``ftopt.transforms.soap._signed``)."""
    case = pinned(213, 639, DEVICE)
    assert case.structure.parts[2].name == "scale_by_soap"
    assert checks.run_all(case)["fused_vs_eager"] is None


def test_seed219_eagers_draws_move_the_8bit_absmax():
    """Found by the CPU fuzz (seed 219, example 631): NorMuon's row moments 7e-6 apart
    between fused and eager, after Newton-Schulz amplified a rounding of Muon's momentum,
    where eager's draws had not moved at all (every elementwise state 8-bit, Rprop's signs
    before). The draws move each 8-bit slot's absmax by up to an ulp too, and its codes
    not."""
    case = pinned(219, 631, DEVICE)
    assert checks.run_all(case)["fused_vs_eager"] is None
    slot = checks.QuantizedSlot(torch.tensor([3, 250], dtype=torch.uint8),
                                torch.tensor([0.5, 2.0]))
    moved = checks._jitter32([slot], torch.Generator().manual_seed(0), False)[0]
    assert torch.equal(moved.codes, slot.codes) and not torch.equal(moved.absmax, slot.absmax)
    assert torch.allclose(moved.absmax, slot.absmax, rtol=2e-7, atol=0)


def test_seed207_a_tiny_element_eager_scatters_over_passes():
    """Found by the CPU fuzz (seed 207, example 482): NorMuon with bf16 params, one
    element beyond an ulp at -4.6e-8 (:func:`fuzz_checks._only`)."""
    case = pinned(207, 482, DEVICE)
    assert case.structure.parts[0].name == "normuon"
    assert checks.run_all(case)["fused_vs_eager"] is None


def test_seed106_lambs_norm_is_of_the_u_it_scales():
    """Found by the H100's fuzz (seed 106, example 3544): LAMB with 8-bit states, a
    one-element fp16 leaf whose u cancels 33-fold; fused 2.2e-6 from float64 (eager 3e-8)
    since the reduction kernel took the norm of u with the correctly rounded square root
    and division, and the main kernel scaled the fast-math u by it. On a CPU the two
    round alike; ``test_state_dtype.py`` checks the sources."""
    case = pinned(106, 3544, DEVICE)
    assert case.structure.parts[0].name == "lamb"
    assert checks.run_all(case)["fused_vs_eager"] is None


def test_seed226_a_comparison_the_draws_did_not_settle_takes_more(monkeypatch):
    """Found by the CPU fuzz (seed 226, example 840): SM3's accumulator after a
    bias-corrected stddev whose variance cancels, fused 2.7e-5 from eager. Of 64 draws of
    eager, 25 land near fused's value and 39 near eager's; the first eight all near
    eager's. A comparison the draws do not settle takes 32 (``Reference.more_draws``); with
    eight only, the case fails on the CPU."""
    case = pinned(226, 840, DEVICE)
    assert case.structure.parts[3].name == "scale_by_sm3"
    assert checks.run_all(case)["fused_vs_eager"] is None
    if DEVICE == "cpu":
        monkeypatch.setattr(checks.Reference, "MORE32", checks.Reference.DRAWS32)
        assert "relative error" in checks.run_all(case)["fused_vs_eager"]


def test_seed330_a_comparison_the_draws_did_not_settle_takes_more_float64_draws(monkeypatch):
    """Found by the CPU fuzz (seed 330, example 640): NorMuon's row moments 4.8e-6 apart,
    relative, between fused and eager, bf16 params through Muon's momentum into
    Newton-Schulz. Eager's draws move nothing there (the params stay bf16 and the first
    step's gradients are zero), so the float64 spread is the only measure: its two draws
    put fused 1.5 times past the bound, and a comparison they do not settle takes eight
    (``Reference.more_draws``)."""
    case = pinned(330, 640, DEVICE)
    assert case.structure.parts[2].name == "scale_by_normuon"
    assert checks.run_all(case)["fused_vs_eager"] is None
    if DEVICE == "cpu":
        monkeypatch.setattr(checks.Reference, "MORE", checks.Reference.DRAWS)
        assert "relative error" in checks.run_all(case)["fused_vs_eager"]


def test_seed248_a_nan_factor_is_no_lapack_error():
    """Found by the CPU fuzz (seed 248, examples 234 and 271): the first step's
    gradients all zero, ``normalize`` made them NaN (0/0) and SOAP's ``eigh`` raised on
    the NaN factors in the chain without skip_zeros, on both backends. Those factors now
    get NaN bases (``ftopt.matrix.decompose_finite``); skip_zeros' check then holds."""
    case = pinned(248, 234, DEVICE)
    assert case.structure.parts[3].name == "scale_by_soap"
    assert all(bool((g == 0).all()) for g in optree.tree_leaves(case.grads[0]))
    results = checks.run_all(case)
    assert all(m is None for m in results.values()), results


def test_seed268_a_norm_after_a_nan_holds_the_zeros_exact(monkeypatch):
    """Found by the CPU fuzz (seed 268, four examples of one structure, any dtype):
    set_to_zero -> a block norm -> DoG -> normalize -> skip_zeros() -> AdEMAMix. DoG's
    state went NaN, so its update at a zero gradient was 0·NaN = NaN in the plain chain
    and 0 with skip_zeros; each chain's global norm then read other NaNs and came out a
    NaN of the other sign (0xFFC00000 against 0x7FC00000 on the CPU), and so did every
    param off the zeros. SPEC §3 lets a norm differ where it reads what skip_zeros
    masked; with a non-finite value in play a stage that keeps zeros no longer does, so
    the check holds such chains (a norm or matrix stage, ``Structure.reads_others``)
    exact at the zeros only. Off the zeros they are compared as before where every value
    is finite."""
    case = pinned(268, 1551, DEVICE)
    assert case.structure.reads_others and case.structure.exact_off_zeros
    assert checks.run_all(case)["skip_zeros"] is None
    if DEVICE == "cpu":  # (the control; a GPU's arithmetic gives one NaN, the same bits)
        monkeypatch.setattr(Structure, "reads_others", property(lambda self: False))
        assert "differs from the plain chain off the zeros" in \
            checks.run_all(case)["skip_zeros"]
