"""What a NaN or Inf gradient does: the same on every backend, 32-bit and 8-bit states.

The policy (README, "Errors and guarantees"): a non-finite gradient element makes its
param element non-finite (as in ``torch.optim``), with 32-bit states its own states too,
and nothing else, except through norms (a norm over a non-finite value is non-finite).
With 8-bit states a block's absmax is its largest finite magnitude, a NaN state is
stored as 0 and +-Inf as +-absmax, so the block's other elements keep finite states.
"""

from __future__ import annotations

import pytest
import torch
from registry import TRANSFORMS, standalone
from step_checks import fresh_generator

import ftopt

BAD = {"nan": float("nan"), "inf": float("inf"), "-inf": -float("inf")}
BACKENDS = ["eager", "fused"]
# The fused path runs on the GPU where there is one (the interpreter otherwise).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _leaves(tree):
    out = []
    for leaf in ftopt.tree.leaves(tree):
        out += [leaf.codes, leaf.absmax] if hasattr(leaf, "codes") else [leaf]
    return out


def _run(tx, params, grads_list, backend):
    state = tx.init(params)
    for grads in grads_list:
        params, state = ftopt.step(tx, params, grads, state, backend=backend)
    return params, state


def _agree(a, b) -> bool:
    """Fused and eager: non-finite in the same elements, finite ones within fp32
    rounding (SPEC §6), 8-bit codes and step counts identical."""
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    finite = torch.isfinite(a)
    return (torch.equal(finite, torch.isfinite(b))
            and torch.equal(a[~finite].isnan(), b[~finite].isnan())
            and torch.allclose(a[finite], b[finite], rtol=1e-6, atol=1e-7))


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("bits", [32, 8])
def test_a_non_finite_gradient_stays_in_its_element(bad, bits):
    torch.manual_seed(0)
    n, at = 4096, 300  # element 300 sits in block 1 of 16
    params = {"w": torch.randn(n, device=DEVICE), "b": torch.randn(7, device=DEVICE)}
    grads = [{"w": torch.randn(n, device=DEVICE), "b": torch.randn(7, device=DEVICE)}
             for _ in range(3)]
    grads[0]["w"][at] = BAD[bad]
    tx = ftopt.adamw(1e-2, weight_decay=0.1, state_bits=bits)
    results = {b: _run(tx, params, grads, b) for b in BACKENDS}
    p, state = results["eager"]
    w = p["w"]
    assert not torch.isfinite(w[at])
    assert torch.isfinite(w[:at]).all() and torch.isfinite(w[at + 1:]).all()
    assert torch.isfinite(p["b"]).all()
    adam_state = state[0]
    for slot in (adam_state.mu["w"], adam_state.nu["w"]):
        if bits == 8:
            assert torch.isfinite(slot.absmax).all()
            qmap_signed = slot is adam_state.mu["w"]
            decoded = ftopt.quant.dequantize_blockwise(
                slot.codes, slot.absmax, ftopt.quant.dynamic_map(qmap_signed, DEVICE))
            assert torch.isfinite(decoded).all()
        else:
            others = torch.cat([slot[:at], slot[at + 1:]])
            assert torch.isfinite(others).all() and not torch.isfinite(slot[at])
    # Both backends agree, in which elements are non-finite too.
    eager_leaves = _leaves(results["eager"])
    fused_leaves = _leaves(results["fused"])
    assert len(eager_leaves) == len(fused_leaves)
    assert all(_agree(a, b) for a, b in zip(eager_leaves, fused_leaves))


