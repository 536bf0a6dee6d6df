"""The bucket table that :func:`ftopt.quant.nearest_code` encodes through gives the codes
of the binary search (``_searched_code``, the tie rule of the module docstring) on every
value class where they could part: each bucket's two ends, each step threshold and its
float neighbours, every bf16 value, the midpoints between codes and their neighbours,
fresh random draws, and the special values. (All 2**32 patterns, both maps:
``benchmarks/quant_table_exhaustive.py``.)"""

from __future__ import annotations

import pytest
import torch
from step_checks import fresh_generator

from ftopt import quant


def _as_float(patterns: torch.Tensor) -> torch.Tensor:
    return quant._as_float(patterns)


def _probe_values(qmap: torch.Tensor, bits: int, thresholds: torch.Tensor,
                  g: torch.Generator) -> torch.Tensor:
    width = 1 << (32 - bits)
    start = torch.arange(1 << bits, dtype=torch.int64) * width
    ends = torch.cat([start, start + width - 1, start + width // 2])
    stepped = thresholds[~thresholds.isnan()]
    mids = (qmap[1:] + qmap[:-1]) / 2
    near = torch.cat([stepped, mids, qmap])
    bf16 = (torch.arange(1 << 16, dtype=torch.int32) << 16).view(torch.float32)
    specials = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), -float("inf"), 1e-45,
                             -1e-45, 1.1754944e-38, 3.4028235e38, -3.4028235e38])
    return torch.cat([
        _as_float(ends), near, torch.nextafter(near, torch.tensor(4.0)),
        torch.nextafter(near, torch.tensor(-4.0)), bf16, specials,
        torch.rand(1 << 18, generator=g) * 2 - 1,
        torch.randn(1 << 16, generator=g) * torch.logspace(-12, 2, 1 << 16),
    ])


def _dense_map() -> torch.Tensor:
    """A sorted map with codes 2**-10 apart near 1: buckets of 15 bits step twice."""
    return torch.sort(torch.cat([torch.linspace(-1, 0.74, 240),
                                 1 - torch.arange(16) * 2.0**-10])).values


@pytest.mark.parametrize("name", ["signed", "unsigned", "dense"])
def test_table_codes_equal_the_search(name):
    g = fresh_generator()
    qmap = _dense_map() if name == "dense" else quant.dynamic_map(name == "signed")
    table = quant._bucket_table(qmap)
    assert table is not None
    bits, _, thresholds = table
    v = _probe_values(qmap, bits, thresholds, g)
    want = quant._searched_code(v.contiguous(), qmap).to(torch.uint8)
    assert torch.equal(quant.nearest_code(v, qmap), want)
    # the table's own code (inf's for a NaN, which nearest_code patches) on the others
    assert v.isnan().any()
    finite = ~v.isnan()
    assert torch.equal(quant._table_code(v[finite], table), want[finite])


def test_the_dynamic_maps_bucket_widths():
    assert quant._bucket_table(quant.dynamic_map(True))[0] == 15
    assert quant._bucket_table(quant.dynamic_map(False))[0] == 16
    assert quant._bucket_table(_dense_map())[0] > 16


@pytest.mark.parametrize("signed", [True, False])
def test_nan_gets_the_searched_code(signed):
    qmap = quant.dynamic_map(signed)
    payloads = torch.tensor([0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFFC00000, 0xFF800001,
                             0xFFFFFFFF], dtype=torch.int64)
    v = _as_float(payloads)
    assert v.isnan().all()
    want = quant._searched_code(v, qmap).to(torch.uint8)
    assert torch.equal(quant.nearest_code(v, qmap), want)
    assert (want == qmap.numel() - 2).all()


def test_a_map_too_dense_for_any_table_is_searched():
    qmap = torch.sort(torch.cat([torch.linspace(-1, 0.9, 200),
                                 1 - torch.arange(56) * 2.0**-22])).values
    assert quant._bucket_table(qmap) is None
    g = fresh_generator()
    v = torch.cat([torch.rand(4096, generator=g) * 2 - 1, qmap,
                   torch.nextafter(qmap, torch.tensor(2.0))])
    assert torch.equal(quant.nearest_code(v, qmap),
                       quant._searched_code(v.contiguous(), qmap).to(torch.uint8))


def test_a_table_is_built_once_per_map_and_again_when_the_map_changes(monkeypatch):
    built = []
    original = quant._build_table
    monkeypatch.setattr(quant, "_build_table", lambda q: built.append(1) or original(q))
    qmap = _dense_map()
    g = fresh_generator()
    v = torch.rand(1000, generator=g) * 2 - 1
    first = quant.nearest_code(v, qmap)
    quant.nearest_code(v, qmap)
    assert len(built) == 1
    qmap.mul_(0.5)  # an in-place change: a new version of the map
    second = quant.nearest_code(v, qmap)
    assert len(built) == 2
    assert torch.equal(second, quant._searched_code(v, qmap).to(torch.uint8))
    assert not torch.equal(first, second)


def test_encode_with_absmax_equals_the_search():
    g = fresh_generator()
    x = torch.randn(64, 256, generator=g) * torch.logspace(-8, 1, 64)[:, None]
    x[3, 7], x[5, 0], x[9] = float("nan"), float("inf"), 0.0
    absmax = quant.block_absmax(x, 256)
    per = quant.expand_absmax(absmax, x.numel(), 256).view(64, 256)
    for signed in (True, False):
        qmap = quant.dynamic_map(signed)
        value = x if signed else x.abs()
        v = torch.where(per > 0, value / torch.where(per > 0, per, 1.0), 0.0)
        v = torch.where(v == v, v, 0.0).clamp(-1, 1)
        want = quant._searched_code(v.contiguous(), qmap).to(torch.uint8)
        assert torch.equal(quant.encode_with_absmax(value, per, qmap), want)


def test_vmap_and_meta_take_the_search():
    g = fresh_generator()
    qmap = quant.dynamic_map(True)
    v = torch.rand(5, 300, generator=g) * 2 - 1
    mapped = torch.func.vmap(lambda row: quant.nearest_code(row, qmap))(v)
    assert torch.equal(mapped, torch.stack([quant.nearest_code(r, qmap) for r in v]))
    meta = quant.nearest_code(torch.empty(7, device="meta"), qmap.to("meta"))
    assert meta.device.type == "meta" and meta.dtype == torch.uint8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_table_on_a_gpu():
    g = fresh_generator()
    for signed in (True, False):
        qmap = quant.dynamic_map(signed, "cuda")
        bits, _, thresholds = quant._bucket_table(qmap)
        v = _probe_values(qmap.cpu(), bits, thresholds.cpu(), g).cuda()
        want = quant._searched_code(v.contiguous(), qmap).to(torch.uint8)
        assert torch.equal(quant.nearest_code(v, qmap), want)
