"""Tests for ftopt.quant: dynamic maps and 8-bit blockwise quantization."""

from __future__ import annotations

import importlib.util
import math
import pathlib

import pytest
import torch

try:
    from ftopt import quant
except Exception:  # package __init__ missing or broken: load the module by path
    _path = pathlib.Path(__file__).resolve().parents[1] / "ftopt" / "quant.py"
    _spec = importlib.util.spec_from_file_location("ftopt_quant_under_test", _path)
    quant = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(quant)

SIGNED = quant.create_dynamic_map(signed=True)
UNSIGNED = quant.create_dynamic_map(signed=False)
MAPS = {"signed": SIGNED, "unsigned": UNSIGNED}
SIZES = [0, 1, 255, 256, 257, 4097]
ZERO_CODE = {"signed": 127, "unsigned": 0}
F32_EPS = 2.0**-24


def _data(kind: str, n: int, signed: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        x = torch.randn(n, generator=g)
    elif kind == "uniform":
        x = torch.rand(n, generator=g) * 2 - 1
    elif kind == "heavy":  # magnitudes over ~20 decades
        x = torch.sign(torch.randn(n, generator=g)) * torch.exp(5 * torch.randn(n, generator=g))
    elif kind == "sparse":
        x = torch.randn(n, generator=g) * (torch.rand(n, generator=g) < 0.1)
    else:
        raise AssertionError(kind)
    return x.abs() if not signed else x


def _assert_close(actual: torch.Tensor, expected: list[float], rtol: float = 1e-6) -> None:
    expected_t = torch.tensor(expected, dtype=torch.float64)
    assert actual.shape == expected_t.shape
    assert bool(((actual.double() - expected_t).abs() <= rtol * expected_t.abs()).all()), actual


def _brute_force_codes(v: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """argmin_k fl32(|v - q_k|) over all codes; torch.argmin takes the first minimum."""
    return (v.reshape(-1, 1) - qmap.reshape(1, -1)).abs().argmin(dim=1)


def _reference_quantize(x: torch.Tensor, qmap: torch.Tensor, block_size: int):
    """Block by block with a Python loop over blocks and brute-force nearest codes."""
    flat = x.reshape(-1).float()
    codes, absmax = [], []
    for start in range(0, flat.numel(), block_size):
        block = flat[start : start + block_size]
        a = block.abs().max()
        v = (block / a).clamp(-1, 1) if a > 0 else torch.zeros_like(block)
        codes.append(_brute_force_codes(v, qmap))
        absmax.append(a)
    if not codes:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0)
    return torch.cat(codes), torch.stack(absmax)


# ----------------------------------------------------------------------------- maps


def test_signed_map_properties():
    q = SIGNED
    assert q.dtype == torch.float32 and q.shape == (256,)
    assert bool((q.diff() > 0).all()), "sorted with no duplicates"
    assert (q < 0).sum() == 127 and (q == 0).sum() == 1 and (q > 0).sum() == 128
    assert q[127] == 0 and q[-1] == 1.0 and q.min() == torch.tensor(-0.99296875)
    assert not bool((q == -1.0).any()), "asymmetric: +1.0 present, -1.0 absent"
    _assert_close(q[[126, 128]], [-5.5e-7, 5.5e-7])
    _assert_close(q[[63, 127, 191]], [-0.10703125, 0.0, 0.10703125])
    assert torch.equal(q[:127], -q[128:255].flip(0)), "negatives mirror the positives"


def test_unsigned_map_properties():
    q = UNSIGNED
    assert q.dtype == torch.float32 and q.shape == (256,)
    assert bool((q.diff() > 0).all())
    assert q[0] == 0 and bool((q[1:] > 0).all()) and q[-1] == 1.0
    _assert_close(q[[1, 63, 127, 191]], [3.25e-7, 0.010703125, 0.103515625, 0.553515625])


@pytest.mark.parametrize("signed", [True, False])
def test_map_matches_closed_form(signed):
    # Midpoint of bin j of 2**(i + [unsigned]) bins over [0.1, 1], times 10**(i - 6).
    expected = []
    for i in range(7):
        bins = 2 ** (i + (0 if signed else 1))
        expected += [(0.1 + 0.9 * (j + 0.5) / bins) * 10.0 ** (i - 6) for j in range(bins)]
    positives = (SIGNED[128:255] if signed else UNSIGNED[1:255]).double()
    _assert_close(positives, sorted(expected))


def test_map_bits_pinned():
    # bitsandbytes builds the map in float32 arithmetic (linspace, midpoints, scaling);
    # doing the scaling in float64 changes 30 signed / 38 unsigned entries by one ulp.
    # The checksums (sum of the int32 bit patterns) pin every entry.
    assert SIGNED.view(torch.int32).long().sum().item() == -10154226044
    assert UNSIGNED.view(torch.int32).long().sum().item() == 262570225560
    assert SIGNED[65].item() == -0.09578125923871994
    assert UNSIGNED[4].item() == 4.374999662104528e-06


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("exponent_bits,total_bits", [(7, 8), (5, 8), (3, 4), (1, 2)])
def test_map_other_sizes(signed, exponent_bits, total_bits):
    q = quant.create_dynamic_map(signed, exponent_bits, total_bits)
    assert q.shape == (2**total_bits,) and bool((q.diff() >= 0).all())
    assert q.max() == 1.0 and (q.min() < 0) == signed


def test_map_rejects_bad_arguments():
    with pytest.raises(ValueError):
        quant.create_dynamic_map(True, 8, 8)
    with pytest.raises(ValueError):
        quant.create_dynamic_map(True, 7, 9)


def test_dynamic_map_is_cached_per_device():
    a = quant.dynamic_map(True, "cpu")
    assert a is quant.dynamic_map(True, torch.device("cpu"))
    assert torch.equal(a, SIGNED) and torch.equal(quant.dynamic_map(False, "cpu"), UNSIGNED)
    assert quant.dynamic_map(False, "cpu") is not a


# ----------------------------------------------------------------------- quantizer


@pytest.mark.parametrize("name", ["signed", "unsigned"])
@pytest.mark.parametrize("kind", ["normal", "uniform", "heavy", "sparse"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("block_size", [256, 64])
def test_matches_brute_force_and_error_bound(name, kind, n, block_size):
    qmap = MAPS[name]
    x = _data(kind, n, name == "signed", seed=n + 7 * block_size)
    codes, absmax = quant.quantize_blockwise(x, qmap, block_size)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert absmax.dtype == torch.float32 and absmax.shape == (math.ceil(n / block_size),)

    ref_codes, ref_absmax = _reference_quantize(x, qmap, block_size)
    assert torch.equal(absmax, ref_absmax), "absmax = max|x| per block, partial last block"
    assert torch.equal(codes.long(), ref_codes), "nearest code, ties to the lower index"

    # |x_hat - x| <= (half the gap between the codes bracketing x/absmax) * absmax.
    x_hat = quant.dequantize_blockwise(codes, absmax, qmap, block_size)
    assert x_hat.dtype == torch.float32 and x_hat.shape == x.shape
    assert not bool(x_hat.isnan().any())
    a = absmax.double().repeat_interleave(block_size)[:n]
    v = torch.where(a > 0, x.double() / a.clamp_min(1e-300), torch.zeros_like(a))
    q = qmap.double()
    hi = torch.searchsorted(q, v).clamp(1, 255)
    half_gap = (q[hi] - q[hi - 1]) / 2
    outside = torch.clamp(q[0] - v, min=0) + torch.clamp(v - q[-1], min=0)
    bound = torch.where(outside > 0, outside, half_gap) * a + 4 * F32_EPS * a
    assert bool(((x_hat.double() - x.double()).abs() <= bound).all())


@pytest.mark.parametrize("name", ["signed", "unsigned"])
def test_exact_ties_go_to_lower_index(name):
    qmap = MAPS[name]
    q = qmap.double()
    mids = (q[:-1] + q[1:]) / 2
    exact = mids.float().double() == mids  # midpoints representable in float32
    lower = torch.arange(255)[exact]
    assert lower.numel() > 100, "enough exact ties to make the test meaningful"
    v = mids[exact].float()
    assert torch.equal(quant.nearest_code(v, qmap).long(), lower)
    assert torch.equal(_brute_force_codes(v, qmap), lower), "brute force agrees on the rule"
    # Through the blockwise path: the block's absmax is a power of two, so x/absmax == v.
    scale = 2.0**-5
    x = torch.cat([torch.tensor([scale]), v * scale])
    codes, absmax = quant.quantize_blockwise(x, qmap, block_size=x.numel())
    assert absmax.item() == scale
    assert torch.equal(codes[1:].long(), lower)


@pytest.mark.parametrize("name", ["signed", "unsigned"])
def test_near_midpoints_match_brute_force(name):
    # Every float32 within 64 ulps of each midpoint: pins the float32-distance rule. A
    # bucketize against float32 midpoints (bitsandbytes' default backend) differs on ~50
    # of these values per map, picking the farther code.
    qmap = MAPS[name]
    bits = ((qmap[:-1] + qmap[1:]) / 2).view(torch.int32)
    v = torch.cat([(bits + d).view(torch.float32) for d in range(-64, 65)])
    assert torch.equal(quant.nearest_code(v, qmap).long(), _brute_force_codes(v, qmap))


@pytest.mark.parametrize("name", ["signed", "unsigned"])
def test_every_code_value_and_the_ends(name):
    qmap = MAPS[name]
    assert torch.equal(quant.nearest_code(qmap, qmap).long(), torch.arange(256))
    ends = torch.tensor([-1.0, -0.999, 1.0, 2.0, -0.0])
    expected = [0, 0, 255, 255, ZERO_CODE[name]]
    assert quant.nearest_code(ends, qmap).tolist() == expected


@pytest.mark.parametrize("name", ["signed", "unsigned"])
def test_all_zero_blocks(name):
    qmap = MAPS[name]
    x = torch.randn(3 * 256 + 10).abs()
    x[256:512] = 0.0
    x[768:] = -0.0  # partial last block of negative zeros
    codes, absmax = quant.quantize_blockwise(x, qmap)
    assert absmax[1] == 0 and absmax[3] == 0
    assert bool((codes[256:512] == ZERO_CODE[name]).all())
    assert bool((codes[768:] == ZERO_CODE[name]).all())
    x_hat = quant.dequantize_blockwise(codes, absmax, qmap)
    assert not bool(x_hat.isnan().any())
    assert bool((x_hat[256:512] == 0).all()) and bool((x_hat[768:] == 0).all())

    zeros = torch.zeros(5, 7)
    codes, absmax = quant.quantize_blockwise(zeros, qmap, block_size=16)
    assert bool((codes == ZERO_CODE[name]).all()) and bool((absmax == 0).all())
    assert torch.equal(quant.dequantize_blockwise(codes, absmax, qmap, 16), zeros)
    # A zero absmax handed to the per-element step also encodes to the code of 0.
    c = quant.encode_with_absmax(torch.tensor([0.5, -2.0]), torch.zeros(2), qmap)
    assert c.tolist() == [ZERO_CODE[name]] * 2


@pytest.mark.parametrize("name", ["signed", "unsigned"])
@pytest.mark.parametrize("power_of_two", [True, False])
def test_representable_blocks_round_trip_bit_exactly(name, power_of_two):
    qmap = MAPS[name]
    g = torch.Generator().manual_seed(3)
    n, block_size = 1000, 256
    codes = torch.randint(0, 256, (n,), generator=g)
    codes[::block_size] = 255  # every block holds the code 1.0, so its absmax is the scale
    num_blocks = math.ceil(n / block_size)
    if power_of_two:
        scales = 2.0 ** torch.randint(-20, 20, (num_blocks,), generator=g).float()
    else:
        scales = torch.rand(num_blocks, generator=g) * 100 + 1e-3
    x = quant.dequantize_blockwise(codes.to(torch.uint8), scales, qmap, block_size)
    codes2, absmax2 = quant.quantize_blockwise(x, qmap, block_size)
    assert torch.equal(absmax2, scales)
    assert torch.equal(codes2.long(), codes)
    assert torch.equal(quant.dequantize_blockwise(codes2, absmax2, qmap, block_size), x)


@pytest.mark.parametrize("n", SIZES)
def test_idempotent_when_block_peak_is_positive(n):
    for name, qmap in MAPS.items():
        x = _data("heavy", n, name == "signed", seed=n)
        # Make each block's largest-magnitude element positive (always true when unsigned).
        for start in range(0, n, 256):
            block = x[start : start + 256]
            k = block.abs().argmax()
            block[k] = block[k].abs()
        codes, absmax = quant.quantize_blockwise(x, qmap)
        x_hat = quant.dequantize_blockwise(codes, absmax, qmap)
        codes2, absmax2 = quant.quantize_blockwise(x_hat, qmap)
        assert torch.equal(codes2, codes) and torch.equal(absmax2, absmax)


def test_negative_peak_shrinks_absmax_on_requantization():
    # Documented consequence of the signed map lacking -1.0 (see the module docstring).
    x = torch.tensor([-2.0, 0.5, 1.0, -0.25])
    codes, absmax = quant.quantize_blockwise(x, SIGNED)
    assert codes[0] == 0 and absmax.item() == 2.0
    x_hat = quant.dequantize_blockwise(codes, absmax, SIGNED)
    _, absmax2 = quant.quantize_blockwise(x_hat, SIGNED)
    assert absmax2.item() == (SIGNED[0].abs() * 2.0).item() < 2.0


def test_shapes_dtypes_and_layouts():
    x = torch.randn(33, 20)
    codes, absmax = quant.quantize_blockwise(x, SIGNED, block_size=256)
    assert codes.shape == (33, 20) and absmax.shape == (3,)
    codes_t, absmax_t = quant.quantize_blockwise(x.t(), SIGNED)
    ref_t, ref_absmax_t = quant.quantize_blockwise(x.t().contiguous(), SIGNED)
    assert torch.equal(codes_t, ref_t) and torch.equal(absmax_t, ref_absmax_t)
    x_bf16 = x.to(torch.bfloat16)
    got = quant.quantize_blockwise(x_bf16, SIGNED)
    want = quant.quantize_blockwise(x_bf16.float(), SIGNED)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    scalar_codes, scalar_absmax = quant.quantize_blockwise(torch.tensor(-3.0), SIGNED)
    assert scalar_codes.shape == () and scalar_absmax.tolist() == [3.0]
    empty_codes, empty_absmax = quant.quantize_blockwise(torch.zeros(0, 4), SIGNED)
    assert empty_codes.shape == (0, 4) and empty_absmax.shape == (0,)
    assert quant.dequantize_blockwise(empty_codes, empty_absmax, SIGNED).shape == (0, 4)
    # Deterministic.
    again = quant.quantize_blockwise(x, SIGNED)
    assert torch.equal(again[0], codes) and torch.equal(again[1], absmax)


def test_encode_with_absmax_matches_blockwise_path():
    x = torch.randn(600)
    codes, absmax = quant.quantize_blockwise(x, SIGNED)
    per_element = quant.expand_absmax(absmax, x.numel())
    assert torch.equal(quant.encode_with_absmax(x, per_element, SIGNED), codes)
    # An absmax smaller than |x| clamps to the end codes instead of overflowing.
    clamped = quant.encode_with_absmax(torch.tensor([5.0, -5.0]), torch.tensor(1.0), SIGNED)
    assert clamped.tolist() == [255, 0]


def test_rejects_bad_arguments():
    codes, absmax = quant.quantize_blockwise(torch.randn(300), SIGNED)
    with pytest.raises(ValueError):
        quant.dequantize_blockwise(codes, absmax[:1], SIGNED)
    with pytest.raises(ValueError):
        quant.quantize_blockwise(torch.randn(3), SIGNED, block_size=0)