@pytest.mark.parametrize("bad", list(BAD))
def test_eight_bit_non_finite_state_is_encoded_by_the_rule(bad):
    """NaN -> the code of 0, +-Inf -> the code of +-1; absmax over finite values."""
    qmap = ftopt.quant.dynamic_map(True)
    x = torch.randn(512)
    x[7] = BAD[bad]
    codes, absmax = ftopt.quant.quantize_blockwise(x, qmap)
    finite_max = torch.cat([x[:7], x[8:256]]).abs().max()
    assert absmax[0] == finite_max and torch.isfinite(absmax).all()
    want = {"nan": 0.0, "inf": 1.0, "-inf": -1.0}[bad]
    assert codes[7] == ftopt.quant.nearest_code(torch.tensor([want]), qmap)[0]
    # The other elements are encoded as if the bad one were absent.
    clean = x.clone()
    clean[7] = 0.0
    clean_codes, clean_absmax = ftopt.quant.quantize_blockwise(clean, qmap)
    assert torch.equal(absmax, clean_absmax)
    assert torch.equal(torch.cat([codes[:7], codes[8:]]),
                       torch.cat([clean_codes[:7], clean_codes[8:]]))


def test_eight_bit_block_without_finite_magnitudes_codes_zero_on_every_backend():
    """A block whose new states are all Inf, NaN or 0 has absmax 0, and every element
    the code of 0 (not +-1 for the infinities): the fused encoder's codes are eager's."""
    tx = ftopt.adam(1e-3, state_bits=8)
    gen = fresh_generator()
    params = {"w": torch.randn(4096, generator=gen).to(DEVICE)}
    grads = {"w": torch.randn(4096, generator=gen).to(DEVICE)}
    grads["w"][:256] = float("inf")  # a block of infinities
    grads["w"][256:384] = -float("inf")  # one of infinities, NaN and zeros
    grads["w"][384:448] = float("nan")
    grads["w"][448:512] = 0.0
    out = {b: _run(tx, params, [grads], b) for b in BACKENDS}
    for name in ("mu", "nu"):
        eager, fused = (getattr(out[b][1][0], name)["w"] for b in BACKENDS)
        assert torch.equal(eager.absmax[:2].cpu(), torch.zeros(2))
        zero = ftopt.quant.nearest_code(torch.zeros(1), ftopt.quant.dynamic_map(
            name == "mu"))[0]
        assert (eager.codes[:512].cpu() == zero).all()
        assert torch.equal(fused.codes.cpu(), eager.codes.cpu()), name
        assert (eager.codes[512:].cpu() != zero).any()  # (other blocks are not zero)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_global_norm_over_a_non_finite_gradient_is_non_finite(backend):
    """The documented exception: a norm sees every element, so a NaN reaches every leaf
    scaled by it (clip_grad_norm_ in torch does the same)."""
    torch.manual_seed(1)
    params = {"w": torch.randn(64, device=DEVICE), "b": torch.randn(8, device=DEVICE)}
    grads = {"w": torch.randn(64, device=DEVICE), "b": torch.randn(8, device=DEVICE)}
    grads["w"][3] = float("nan")
    tx = ftopt.chain(ftopt.clip_by_global_norm(1.0), ftopt.sgd(0.1))
    p, _ = _run(tx, params, [grads], backend)
    assert not torch.isfinite(p["b"]).any()


# Quiet NaNs, with and without payloads and signs: those arithmetic makes (a signalling
# NaN, made only by writing its bits, may come back quieted from a fused kernel).
NAN_BITS = {torch.float16: [0xFE00, 0x7E01, 0x7FFF, 0xFFFF],
            torch.bfloat16: [0xFFC1, 0x7FC0, 0x7FFF, 0xFFFF]}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ["eager", "fused"])
