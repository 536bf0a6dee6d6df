"""Donated skip_zeros steps: a program whose gradients are all zero may return at once.

Its params and 8-bit blocks are then left as they are in memory, which is what the step
must produce (SPEC §5: a block whose gradients are all zero is byte-identical), so a
donated step equals the same step not donated (which writes every tile), and the kernel
with the early return equals the one without (``launch.SKIP_TILES = False``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from step_checks import bits, cloned, dense_randn, fresh_generator, same_bits

import ftopt
from ftopt.lowering import codegen, launch, streams, tiles, work
from ftopt.lowering.plan import plan_chain

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TILE = tiles.QUANT_TILE[0]


@pytest.mark.parametrize("name", ["adamw", "lion", "ademamix"])
def test_donated_step_with_zero_tiles_equals_the_full_step(name, monkeypatch):
    monkeypatch.setitem(tiles.SKIP_MODES, "8-bit", "tiles")
    make = getattr(ftopt, name)
    tx = make(1e-2, state_bits=8, skip_zeros=True)
    gen = fresh_generator()
    # Full tiles and a partial one, and at least quantize_states' min_size (4096), so
    # the leaf's states are 8-bit with the GPU's tile (1024) as with the interpreter's.
    full_tiles = max(3, -(-4096 // TILE))
    n = full_tiles * TILE + 300
    params = {"w": torch.randn(n, generator=gen).to(DEVICE),
              "b": torch.randn(5000, generator=gen).to(DEVICE)}
    state = tx.init(params)
    params, state = ftopt.step(tx, params, {k: dense_randn(like=v) for k, v in
                                            params.items()}, state, backend="fused")
    grads = {k: dense_randn(like=v) for k, v in params.items()}
    grads["w"][TILE:2 * TILE] = 0.0  # a whole tile
    grads["w"][full_tiles * TILE:] = 0.0  # the partial last tile
    grads["w"][10:700] = 0.0  # part of a tile: it runs
    grads["b"][:] = 0.0  # a whole leaf
    full = ftopt.step(tx, params, grads, state, backend="fused")
    donated = ftopt.step(tx, cloned(params), grads, cloned(state), backend="fused",
                         donate=True)
    assert same_bits(donated, full)
    groups = plan_chain(tx).prepared.groups
    assert all(g.quant_block for g in groups)  # every leaf's states are 8-bit
    assert [g.skip_tiles for g in groups] == [True] * len(groups)
    monkeypatch.setattr(launch, "SKIP_TILES", False)
    without = ftopt.step(tx, cloned(params), grads, cloned(state), backend="fused",
                         donate=True)
    assert same_bits(without, full)
    # The step did move the tiles with gradients (the comparison is not vacuous).
    assert not torch.equal(full[0]["w"][:TILE], params["w"][:TILE])
    assert torch.equal(full[0]["w"][TILE:2 * TILE], params["w"][TILE:2 * TILE])


def test_only_donated_skip_aware_8bit_kernels_return_early():
    traced = plan_chain(ftopt.adam(1e-2, skip_zeros=True)).traced(False)
    variant = codegen.Variant(torch.float32, torch.float32, False, True, 256)
    guard = "if tl.sum((tl.load(g_ptr + offs, mask=offs < n, other=0.0).to(tl.float32) != 0.0)"
    assert guard not in codegen.main_source(traced, variant)
    early = codegen.Variant(torch.float32, torch.float32, False, True, 256, skip_tiles=True)
    assert guard in codegen.main_source(traced, early)


LAYOUTS = {"fp32": (torch.float32, {}), "bf16 params": (torch.bfloat16, {}),
           "bf16 states": (torch.bfloat16, {"state_dtype": torch.bfloat16}),
           "8-bit": (torch.float32, {"state_bits": 8})}


@pytest.mark.parametrize("mode", ["in_place", "tiles", "in_place+tiles", "select", "stores",
                                  "in_place+stores", "chunks", "split+select",
                                  "split+in_place", "split+stores", "split+defer"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_skip_mode_equals_the_full_step(layout, mode, monkeypatch):
    """Each way a donated step may skip zero gradients (tiles.SKIP_MODES) gives the
    non-donated step's bytes, on every layout: whole zero tiles, part of a tile, a zero
    leaf."""
    dtype, kw = LAYOUTS[layout]
    key = {"fp32": "fp32", "bf16 params": "16-bit", "bf16 states": "16-bit states",
           "8-bit": "8-bit"}[layout]
    monkeypatch.setitem(tiles.SKIP_MODES, key, mode)
    tx = ftopt.adam(1e-2, skip_zeros=True, **kw)
    gen = fresh_generator()
    tile = max(tiles.BLOCK, tiles.IN_PLACE_TILE[0], TILE)
    n = max(3, -(-4096 // tile)) * tile + 300  # 8-bit states need 4096 elements
    params = {"w": torch.randn(n, generator=gen).to(DEVICE, dtype),
              "b": torch.randn(5000, generator=gen).to(DEVICE, dtype)}
    state = tx.init(params)
    params, state = ftopt.step(tx, params, {k: dense_randn(like=v) for k, v in
                                            params.items()}, state, backend="fused")
    grads = {k: dense_randn(like=v) for k, v in params.items()}
    grads["w"][tile:2 * tile] = 0.0
    grads["w"][10:700] = 0.0
    grads["b"][:] = 0.0
    full = ftopt.step(tx, params, grads, state, backend="fused")
    donated = ftopt.step(tx, cloned(params), grads, cloned(state), backend="fused",
                         donate=True)
    assert same_bits(donated, full)
    groups = plan_chain(tx).prepared.groups
    assert [g.skip_tiles for g in groups] == ["tiles" in mode] * len(groups)
    assert [g.skip_stores for g in groups] == ["stores" in mode] * len(groups)
    in_place = "in_place" in mode and key != "8-bit"
    assert [g.traced.in_place for g in groups] == [in_place] * len(groups)
    chunks = tiles.CHUNK_LANES if mode == "chunks" and key != "8-bit" else 0
    assert [g.chunk_lanes for g in groups] == [chunks] * len(groups)
    assert [g.split for g in groups] == ["split" in mode] * len(groups)
    # (a "split" group's flags: the blocks deferred, or counted for its watch)
    assert [g.flags is not None for g in groups] == ["split" in mode] * len(groups)
    assert [g.deferring for g in groups] == [mode == "split+defer"] * len(groups)
    assert not torch.equal(full[0]["w"][:10], params["w"][:10])
    assert torch.equal(full[0]["w"][tile:2 * tile], params["w"][tile:2 * tile])


@pytest.mark.parametrize("mode", ["split+defer", "split+select"])
def test_a_half_tile_of_select_kernels_reaches_their_deferred_kernel(mode, monkeypatch):
    """With half_tiles.SELECT giving a 16-bit-params layout's skip_zeros kernels a tile of
    their own, a "split+defer" step's deferred kernel runs the main kernel's blocks (its
    flags are per block): the donated step equals the full one, and the deferred blocks
    (some zero gradients) are written."""
    from ftopt.lowering import half_tiles

    block = tiles.BLOCK // 4
    monkeypatch.setitem(tiles.SKIP_MODES, "16-bit states", mode)
    monkeypatch.setattr(half_tiles, "SELECT", {"16-bit states": (block, 2, 0)})
    launch._constants_cached.cache_clear()
    tx = ftopt.adam(1e-2, skip_zeros=True, state_dtype=torch.bfloat16)
    gen = fresh_generator()
    params = {"w": torch.randn(7 * block + 100, generator=gen).to(DEVICE, torch.bfloat16)}
    state = tx.init(params)
    params, state = ftopt.step(tx, params, {"w": dense_randn(like=params["w"])}, state)
    grads = {"w": dense_randn(like=params["w"])}
    grads["w"][3:40] = 0.0  # (block 0: some zeros, deferred)
    grads["w"][2 * block:3 * block] = 0.0  # (block 2: all zero)
    try:
        full = ftopt.step(tx, params, grads, state, backend="fused")
        donated = ftopt.step(tx, cloned(params), grads, cloned(state), backend="fused",
                             donate=True)
        groups = plan_chain(tx).prepared.groups
        assert [g.deferring for g in groups] == [mode == "split+defer"]
        blocks = {dict(c)["BLOCK"] for g in groups
                  for _, _, c, _ in g.kernels(torch.zeros(1), True)}
    finally:
        launch._constants_cached.cache_clear()
    assert blocks == {block}, blocks
    assert same_bits(donated, full)
    assert not torch.equal(full[0]["w"][40:block], params["w"][40:block])
    assert torch.equal(full[0]["w"][3:40], params["w"][3:40])


def test_8bit_split_kernels_load_their_codes_before_the_zero_check(monkeypatch):
    """A "split" kernel with 8-bit slots loads and decodes them once, before it checks
    its gradients (both branches use them), not once per branch after the check."""
    # (skip_lanes=False, as an 8-bit group's: its kernels load every lane)
    traced = plan_chain(ftopt.adam(1e-2, skip_zeros=True, state_bits=8)).traced(
        True, skip_lanes=False)
    src = codegen.main_source(traced, codegen.Variant(
        torch.float32, torch.float32, True, True, 256, split=True)).splitlines()
    check = next(i for i, x in enumerate(src) if "live_lanes = tl.sum(" in x)
    loads = [i for i, x in enumerate(src) if "st0_mu_old_code = tl.load(" in x]
    assert len(loads) == 2 and loads[0] < check < loads[1]  # (the second: the tail block)
    assert any("st0_nu_old = tl.load(qmap_unsigned_ptr" in x for x in src[:check])


@pytest.mark.parametrize("mode", ["split+defer", "split+select"])
def test_8bit_split_kernels_hoist_the_leaf_flags_their_loads_read(mode, monkeypatch):
    """A masked 8-bit stage's loads read its per-leaf flag (a leaf it leaves out has no
    state): hoisted before the zero check, they take the flag's lines along (they read
    a name not yet set, a compile error on the GPU; found by the fuzz, seed 86). The
    donated step of full blocks equals the plain one."""
    monkeypatch.setitem(tiles.SKIP_MODES, "8-bit", mode)
    matrices = lambda p: ftopt.tree.map(lambda x: x.ndim >= 2, p)  # noqa: E731
    tx = ftopt.quantize_states(ftopt.chain(
        ftopt.add_decayed_weights(0.1), ftopt.masked(ftopt.scale_by_adam(), matrices),
        ftopt.scale_by_learning_rate(1e-2), ftopt.skip_zeros()), bits=8, min_size=1)
    # (8-bit groups load every lane: skip_lanes is for in-place kernels)
    src = codegen.main_source(plan_chain(tx).traced(True, skip_lanes=False), codegen.Variant(
        torch.float32, torch.float32, True, True, 256, split=True)).splitlines()
    check = next(i for i, x in enumerate(src) if "live_lanes = tl.sum(" in x)
    flag = next(i for i, x in enumerate(src[:check]) if x.strip().startswith("v") and
                "lv" in x and "!= 0.0" in x)
    name = src[flag].split("=")[0].strip()
    load = next(i for i, x in enumerate(src) if "_mu_old_code = tl.load(" in x)
    assert flag < load < check and f"tl.where({name}, n, 0)" in src[load]
    gen = torch.Generator().manual_seed(86)
    tile = max(tiles.BLOCK, TILE)
    params = {"w": torch.randn(4, 4 * tile, generator=gen).to(DEVICE),
              "b": torch.randn(2 * tile, generator=gen).to(DEVICE)}
    state = tx.init(params)
    for k in range(3):
        grads = {n: dense_randn(*v.shape, generator=gen).to(DEVICE) for n, v in params.items()}
        grads["w"][0] = 0.0
        full = ftopt.step(tx, params, grads, state, backend="fused")
        donated = ftopt.step(tx, cloned(params), grads, cloned(state), backend="fused",
                             donate=True)
        assert same_bits(donated, full), k
        params, state = full
    groups = plan_chain(tx).prepared.groups
    assert groups and all(g.split for g in groups)


def test_8bit_kernels_with_skip_zeros_take_their_own_register_cap(monkeypatch):
    monkeypatch.setattr(tiles, "QUANT_MAXNREG", 64)
    monkeypatch.setattr(tiles, "QUANT_SKIP_MAXNREG", 80)
    plain = plan_chain(ftopt.adam(1e-2, state_bits=8)).traced(True)
    skip = plan_chain(ftopt.adam(1e-2, state_bits=8, skip_zeros=True)).traced(True)
    assert (tiles.quant_maxnreg(plain), tiles.quant_maxnreg(skip)) == (64, 80)


@pytest.mark.parametrize("mode", ["select", "stores", "tiles", "split+select", "split+defer"])
@pytest.mark.parametrize("name", ["adamw", "lion"])
def test_8bit_one_block_per_program_equals_the_full_step(name, mode, monkeypatch):
    """With one 8-bit block per program (the GPU's tile) a "stores" program whose
    gradients are all zero writes nothing and keeps no old codes: the donated step still
    equals the step that writes every block, and the all-zero blocks keep their bytes."""
    monkeypatch.setitem(tiles.SKIP_MODES, "8-bit", mode)
    monkeypatch.setattr(tiles, "QUANT_TILE", (256, 1))
    launch._constants_cached.cache_clear()
    launch._kernel.cache_clear()
    try:
        tx = getattr(ftopt, name)(1e-2, skip_zeros=True, state_bits=8)
        gen = fresh_generator()
        params = {"w": torch.randn(4096 + 256 * 3 + 77, generator=gen).to(DEVICE)}
        state = tx.init(params)
        params, state = ftopt.step(tx, params, {"w": dense_randn(like=params["w"])}, state,
                                   backend="fused")
        g = dense_randn(like=params["w"])
        g[256:768] = 0.0  # two whole blocks
        g[1000:1100] = 0.0  # part of a block
        g[-77:] = 0.0  # the tail block
        full = ftopt.step(tx, params, {"w": g}, state, backend="fused")
        donated = ftopt.step(tx, cloned(params), {"w": g}, cloned(state), backend="fused",
                             donate=True)
        assert same_bits(donated, full)
        groups = plan_chain(tx).prepared.groups
        assert [gr.skip_stores for gr in groups] == [mode == "stores"]
        before = ftopt.tree.leaves(state)
        after = ftopt.tree.leaves(full[1])
        codes = [(b, a) for b, a in zip(before, after) if b.dtype == torch.uint8]
        assert codes and all(torch.equal(b[256:768], a[256:768]) for b, a in codes)
        assert not all(torch.equal(b[:256], a[:256]) for b, a in codes)  # the control
        assert torch.equal(full[0]["w"][256:768], params["w"][256:768])
    finally:
        launch._constants_cached.cache_clear()
        launch._kernel.cache_clear()


@pytest.mark.parametrize("pdl", ["0", "defer", "all"] if DEVICE == "cuda" else ["defer"])
@pytest.mark.parametrize("span, words", [(1, False), (4, False), (8, False), (1, True),
                                         (4, True)])
@pytest.mark.parametrize("interleave", [0, 3])
@pytest.mark.parametrize("layout", ["8-bit", "fp32"])
def test_split_defer_runs_programs_with_some_zeros_in_a_second_launch(layout, interleave,
                                                                      span, words, pdl,
                                                                      monkeypatch):
    """"split+defer": the main kernel runs the blocks without zero gradients, writes
    nothing for all-zero ones but their flag (2, for the watch to count), and flags those
    with some zeros and the tail (1); the second launch runs exactly the blocks flagged 1
    (in the main kernel's program order, also interleaved). Without it (the control) the
    flagged blocks are not written, so the donated step would differ from the full one.
    With programs of several blocks (``tiles.SPANS``), one whose blocks are all zero sets
    their flags too: a flag left from an earlier step would run its block again. On a GPU
    the deferred kernel (``pdl``: every kernel) is launched early, to wait for the main
    one on the device (``streams.PDL``). ``words``: the deferred kernel reads the flags
    four to a word (``tiles.DEFER_WORDS``), 8 a program."""
    dtype, kw = LAYOUTS[layout]
    monkeypatch.setattr(streams, "PDL", pdl)
    key = "8-bit" if kw else "fp32"
    monkeypatch.setitem(tiles.SKIP_MODES, key, "split+defer")
    monkeypatch.setattr(tiles, "SPANS", {key: span})
    monkeypatch.setattr(tiles, "QUANT_TILE", (256, 1))
    runs = 8 if words else 4  # (flags a deferred program)
    monkeypatch.setattr(tiles, "DEFER_WORDS", words)
    monkeypatch.setattr(tiles, "DEFER_FLAGS", runs)
    monkeypatch.setattr(tiles, "DEFER_FLAGS_FEW", runs)
    # (3 blocks of 18 deferred: "split+defer" throughout, not the watch's "split+select")
    monkeypatch.setattr(tiles, "DEFER_SELECT_ABOVE", 2.0)
    for cache in (launch._constants_cached, launch._kernel):
        cache.cache_clear()
    monkeypatch.setattr(tiles, "BLOCK", 256)
    monkeypatch.setattr(tiles, "INTERLEAVE", interleave)
    try:
        tx = ftopt.adam(1e-2, skip_zeros=True, **kw)
        gen = fresh_generator()
        n = 256 * 17 + 77  # (8-bit states from 4096 elements)
        params = {"w": torch.randn(n, generator=gen).to(DEVICE, dtype)}
        state = tx.init(params)
        params, state = ftopt.step(tx, params, {"w": dense_randn(like=params["w"])}, state,
                                   backend="fused")
        g = dense_randn(n, generator=gen, dtype=dtype).to(DEVICE)
        g[256:512] = 0.0  # program 1: all zero
        g[600:700] = 0.0  # program 2: some zero
        g[1800] = 0.0  # program 7: one zero
        g[2048:3072] = 0.0  # programs 8-11 (in order, one span of 4): all zero
        full = ftopt.step(tx, params, {"w": g}, state, backend="fused")
        launched = []
        real = launch._launch
        monkeypatch.setattr(launch, "_launch", lambda k, grid, *a, **kw_: (
            launched.append((grid, dict(a[1]).get("launch_pdl", False))),
            real(k, grid, *a, **kw_))[1])
        donated = ftopt.step(tx, cloned(params), {"w": g}, cloned(state), backend="fused",
                             donate=True)
        assert same_bits(donated, full)
        # 18 blocks, in programs of ``span``; their flags in runs of 4 (8)
        # one flag a block of the table padded to whole spans, in runs of 4 (8)
        flagged = torch.zeros(-(-(-(-18 // span) * span) // runs) * runs, dtype=torch.uint8)
        assert [grid for grid, _ in launched] == [(-(-18 // span),), (len(flagged) // runs,)]
        sm90 = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] >= 9
        assert [early for _, early in launched] == [sm90 and pdl == "all",
                                                    sm90 and pdl != "0"]
        (group,) = plan_chain(tx).prepared.groups
        for deferred in (False, True):  # (its source, launched so: waits, then lets go)
            source = codegen.main_source(group.traced, replace(group.variant([], deferred),
                                                               pdl=True))
            assert source.split("def ftopt_main(")[1].split("\n")[1:3] == [
                "    tl.extra.cuda.gdc_wait()", "    tl.extra.cuda.gdc_launch_dependents()"]
        assert group.one_leaf == (span > 1 and not interleave)  # (then no table read)
        assert ("0x01010101" in codegen.main_source(group.traced, group.variant([], True))
                ) == words
        order = work.interleaved(18, interleave) if interleave else torch.arange(18)
        flagged[[list(order).index(k) for k in (2, 7, 17)]] = 1
        flagged[[list(order).index(k) for k in (1, 8, 9, 10, 11)]] = 2
        assert torch.equal(group.flags.cpu(), flagged)
        # Flags left from an earlier step: the next donated step of the same tensors
        full2 = ftopt.step(tx, cloned(donated[0]), {"w": g}, cloned(donated[1]),
                           backend="fused")
        group.flags[:18].fill_(1)
        again = ftopt.step(tx, *donated[:1], {"w": g}, donated[1], backend="fused",
                           donate=True)
        assert plan_chain(tx).prepared.groups[0] is group
        assert same_bits(again, full2)
        assert torch.equal(group.flags.cpu(), flagged)
        first_only = launch.GroupLaunch.kernels
        monkeypatch.setattr(launch.GroupLaunch, "kernels",
                            lambda self, *a: first_only(self, *a)[:1])
        launch._COMPILED.clear()
        control = ftopt.step(tx, cloned(params), {"w": g}, cloned(state), backend="fused",
                             donate=True)
        assert torch.equal(control[0]["w"][:256], full[0]["w"][:256])
        for part in (slice(512, 600), slice(1792, 2048), slice(4352, n)):  # flagged
            assert not torch.equal(control[0]["w"][part], full[0]["w"][part])
            assert torch.equal(control[0]["w"][part], params["w"][part])
    finally:
        for cache in (launch._constants_cached, launch._kernel):
            cache.cache_clear()


def test_in_place_tile_per_layout(monkeypatch):
    """``tiles.IN_PLACE_TILES`` gives a layout its own in-place tile (fp32 on a GPU):
    a step over fp32 and bf16 params runs each group at its tile, its work table and
    kernel constants agreeing, and equals the step not donated."""
    monkeypatch.setattr(tiles, "IN_PLACE_TILE", (2048, 4))
    monkeypatch.setattr(tiles, "IN_PLACE_TILES", {"fp32": (1024, 4)})
    for cache in (launch._constants_cached, work.work_table):
        cache.cache_clear()
    try:
        tx = ftopt.adam(1e-2, skip_zeros=True)
        gen = fresh_generator()
        params = {"a": torch.randn(5000, generator=gen).to(DEVICE),
                  "b": torch.randn(5000, generator=gen).to(DEVICE, torch.bfloat16)}
        state = tx.init(params)
        grads = {k: dense_randn(like=v) for k, v in params.items()}
        grads["a"][1024:2048] = 0.0
        grads["b"][:2048] = 0.0
        full = ftopt.step(tx, params, grads, state, backend="fused")
        donated = ftopt.step(tx, cloned(params), grads, cloned(state), backend="fused",
                             donate=True)
        assert same_bits(donated, full)
        groups = {g.p_dtype: g for g in plan_chain(tx).prepared.groups}
        for dtype, block in ((torch.float32, 1024), (torch.bfloat16, 2048)):
            group = groups[dtype]
            assert group.traced.in_place
            assert group.work.num_blocks == -(-5000 // block)
            assert dict(launch._constants_cached(group.traced, 0, True, 0, group.kind))[
                "BLOCK"] == block
        assert not torch.equal(full[0]["a"][:1024], params["a"][:1024])  # the control
        assert torch.equal(full[0]["a"][1024:2048], params["a"][1024:2048])
    finally:
        for cache in (launch._constants_cached, work.work_table):
            cache.cache_clear()


@pytest.mark.parametrize("name", ["adam", "lamb"])
@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, None),
                                               (torch.bfloat16, None),
                                               (torch.bfloat16, torch.bfloat16)])
def test_in_place_span_checks_its_tiles_at_once_and_runs_each(dtype, state_dtype, name,
                                                              monkeypatch):
    """``tiles.SPANS``: a program of an in-place "split" kernel runs several
    blocks of its work table. Spans all zero, spans with one block all zero and the
    others dense, blocks with some zeros, a leaf's partial last block, a span across two
    leaves and one padded past the table's end all equal the step not donated; the
    elements with zero gradients keep their bytes, the others change (the control)."""
    span = 4
    monkeypatch.setattr(tiles, "IN_PLACE_TILE", (256, 4))
    monkeypatch.setattr(tiles, "HEAVY_TILE", (256, 4))  # (lamb's, for its norm pass)
    monkeypatch.setattr(tiles, "IN_PLACE_TILES", {})
    monkeypatch.setattr(tiles, "SPANS", {"fp32": span, "16-bit": span,
                                                  "16-bit states": span})
    for cache in (launch._constants_cached, launch._kernel, work.work_table):
        cache.cache_clear()
    try:
        kw = {"state_dtype": state_dtype} if state_dtype else {}
        tx = getattr(ftopt, name)(1e-2, skip_zeros=True, **kw)  # (lamb: a norm pass first)
        gen = fresh_generator()
        n = 256 * span * 4 + 256 + 100  # four spans, one tile and a partial one
        params = {"a": torch.randn(n, generator=gen).to(DEVICE, dtype),
                  "b": torch.randn(600, generator=gen).to(DEVICE, dtype)}
        state = tx.init(params)
        grads = {k: dense_randn(*v.shape, generator=gen, dtype=dtype).to(DEVICE)
                 for k, v in params.items()}
        w = grads["a"]  # (the first leaf: its blocks start the table)
        w[:256 * span] = 0.0  # a whole span
        w[256 * span: 256 * (span + 1)] = 0.0  # the first tile of a span, the rest dense
        w[256 * (2 * span) + 7: 256 * (2 * span) + 90] = 0.0  # part of a block
        w[256 * (2 * span + 1): 256 * (3 * span + 1)] = 0.0  # all but a span's first
        w[256 * 4 * span + 256:] = 0.0  # the partial last tile
        full = ftopt.step(tx, params, grads, state, backend="fused")
        donated = ftopt.step(tx, cloned(params), grads, cloned(state), backend="fused",
                             donate=True)
        assert same_bits(donated, full)
        (group,) = plan_chain(tx).prepared.groups
        assert group.span == span and group.split
        assert group.traced.in_place == (name == "adam")  # (lamb: "split+select")
        blocks = -(-n // 256) + 3  # 18 and "b"'s 3: the last span crosses to "b"
        assert group.work.num_blocks == blocks and blocks % span
        assert len(group.work.main_leaf) == -(-blocks // span) * span  # padded
        assert group.kernels([0.0] * 16, False)[0][1] == (-(-blocks // span),)
        assert torch.equal(bits(full[0]["b"][grads["b"] == 0]),
                           bits(params["b"][grads["b"] == 0]))
        assert not torch.equal(full[0]["b"], params["b"])
        zero = w == 0
        new, old = full[0]["a"], params["a"]
        assert torch.equal(bits(new[zero]), bits(old[zero]))
        assert not torch.equal(new[~zero], old[~zero])  # the control
        assert (new[~zero] != old[~zero]).float().mean() > 0.9
    finally:
        for cache in (launch._constants_cached, launch._kernel, work.work_table):
            cache.cache_clear()


@pytest.mark.parametrize("name", ["adam", "lamb"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_span_of_one_leaf_reads_no_work_table(dtype, name, monkeypatch):
    """A spanned group of one leaf's blocks in order (an embedding carved out) finds a
    program's blocks from its number (``Variant.one_leaf``), in its norm pass too (lamb):
    whole spans zero, part of a block, the leaf's partial last block, a span padded past
    the table's end all equal the step not donated, and zero gradients keep their bytes
    (the others change: the control). Two leaves read the table."""
    span = 4
    monkeypatch.setattr(tiles, "IN_PLACE_TILE", (256, 4))
    monkeypatch.setattr(tiles, "HEAVY_TILE", (256, 4))
    monkeypatch.setattr(tiles, "IN_PLACE_TILES", {})
    monkeypatch.setattr(tiles, "SPANS", {"fp32": span, "16-bit": span})
    for cache in (launch._constants_cached, launch._kernel, work.work_table):
        cache.cache_clear()
    try:
        tx = getattr(ftopt, name)(1e-2, skip_zeros=True)
        gen = fresh_generator()
        n = 256 * span * 4 + 256 + 100  # 18 blocks: four spans and a padded one
        params = {"a": torch.randn(n, generator=gen).to(DEVICE, dtype)}
        state = tx.init(params)
        g = dense_randn(n, generator=gen, dtype=dtype).to(DEVICE)
        g[:256 * span] = 0.0
        g[256 * span + 7: 256 * span + 90] = -0.0
        g[-150:] = 0.0
        full = ftopt.step(tx, params, {"a": g}, state, backend="fused")
        donated = ftopt.step(tx, cloned(params), {"a": g}, cloned(state), backend="fused",
                             donate=True)
        assert same_bits(donated, full)
        (group,) = plan_chain(tx).prepared.groups
        assert group.span == span and group.one_leaf and bool(group.traced.levels) == (
            name == "lamb")
        zero = g == 0
        new, old = full[0]["a"], params["a"]
        assert torch.equal(bits(new[zero]), bits(old[zero]))
        assert (new[~zero] != old[~zero]).float().mean() > 0.9  # the control
        two = {"a": params["a"], "b": params["a"][:300].clone()}
        ftopt.step(tx, cloned(two), {"a": g, "b": g[:300]}, tx.init(two), backend="fused",
                   donate=True)
        assert not plan_chain(tx).prepared.groups[0].one_leaf
    finally:
        for cache in (launch._constants_cached, launch._kernel, work.work_table):
            cache.cache_clear()


def test_select_register_cap_per_layout(monkeypatch):
    """``tiles.SELECT_MAXNREG``: on an NVIDIA GPU a layout's skip_zeros kernels that keep
    old values by selects take its register cap; in-place ones, those without
    skip_zeros and those whose rules read the element's index (stochastic rounding) do
    not."""
    monkeypatch.setitem(tiles.SKIP_MODES, "fp32", "select")
    params = {"a": torch.randn(3000).to(DEVICE)}
    grads = {"a": dense_randn(3000).to(DEVICE)}
    groups = []
    for tx in (ftopt.adam(1e-2, skip_zeros=True), ftopt.adam(1e-2),
               ftopt.chain(ftopt.add_noise(0.1, 0.5, 0), ftopt.adam(1e-2),
                           ftopt.skip_zeros())):
        ftopt.step(tx, cloned(params), grads, tx.init(params), backend="fused", donate=True)
        groups += plan_chain(tx).prepared.groups
    monkeypatch.setattr(tiles, "INTERPRETING", False)
    monkeypatch.setattr(launch, "_NVIDIA", True)
    monkeypatch.setattr(tiles, "SELECT_MAXNREG", {"fp32": 48})
    monkeypatch.setattr(tiles, "IN_PLACE_MAXNREG", {})
    launch._constants_cached.cache_clear()
    try:
        def cap(group):
            return dict(launch._constants_cached(group.traced, 0, True, 0, group.kind)).get(
                "maxnreg")

        selecting, plain, indexed = groups
        assert not selecting.traced.in_place and any(selecting.traced.skips)
        assert not indexed.traced.in_place and any(indexed.traced.skips)
        assert cap(selecting) == 48 and cap(plain) is None and cap(indexed) is None
        monkeypatch.setattr(tiles, "SELECT_MAXNREG", {})
        launch._constants_cached.cache_clear()
        assert cap(selecting) is None  # (the control)
    finally:
        launch._constants_cached.cache_clear()


def test_in_place_register_cap_per_layout(monkeypatch):
    """``tiles.IN_PLACE_MAXNREG``: on an NVIDIA GPU a layout's in-place kernels take its
    register cap, and only they."""
    tx = ftopt.adam(1e-2, skip_zeros=True)
    params = {"a": torch.randn(3000).to(DEVICE),
              "b": torch.randn(3000).to(DEVICE, torch.bfloat16)}
    grads = {k: dense_randn(like=v) for k, v in params.items()}
    state = tx.init(params)
    ftopt.step(tx, cloned(params), grads, cloned(state), backend="fused", donate=True)
    groups = {g.p_dtype: g for g in plan_chain(tx).prepared.groups}
    monkeypatch.setattr(tiles, "INTERPRETING", False)
    monkeypatch.setattr(launch, "_NVIDIA", True)
    monkeypatch.setattr(tiles, "IN_PLACE_MAXNREG", {"fp32": 56})
    launch._constants_cached.cache_clear()
    try:
        def cap(group):
            return dict(launch._constants_cached(group.traced, 0, True, 0, group.kind)).get(
                "maxnreg")

        assert groups[torch.float32].traced.in_place and cap(groups[torch.float32]) == 56
        assert groups[torch.bfloat16].traced.in_place and cap(groups[torch.bfloat16]) is None
        monkeypatch.setattr(tiles, "IN_PLACE_MAXNREG", {})
        launch._constants_cached.cache_clear()
        assert cap(groups[torch.float32]) is None  # (the control)
    finally:
        launch._constants_cached.cache_clear()
