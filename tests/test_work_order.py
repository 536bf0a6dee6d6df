"""The main kernels' program order (``tiles.INTERLEAVE``): runs of blocks in a
low-discrepancy order give the in-order step's bytes, reductions and per-leaf values
included; the order is a permutation whose every window spreads over the whole group."""

from __future__ import annotations

import pytest
import torch
from step_checks import fresh_generator

import ftopt
from ftopt.lowering import launch, tiles, work
from ftopt.lowering.plan import plan_chain

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("total", "chunk"), [(1, 4), (7, 1), (100, 1), (1000, 3),
                                              (4097, 64), (242_000, 16)])
def test_interleaved_is_a_permutation_in_runs(total, chunk):
    order = interleaved = work.interleaved(total, chunk)
    assert torch.equal(interleaved.sort().values, torch.arange(total))
    runs = -(-total // chunk)
    if runs < 3:
        assert torch.equal(order, torch.arange(total))
        return
    # Runs of consecutive blocks, each starting on a multiple of the run length.
    steps = order[1:] - order[:-1]
    starts = torch.cat([torch.tensor([0]), (steps != 1).nonzero().flatten() + 1])
    assert (order[starts] % chunk == 0).all()
    # Every window of 10 consecutive runs lands in at least 7 of 10 equal parts.
    first = order[starts] // chunk
    for i in range(0, first.numel() - 10, max(1, first.numel() // 50)):
        parts = (first[i:i + 10] * 10 // runs).unique().numel()
        assert parts >= 7, (i, first[i:i + 10].tolist())


def test_in_order_is_the_default_and_shares_the_tables():
    table = work.work_table((5000, 300), torch.device("cpu"), 256)
    assert tiles.INTERLEAVE == 0
    assert table.main_leaf is table.block_leaf and table.main_start is table.block_start
    mixed = work.work_table((5000, 300), torch.device("cpu"), 256, False, 2)
    assert not torch.equal(mixed.main_start, mixed.block_start)
    pairs = sorted(zip(mixed.main_leaf.tolist(), mixed.main_start.tolist()))
    assert pairs == list(zip(table.block_leaf.tolist(), table.block_start.tolist()))


@pytest.mark.parametrize("name", ["adam", "adam8", "adam_bf16_states", "lamb", "novograd"])
def test_interleaved_steps_equal_the_in_order_steps(name, monkeypatch):
    """Donated skip_zeros steps and plain ones, with runs of one block: the same bytes as in
    order (LAMB's and NovoGrad's reduction pass keeps its order; NovoGrad's per-leaf
    values come from each leaf's first block wherever it runs)."""
    make = {"adam": lambda: ftopt.adam(1e-2, skip_zeros=True),
            "adam8": lambda: ftopt.adam(1e-2, skip_zeros=True, state_bits=8),
            "adam_bf16_states": lambda: ftopt.adam(1e-2, skip_zeros=True,
                                                   state_dtype=torch.bfloat16),
            "lamb": lambda: ftopt.lamb(1e-2, skip_zeros=True),
            "novograd": lambda: ftopt.novograd(1e-2)}[name]
    gen = fresh_generator()
    block = max(tiles.BLOCK, tiles.IN_PLACE_TILE[0], tiles.QUANT_TILE[0])
    params = {"w": torch.randn(9 * block + 77, generator=gen).to(DEVICE),
              "b": torch.randn(3 * block, generator=gen).to(DEVICE),
              "s": torch.randn(5000, generator=gen).to(DEVICE)}
    grads = {k: torch.randn(v.shape, generator=gen).to(DEVICE) for k, v in params.items()}
    grads["w"][block:4 * block] = 0.0
    out = {}
    for chunk in (0, 1):
        monkeypatch.setattr(tiles, "INTERLEAVE", chunk)
        launch._constants_cached.cache_clear()
        tx = make()
        p = {k: v.clone() for k, v in params.items()}
        s = tx.init(p)
        for donate in (False, True):
            p, s = ftopt.step(tx, p, grads, s, backend="fused", donate=donate)
        groups = plan_chain(tx).prepared.groups
        interleaved = any(g.work.main_start is not g.work.block_start for g in groups)
        assert interleaved == bool(chunk)
        out[chunk] = ftopt.tree.leaves((p, s))
    for a, b in zip(out[0], out[1]):
        assert a.dtype == b.dtype
        if a.dtype.is_floating_point:
            a, b = a.view(torch.int16 if a.element_size() == 2 else torch.int32), \
                b.view(torch.int16 if b.element_size() == 2 else torch.int32)
        assert torch.equal(a, b)
    assert not torch.equal(out[1][0], params["b"])  # (the steps did move the params)