@pytest.mark.parametrize("bits", [32, 8])
@pytest.mark.parametrize("clip", [False, True])  # (the CPU's eager paths: elementwise
def test_a_nan_param_keeps_its_bits_where_its_gradient_is_zero(dtype, backend, bits, clip):
    # rules in one chunked pass; with a global norm, update + apply_updates)
    """skip_zeros keeps a param's bits where its gradient is zero, a NaN's too (whose
    bits torch's conversions of 16-bit floats to fp32 and back do not keep); the other
    elements step, and without skip_zeros the zero-gradient elements move too.

    The GPU's conversions and arithmetic give the canonical NaN: the fused kernels store
    the old bits of a NaN that stays a NaN."""
    gen = torch.Generator().manual_seed(31)
    w = torch.randn(4100, generator=gen).to(dtype)  # (8-bit states from 4096 elements)
    params = {"w": w.to(DEVICE)}
    nans = torch.tensor(NAN_BITS[dtype], dtype=torch.int32).to(torch.int16).to(DEVICE)
    g1 = {"w": torch.randn(4100, generator=gen).to(dtype).to(DEVICE)}
    g2 = {"w": torch.randn(4100, generator=gen).to(dtype).to(DEVICE)}
    zero = torch.zeros(4100, dtype=torch.bool, device=DEVICE)
    zero[:4] = zero[100:110] = True
    g2["w"][zero] = 0
    for skip in (True, False):
        tx = ftopt.adam(1e-2, skip_zeros=skip, state_bits=bits)
        if clip:
            tx = ftopt.chain(ftopt.clip_by_global_norm(1e3), ftopt.adam(1e-2, state_bits=bits),
                             *[ftopt.skip_zeros()] * skip)
        p, s = ftopt.step(tx, params, g1, tx.init(params), backend=backend)
        p["w"].view(torch.int16)[:4] = nans
        new, _ = ftopt.step(tx, p, g2, s, backend=backend)
        old_bits, new_bits = p["w"].view(torch.int16), new["w"].view(torch.int16)
        if skip:
            assert torch.equal(new_bits[zero], old_bits[zero])
            assert torch.isnan(new["w"][:4]).all()
        else:  # (adam's momentum moves them)
            assert not torch.equal(new_bits[100:110], old_bits[100:110])
        assert not torch.equal(new_bits[~zero], old_bits[~zero])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_apply_updates_keeps_a_nan_param_s_bits(dtype):
    """p + (-0.0), a skipped element's update, is p bit for bit, a NaN included."""
    bits = torch.tensor(NAN_BITS[dtype] + [0x3C00], dtype=torch.int32).to(torch.int16)
    p = bits.view(dtype).to(DEVICE)
    u = torch.tensor([-0.0, -0.0, -0.0, -0.0, 0.0], device=DEVICE)
    out = ftopt.apply_updates({"p": p}, {"p": u})["p"]
    assert torch.equal(out.view(torch.int16), p.view(torch.int16))


@pytest.mark.parametrize("name,backend", [(e.name, b) for e in TRANSFORMS
                                          for b in ("eager", "fused") if b == "eager"
                                          or e.fusible])
def test_a_non_finite_gradient_raises_nothing(name, backend):
    """Every registry entry as a standalone optimizer takes NaNs in two matrix leaves'
    gradients at its first step and Infs two steps later without an error (LAPACK's
    ``eigh`` and ``svd`` refuse such matrices: SOAP's and GaLore's decompositions, CPU
    fuzz seed 248), and comes out with the tree it was given; on the fused backend too
    where the entry fuses (its host logic reads no NaN it would refuse)."""
    gen = fresh_generator()
    shapes = {"big": (64, 80), "w": (7, 5), "b": (33,), "s": ()}
    # (drawn on the CPU, whose generator this is, then moved)
    params = {k: torch.randn(s, generator=gen).to(DEVICE) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen).to(DEVICE) for k, s in shapes.items()}
             for _ in range(3)]
    # (LAPACK raises for the small matrix; for (64, 80)'s factors it returns NaNs)
    grads[0]["w"][1, 2] = grads[0]["big"][3, 4] = float("nan")
    grads[2]["w"][0, 0], grads[2]["b"][5] = -float("inf"), float("inf")
    tx = standalone(name)
    p, state = params, tx.init(params)
    for g in grads:
        p, state = ftopt.step(tx, p, g, state, backend=backend)
    assert ftopt.tree.structure(p) == ftopt.tree.structure(params)
    assert [x.shape for x in ftopt.tree.leaves(p)] == [x.shape for x in
                                                       ftopt.tree.leaves(params)]
