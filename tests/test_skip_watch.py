"""A "split+defer" group runs "split+select" while many of its blocks are deferred
(``ftopt.lowering.skip_watch``): the same bytes either way, and back to "split+defer"
once the zeros are gone."""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
from step_checks import cloned, dense_randn, fresh_generator, same_bits

import ftopt
from ftopt.lowering import codegen, half_tiles, launch, streams, tiles, work
from ftopt.lowering.plan import plan_chain
from ftopt.lowering.skip_watch import SkipWatch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N = 256 * 40 + 77  # (8-bit states from 4096 elements; a tail block)


@pytest.fixture
def small_blocks(monkeypatch):
    """One 8-bit block a program, flags in runs of 4, a count every 2 steps and a probe
    every 4, the first too (so that a few steps show every switch)."""
    monkeypatch.setitem(tiles.SKIP_MODES, "8-bit", "split+defer")
    monkeypatch.setattr(tiles, "QUANT_TILE", (256, 1))
    monkeypatch.setattr(tiles, "DEFER_FLAGS", 4)
    monkeypatch.setattr(tiles, "DEFER_FLAGS_FEW", 4)
    monkeypatch.setattr(tiles, "WATCH_PERIOD", 2)
    monkeypatch.setattr(tiles, "WATCH_PROBE", 4)
    monkeypatch.setattr(tiles, "WATCH_FIRST_PROBE", 4)
    for cache in (launch._constants_cached, launch._kernel):
        cache.cache_clear()
    yield
    for cache in (launch._constants_cached, launch._kernel):
        cache.cache_clear()


def _grads(gen, steps: int, scattered: range) -> list:
    """Fresh gradients each step; in the steps of ``scattered`` one element in 97 zero
    (every block part zero), in the others two whole blocks zero (no block part zero)."""
    out = []
    for k in range(steps):
        g = dense_randn(N, generator=gen)
        if k in scattered:
            g[::97] = 0.0
        else:
            g[512:1024] = 0.0
        out.append({"w": g.to(DEVICE)})
    return out


def _counted() -> None:
    """On a GPU, wait for the step: the watch reads a step's count once its copy to the
    host is done, so at the next step, as the schedules below expect, however busy the
    device (the tests run in parallel)."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _run(tx, params, state, grads: list, modes: list | None = None,
         stepped: list | None = None):
    """Donated steps over copies of ``params`` and ``state`` (``modes``: the watch's
    mode after each; ``stepped``: a copy of the params after each)."""
    params, state = cloned(params), cloned(state)
    for g in grads:
        params, state = ftopt.step(tx, params, g, state, backend="fused", donate=True)
        _counted()
        if modes is not None:
            (group,) = plan_chain(tx).prepared.groups
            modes.append(group.watch.now)
        if stepped is not None:
            stepped.append(cloned(params))
    return params, state


@pytest.mark.parametrize("name", ["adam", "lion"])
def test_many_deferred_blocks_switch_to_select_and_back(name, small_blocks, monkeypatch):
    gen = fresh_generator()
    params = {"w": torch.randn(N, generator=gen).to(DEVICE)}
    grads = _grads(gen, 12, range(0, 6))
    make = getattr(ftopt, name)
    tx = make(1e-2, state_bits=8, skip_zeros=True)
    state = tx.init(params)
    modes: list = []
    stepped: list = []
    watched = _run(tx, params, state, grads, modes, stepped)
    (group,) = plan_chain(tx).prepared.groups
    assert group.watch is not None and group.watch.fraction is not None
    # Step 1 counts (every block deferred): select from step 2 on, step 5 probes
    # (deferred again: select), step 9 probes after the zeros are gone (steps 7-12: only
    # whole zero blocks and the tail deferred): split+defer from step 10 on.
    assert modes == [False, True, True, True, False, True, True, True, False, False, False,
                     False]
    # The same bytes as the step that never switches (and so as "split+select"
    # throughout: test_skip_tiles' modes each equal the full step).
    monkeypatch.setattr(tiles, "DEFER_SELECT_ABOVE", 2.0)
    tx2 = make(1e-2, state_bits=8, skip_zeros=True)
    never: list = []
    assert same_bits(watched, _run(tx2, params, state, grads, never))
    assert not any(never)  # (the control: it never switched)
    # skip_zeros held in both modes: the blocks zero in the last steps kept their bytes
    # across those steps (the control: the others changed).
    before, after = stepped[5]["w"], watched[0]["w"]
    assert torch.equal(after[512:1024], before[512:1024])
    assert not torch.equal(after[:512], before[:512])


def test_few_deferred_blocks_take_more_flags_a_deferred_program(small_blocks,
                                                                monkeypatch):
    """While the last count found fewer than tiles.DEFER_FEW_BELOW of a "split+defer"
    group's blocks deferred, its deferred kernel's programs each read
    tiles.DEFER_FLAGS_FEW flags (fewer programs), else tiles.DEFER_FLAGS: the same bytes
    as a group that never takes more (the control)."""
    monkeypatch.setattr(tiles, "DEFER_FLAGS_FEW", 16)
    monkeypatch.setattr(tiles, "DEFER_FEW_BELOW", 0.1)
    monkeypatch.setattr(tiles, "DEFER_SELECT_ABOVE", 2.0)  # (split+defer throughout)
    gen = fresh_generator()
    params = {"w": torch.randn(N, generator=gen).to(DEVICE)}
    # steps 1-4: the tail deferred (1 of 41 blocks), steps 5-8: every block
    grads = _grads(gen, 8, range(4, 8))

    def run(tx) -> tuple:
        p, s = cloned(params), tx.init(params)
        taken = []
        for g in grads:
            p, s = ftopt.step(tx, p, g, s, backend="fused", donate=True)
            _counted()
            (group,) = plan_chain(tx).prepared.groups
            kernels = group.kernels([0.0] * 16, False)
            assert kernels[1][1] == (group.flags.numel() // group.defer_flags,)
            taken.append(group.defer_flags)
        return (p, s), taken

    tx = ftopt.adam(1e-2, state_bits=8, skip_zeros=True)
    stepped, taken = run(tx)
    # (each step takes the count read before it: steps 1, 3, 5, 7 count)
    assert taken == [4, 16, 16, 16, 16, 4, 4, 4]
    monkeypatch.setattr(tiles, "DEFER_FEW_BELOW", 0.0)
    control, never = run(ftopt.adam(1e-2, state_bits=8, skip_zeros=True))
    assert never == [4] * 8
    assert same_bits(stepped, control)


def test_the_select_steps_launch_no_deferred_kernel(small_blocks, monkeypatch):
    gen = fresh_generator()
    params = {"w": torch.randn(N, generator=gen).to(DEVICE)}
    tx = ftopt.adam(1e-2, state_bits=8, skip_zeros=True)
    state = tx.init(params)
    monkeypatch.setattr(launch, "bind_main", lambda *a, **kw: None)  # (every launch seen)
    launched = []
    real = launch._launch
    monkeypatch.setattr(launch, "_launch", lambda k, grid, *a, **kw: (
        launched.append(grid), real(k, grid, *a, **kw))[1])
    _run(tx, params, state, _grads(gen, 3, range(3)))
    (group,) = plan_chain(tx).prepared.groups
    blocks = -(-N // 256)
    flags = group.flags.numel() // 4
    # step 1 split+defer (main and deferred kernels), steps 2 and 3 split+select
    assert launched == [(blocks,), (flags,), (blocks,), (blocks,)]
    assert group.watch.fraction == 1.0


def test_a_count_not_yet_on_the_host_keeps_the_mode(small_blocks):
    """A count is read once its copy is done (on a GPU: an event); until then the group
    keeps its mode and counts nothing more."""

    class Pending:
        done = False

        def query(self):
            return self.done

    gen = fresh_generator()
    params = {"w": torch.randn(N, generator=gen).to(DEVICE)}
    tx = ftopt.adam(1e-2, state_bits=8, skip_zeros=True)
    state = tx.init(params)
    grads = _grads(gen, 4, range(4))
    params, state = ftopt.step(tx, params, grads[0], state, backend="fused", donate=True)
    (group,) = plan_chain(tx).prepared.groups
    event = Pending()
    group.watch.pending = (event, group.watch.pending[1])
    for g in grads[1:3]:
        params, state = ftopt.step(tx, params, g, state, backend="fused", donate=True)
        assert not group.watch.now and not group.watch.sampling
    event.done = True
    params, state = ftopt.step(tx, params, grads[3], state, backend="fused", donate=True)
    assert group.watch.now and group.watch.fraction == 1.0


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a CUDA device")
def test_a_captured_step_keeps_the_mode_of_the_moment(small_blocks):
    """Under CUDA graph capture the watch neither queries its event nor counts: the
    graph holds the launches of the mode the group ran before (here "split+select"), and
    its replays write what uncaptured steps write."""
    gen = fresh_generator()
    params = {"w": torch.randn(N, generator=gen).to(DEVICE)}
    (g,) = _grads(gen, 1, range(1))
    lr = torch.tensor(1e-2, device=DEVICE)  # (a captured step reads it from the device)
    tx, tx_ref = (ftopt.adam(lr, state_bits=8, skip_zeros=True) for _ in range(2))
    p, s = cloned(params), tx.init(params)
    ref_p, ref_s = cloned(params), tx_ref.init(params)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # step 1 counts; its count is read once its copy is done
            p, s = ftopt.step(tx, p, g, s, backend="fused", donate=True)
        side.synchronize()
        p, s = ftopt.step(tx, p, g, s, backend="fused", donate=True)  # (read by now)
    torch.cuda.current_stream().wait_stream(side)
    (group,) = plan_chain(tx).prepared.groups
    assert group.watch.now and group.watch.pending is None
    steps = group.watch.steps
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ftopt.step(tx, p, g, s, backend="fused", donate=True)
    assert group.watch.steps == steps and group.watch.now
    for _ in range(3):
        graph.replay()
    for _ in range(7):
        ref_p, ref_s = ftopt.step(tx_ref, ref_p, g, ref_s, backend="fused", donate=True)
    torch.cuda.synchronize()
    assert same_bits((p, s), (ref_p, ref_s))


LAYOUTS = {"fp32": (torch.float32, {}, "fp32"),
           "bf16 params": (torch.bfloat16, {}, "16-bit"),
           "bf16 states": (torch.bfloat16, {"state_dtype": torch.bfloat16}, "16-bit states")}


@pytest.fixture
def small_tiles(monkeypatch):
    """fp32 and 16-bit programs of one 256-element block (half_tiles' tiles of 16-bit
    kernels set aside), no spans, a count every 2 steps and a probe every 4 (the first
    too)."""
    for name, value in (("IN_PLACE_TILE", (256, 4)), ("IN_PLACE_TILES", {}), ("BLOCK", 256),
                        ("SPANS", {}), ("WATCH_PERIOD", 2), ("WATCH_PROBE", 4),
                        ("WATCH_FIRST_PROBE", 4)):
        monkeypatch.setattr(tiles, name, value)
    for name in ("PLAIN", "SELECT"):
        monkeypatch.setattr(half_tiles, name, {})
    caches = (launch._constants_cached, launch._kernel, work.work_table)
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_split_in_place_runs_select_while_most_blocks_are_part_zero(layout, small_tiles,
                                                                    monkeypatch):
    """A "split+in_place" group (fp32 and 16-bit layouts) flags its programs with some
    zero gradients (1) and with only zeros (2) and runs "select" while most blocks are
    part zero and few all zero; whole zero blocks keep it on "split+in_place" (they are
    what it skips). The same bytes as the group that never switches and as "select"."""
    dtype, kw, key = LAYOUTS[layout]
    monkeypatch.setitem(tiles.SKIP_MODES, key, "split+in_place")
    gen = fresh_generator()
    params = {"w": torch.randn(N, generator=gen).to(DEVICE, dtype)}
    grads = [{"w": g["w"].to(dtype)} for g in _grads(gen, 12, range(0, 6))]
    tx = ftopt.adam(1e-2, skip_zeros=True, **kw)
    state = tx.init(params)
    modes: list = []
    watched = _run(tx, params, state, grads, modes)
    (group,) = plan_chain(tx).prepared.groups
    assert group.traced.in_place and not group.deferring
    assert group.alternate is not None and not group.alternate.split
    assert modes == [False, True, True, True, False, True, True, True, False, False,
                     False, False]
    assert group.watch.fraction == 0.0 and group.watch.zero_fraction == 2 / 41
    flags = torch.zeros(41, dtype=torch.uint8)
    flags[2:4] = 2  # step 12's whole zero blocks (the tail runs its own body)
    assert torch.equal(group.flags[:41].cpu(), flags)
    # Only the steps that count run the kernel that sets flags (step 12 did not).
    assert not group.counting and not group.variant([0.0]).count_flags
    group.counting = True
    assert group.variant([0.0]).count_flags
    group.counting = False
    monkeypatch.setattr(tiles, "SPLIT_SELECT_ABOVE", 1e9)
    monkeypatch.setattr(tiles, "SPLIT_SELECT_ABOVE_STATES", 1e9)
    never: list = []
    assert same_bits(watched, _run(ftopt.adam(1e-2, skip_zeros=True, **kw), params,
                                   state, grads, never))
    assert not any(never)  # (the control: it never switched)
    # ("select" throughout gives these bytes too: test_skip_tiles' modes each equal the
    # full step)


@pytest.mark.parametrize("layout", ["fp32", "8-bit"])
def test_bound_launches_of_both_modes_follow_moving_gradients(layout, small_blocks,
                                                              small_tiles, bound_calls,
                                                              monkeypatch):
    """Each mode keeps its own bound launches (a group that switches and back rebinds
    neither), and the alternate's take the new gradient addresses as the group's do: new
    gradient tensors every step, bound runs in both modes, the bytes of the group that
    never switches."""
    kw = {"state_bits": 8} if layout == "8-bit" else {}
    gen = fresh_generator()
    params = {"w": torch.randn(N, generator=gen).to(DEVICE)}
    grads = _grads(gen, 12, range(0, 6))
    tx = ftopt.adam(1e-2, skip_zeros=True, **kw)
    state = tx.init(params)
    modes: list = []
    watched = _run(tx, params, state, grads, modes)
    assert modes == [False, True, True, True, False, True, True, True, False, False, False,
                     False]
    prepared = plan_chain(tx).prepared
    (group,) = prepared.groups
    # bound, per (mode, counting?, carve, deferred flags) of each watched group: both
    # modes' plain steps
    flags = tiles.DEFER_FLAGS  # (the deferred kernel's flags a program: skip_watch)
    assert {((0, False, None, flags),), ((1, False, None, flags),)} <= set(prepared._bound_by)
    alternate_runs = prepared._bound_by[((1, False, None, flags),)][2]
    assert alternate_runs and all(b.group is group.alternate for b in alternate_runs)
    assert len(bound_calls) >= 4
    monkeypatch.setattr(tiles, "SPLIT_SELECT_ABOVE", 1e9)
    monkeypatch.setattr(tiles, "DEFER_SELECT_ABOVE", 2.0)
    assert same_bits(watched, _run(ftopt.adam(1e-2, skip_zeros=True, **kw), params, state,
                                   grads))


@pytest.mark.parametrize("layout,rounding,select", [("fp32", None, False),
                                                    ("bf16 states", None, True),
                                                    ("bf16 states", "stochastic", False)])
def test_dense_gradients_pick_the_cheaper_mode_of_the_layout(layout, rounding, select,
                                                             small_tiles, monkeypatch):
    """With dense gradients bf16 states rounded to nearest run "select" (cheaper than
    split+in_place there), the others keep split+in_place; a block all zero in a
    counting step brings bf16 states back (what split+in_place skips)."""
    dtype, kw, key = LAYOUTS[layout]
    kw = {**kw, "state_rounding": rounding} if rounding else kw
    monkeypatch.setitem(tiles.SKIP_MODES, key, "split+in_place")
    gen = fresh_generator()
    params = {"w": torch.randn(N, generator=gen).to(DEVICE, dtype)}
    grads = [{"w": dense_randn(N, generator=gen, dtype=dtype).to(DEVICE)} for _ in range(8)]
    for g in grads[4:]:
        g["w"][:512] = 0.0  # two whole blocks of 41 from step 5 on
    tx = ftopt.adam(1e-2, skip_zeros=True, **kw)
    modes: list = []
    _run(tx, params, tx.init(params), grads, modes)
    # counted at steps 1 and 5 (select) or 1, 3, 5, 7 (split+in_place)
    assert modes == ([False, True, True, True, False, False, False, False] if select
                     else [False] * 8)


def _one_block_layout(layout: str, monkeypatch) -> tuple:
    """(param dtype, adam kwargs) of ``layout`` ("8-bit" or "bf16 states") in its split
    mode, with a spanned alternate of 4 blocks."""
    dtype, kw = ((torch.float32, {"state_bits": 8}) if layout == "8-bit"
                 else LAYOUTS[layout][:2])
    key = "8-bit" if layout == "8-bit" else "16-bit states"
    monkeypatch.setitem(tiles.SKIP_MODES, key,
                        "split+defer" if layout == "8-bit" else "split+in_place")
    monkeypatch.setattr(tiles, "SPAN_ALTERNATES", {key: 4})
    return dtype, kw


def _embedding_tree(gen: torch.Generator, dtype: torch.dtype, steps: int,
                    **extra: int) -> tuple:
    """Params: an embedding of 20 one-block rows ("emb") and a leaf of 26 blocks, the
    last a tail ("w": 8-bit states; a "split+defer" group defers its tail, under
    tiles.DEFER_SELECT_ABOVE of its blocks), after ``extra`` (name -> elements);
    ``steps`` fresh gradients of each."""
    sizes = {**extra, "emb": 256 * 20, "w": 256 * 25 + 77}
    params = {k: torch.randn(n, generator=gen).to(DEVICE, dtype) for k, n in sizes.items()}
    grads = [{k: dense_randn(*v.shape, generator=gen, dtype=dtype).to(DEVICE)
              for k, v in params.items()} for _ in range(steps)]
    return params, grads


@pytest.mark.parametrize("layout", ["8-bit", "bf16 states"])
def test_mostly_zero_gradients_run_the_spanned_alternate(layout, small_blocks, small_tiles,
                                                         bound_calls, monkeypatch):
    """A group of one block a program whose blocks are mostly all zero (32 of 41) runs
    its spanned alternate (programs of 4 blocks: tiles.SPAN_ALTERNATES) until a probe
    finds the zeros gone; its bound launches follow new gradient tensors as the
    group's do. The same bytes as the group that never switches, and skip_zeros held."""
    dtype, kw = _one_block_layout(layout, monkeypatch)
    gen = fresh_generator()
    params = {"w": torch.randn(N, generator=gen).to(DEVICE, dtype)}
    grads = [{"w": g["w"].to(dtype)} for g in _grads(gen, 12, range(0))]
    for g in grads[:6]:
        g["w"][:256 * 32] = 0.0  # (steps 7-12: two whole zero blocks, as _grads gives)
        g["w"][:256 * 32:3] = -0.0  # (zeros too)
    tx = ftopt.adam(1e-2, skip_zeros=True, **kw)
    state = tx.init(params)
    modes: list = []
    watched = _run(tx, params, state, grads, modes)
    prepared = plan_chain(tx).prepared
    (group,) = prepared.groups
    assert group.span == 1 and group.spanned is not None and group.spanned.span == 4
    # counted at steps 1, 5 (probes: still mostly zero) and 9 (the zeros gone)
    assert modes == [0, 2, 2, 2, 0, 2, 2, 2, 0, 0, 0, 0]
    assert group.watch.zero_fraction == 2 / 41  # (8-bit: its flags mark them too)
    spanned_runs = prepared._bound_by[((2, False, None, tiles.DEFER_FLAGS),)][2]
    assert spanned_runs and all(b.group is group.spanned for b in spanned_runs)
    assert len(bound_calls) >= 4
    monkeypatch.setattr(tiles, "SPAN_ABOVE", 2.0)
    never: list = []
    assert same_bits(watched, _run(ftopt.adam(1e-2, skip_zeros=True, **kw), params, state,
                                   grads, never))
    assert 2 not in never  # (the control: it never ran the spanned alternate)
    # skip_zeros held by the spanned steps: blocks zero in steps 2-4 kept their bytes
    # across them (the control: the others changed).
    before = _run(tx, params, state, grads[:1])
    after = _run(tx, params, state, grads[:4])
    assert torch.equal(after[0]["w"][:256 * 32], before[0]["w"][:256 * 32])
    assert not torch.equal(after[0]["w"][256 * 32:], before[0]["w"][256 * 32:])


@pytest.mark.parametrize("layout,rest_part_zero",
                         [("8-bit", False), ("bf16 states", False), ("8-bit", True)])
def test_a_mostly_zero_leaf_runs_spanned_in_a_group_of_its_own(layout, rest_part_zero,
                                                               small_blocks, small_tiles,
                                                               bound_calls, monkeypatch):
    """A leaf whose blocks are mostly all zero (an embedding's unused rows: 18 of 20),
    in a group whose blocks are not (18 of 46), is carved out: it runs spanned
    (tiles.CARVE_SPANS) in a group of its own, the other leaf in the mode its own counts
    choose (dense gradients: bf16 states rounded to nearest run select, 8-bit stays
    split+defer; a zero in each of its blocks: 8-bit runs split+select, where the whole
    group would not carve), until a probe (the carve, the other leaf in the group's own
    mode: ``carve_now``) finds its zeros gone. Its bound launches follow new gradient
    tensors; the same bytes as the group that never carves (the control: it never did),
    and skip_zeros held."""
    dtype, kw = _one_block_layout(layout, monkeypatch)
    monkeypatch.setattr(tiles, "CARVE_MIN_BLOCKS", 8)
    monkeypatch.setattr(tiles, "CARVE_SPANS", {"8-bit": 2})  # (else the alternate's 4)
    span = 2 if layout == "8-bit" else 4
    gen = fresh_generator()
    params, grads = _embedding_tree(gen, dtype, 12)
    rows = torch.randperm(20, generator=gen)[:18]
    for g in grads[:6]:  # 18 of its 20 blocks zero, in another order each step
        g["emb"].view(20, 256)[rows[torch.randperm(18, generator=gen)]] = 0.0
        if rest_part_zero:
            g["w"][::200] = 0.0
    tx = ftopt.adam(1e-2, skip_zeros=True, **kw)
    state = tx.init(params)
    modes, carves = [], []
    p, s = cloned(params), cloned(state)
    for g in grads:
        p, s = ftopt.step(tx, p, g, s, backend="fused", donate=True)
        _counted()
        (group,) = plan_chain(tx).prepared.groups
        modes.append(group.watch.now)
        carves.append(group.watch.carve_now)
    # (dense gradients: bf16 states rounded to nearest run select, 1)
    assert modes == [0, 3, 3, 3, 3, 3, 3, 3, 3] + [int(layout != "8-bit")] * 3
    assert group.watch.zero_fraction == 0.0
    emb = sorted(params).index("emb")
    alternate = layout != "8-bit" or rest_part_zero  # (the other leaf's mode)
    carve = ((emb,), alternate)
    assert carves[1] == carve and carves[4] == carves[8] == ((emb,), False)  # (probes)
    (rest, rest_at), (spanned, spanned_at) = group.watch.carves[carve]
    assert rest.span == 1 and rest.leaves == [group.leaves[1 - emb]]
    assert rest.split == (layout == "8-bit") and rest.deferring == (not alternate)
    assert spanned.span == span and spanned.leaves == [group.leaves[emb]]
    assert spanned.one_leaf and not rest.one_leaf  # (no work table read: one leaf)
    runs = plan_chain(tx).prepared._bound_by[((3, False, carve, tiles.DEFER_FLAGS),)][2]
    assert {id(b.group) for b in runs} >= {id(rest), id(spanned)} and len(bound_calls) >= 4
    monkeypatch.setattr(tiles, "CARVE_MIN_BLOCKS", 10**9)
    tx2 = ftopt.adam(1e-2, skip_zeros=True, **kw)
    never: list = []
    assert same_bits((p, s), _run(tx2, params, tx2.init(params), grads, never))
    assert 3 not in never  # (the control: it never carved)
    # skip_zeros held by the carved steps: the blocks zero in steps 2-4 of a carving
    # group kept their bytes across them (the control: the others changed).
    monkeypatch.setattr(tiles, "CARVE_MIN_BLOCKS", 8)
    tx3 = ftopt.adam(1e-2, skip_zeros=True, **kw)
    modes, stepped = [], []
    after = _run(tx3, params, state, grads[:1] + [grads[1]] * 3, modes, stepped)
    assert modes[1:] == [3, 3, 3]
    zero = (grads[1]["emb"] == 0).view(-1)
    emb_before, emb_after = stepped[0]["emb"].view(-1), after[0]["emb"].view(-1)
    assert torch.equal(emb_after[zero], emb_before[zero])
    assert not torch.equal(emb_after[~zero], emb_before[~zero])


@pytest.mark.parametrize("layout", ["8-bit", "bf16 states"])
def test_a_carves_probe_counts_what_the_whole_group_would(layout, small_blocks, small_tiles,
                                                          monkeypatch):
    """A carving group's probe runs its carve, the other leaves in the group's own mode,
    and counts the flags of its two groups (the spanned leaf's between the others': its
    counts put back in the group's leaf order): the same counts, so the same modes and
    bytes, as a probe that runs the whole group (the control: that one runs mode 0)."""
    dtype, kw = _one_block_layout(layout, monkeypatch)
    monkeypatch.setattr(tiles, "CARVE_MIN_BLOCKS", 8)
    gen = fresh_generator()
    params, grads = _embedding_tree(gen, dtype, 12, a=256 * 16)
    for k, g in enumerate(grads):  # 16-18 of its 20 blocks zero, others each step
        g["emb"].view(20, 256)[torch.randperm(20, generator=gen)[:16 + k % 3]] = 0.0
        g["a"][256 * k:256 * (k + 1)] = 0.0  # (one all-zero block)
        g["w"][k::150] = 0.0
    _plan, _decide = SkipWatch.plan, SkipWatch._decide

    def runs(whole: bool) -> tuple:
        """The modes, the counts read, and the params and states after the steps."""
        def plan(self):
            now = _plan(self)
            if whole and self.sampling and now == 3:  # (the probe of a whole group)
                self.now, self.carve_now = 0, None
            return self.now

        counts = []

        def decide(self, *read):
            counts.append(read)
            _decide(self, *read)

        monkeypatch.setattr(SkipWatch, "plan", plan)
        monkeypatch.setattr(SkipWatch, "_decide", decide)
        tx = ftopt.adam(1e-2, skip_zeros=True, **kw)
        p, s = cloned(params), tx.init(params)
        modes = []
        for g in grads:
            p, s = ftopt.step(tx, p, g, s, backend="fused", donate=True)
            _counted()
            (group,) = plan_chain(tx).prepared.groups
            modes.append((group.watch.now, group.watch.sampling or None))
        return modes, counts, (p, s)

    modes, counts, stepped = runs(False)
    whole_modes, whole_counts, whole_stepped = runs(True)
    assert [m for m, _ in modes] == [0] + [3] * 11
    assert [m for m, _ in whole_modes] == [0, 3, 3, 3, 0, 3, 3, 3, 0, 3, 3, 3]
    assert len(counts) == 3 and counts == whole_counts
    assert counts[1][2:] != counts[2][2:]  # (each leaf's counts, moving)
    assert same_bits(stepped, whole_stepped)


def test_the_watch_counts_each_leafs_zero_blocks_only_after_a_count_finds_some(
        monkeypatch):
    """A carving watch adds each leaf's all-zero blocks and blocks with some zeros to
    its count (flags 2 and 1 in the leaf's run of blocks), carves the leaves over
    tiles.SPAN_ABOVE all zero, and runs the others in the mode their own counts choose;
    once a count finds no all-zero block, the next counts skip the per-leaf sums."""
    monkeypatch.setattr(tiles, "CARVE_MIN_BLOCKS", 2)
    # leaves of 3 and 5 blocks (4 flags of padding)
    flags = torch.zeros(12, dtype=torch.uint8)
    watch = SkipWatch(flags, 8, False, 0.2, 0.6, (3, 5))

    def count(values: list) -> list:
        """The counts of a counting step whose kernel set ``values``."""
        watch.pending = None
        watch.steps = 0
        watch.other = 0  # (a count of the whole group: a carve's probe counts its groups')
        watch.plan()  # (the first step counts)
        assert watch.sampling and watch.now == 0
        flags[:8] = torch.tensor(values, dtype=torch.uint8)
        watch.after()
        counts = watch.pending[1].tolist()
        watch.plan()  # reads it
        return counts

    # set flags 5, their sum 9; leaf 0: 2 of 3 blocks zero (> 0.6), leaf 1: 2 of 5 and
    # 1 with some zeros (leaf 1 alone: (1 - 7.5 * 2) / 5 < 0.2, not select)
    assert count([2, 2, 0, 1, 2, 0, 0, 2]) == [5, 9, 2, 2, 0, 1]
    assert watch.zero_fraction == 0.5 and watch.other == 3 and watch.carve == ((0,), False)
    # leaf 1: 2 of 5 with some zeros, none only zeros (2 / 5 > 0.2: select)
    assert count([2, 2, 0, 1, 1, 0, 0, 0]) == [4, 6, 2, 0, 0, 2]
    assert watch.other == 3 and watch.carve == ((0,), True)
    assert count([0, 0, 0, 1, 0, 0, 0, 0]) == [1, 1, 0, 0, 0, 1]  # (the last had some)
    assert watch.zero_fraction == 0.0 and watch.other == 0 and watch.carve is None
    assert count([0, 0, 0, 1, 0, 0, 0, 0]) == [1, 1]
    # A deferring group (split+defer) whose blocks are many part zero runs split+select,
    # but still carves a mostly all-zero leaf (the others then in split+select).
    flags.zero_()  # (a deferring group's main kernel writes every flag itself)
    watch = SkipWatch(flags, 8, True, 0.04, 0.6, (3, 5))
    assert count([2, 2, 0, 1, 1, 1, 0, 0]) == [5, 7, 2, 0, 0, 3]
    assert watch.fraction == 0.375 and watch.other == 3 and watch.carve == ((0,), True)


@pytest.mark.parametrize("layout, carve_warps, carve_programs",
                         [("8-bit", 0, 0), ("8-bit", 0, 3), ("bf16 states", 2, 0),
                          ("bf16 states", 0, 3)])
def test_a_carves_spanned_group_launches_beside_the_others(layout, carve_warps, carve_programs,
                                                           small_blocks, small_tiles,
                                                           bound_calls, monkeypatch):
    """A carve's spanned group launches on a second stream (ftopt.lowering.streams),
    forked from the caller's after the work before it and joined back after the other
    group's launches, bound or not; each launch once: the same bytes as the launches in
    turn (FTOPT_CARVE_STREAM=0; as the group that never carves:
    test_a_mostly_zero_leaf_runs_spanned_in_a_group_of_its_own). (On a CPU a stand-in
    stream records the order.) ``carve_warps``: the spanned group's programs run that many
    warps (tiles.CARVE_WARPS), the others their tile's; ``carve_programs``: its kernel has
    that many programs a multiprocessor, each looping over spans (tiles.CARVE_PROGRAMS).
    The bound launches on the second stream name it to the launcher."""
    dtype, kw = _one_block_layout(layout, monkeypatch)
    monkeypatch.setattr(tiles, "CARVE_MIN_BLOCKS", 8)
    key = "8-bit" if layout == "8-bit" else "16-bit states"
    monkeypatch.setattr(tiles, "CARVE_WARPS", {key: carve_warps} if carve_warps else {})
    gen = fresh_generator()
    params, grads = _embedding_tree(gen, dtype, 5)
    for g in grads:
        g["emb"].view(20, 256)[torch.randperm(20, generator=gen)[:18]] = 0.0
    real = (streams.fork, streams.on, streams.join, streams.handle)
    log: list = []
    where = {"side": False}
    raw = {}  # (the second stream's raw handle, as the bound launches get it)

    def fork(device):
        log.append("fork")
        side = real[0](device) if DEVICE == "cuda" else "side"
        raw["side"] = real[3](side) if DEVICE == "cuda" else 12345
        return side

    def handle(side):
        return raw["side"]

    @contextlib.contextmanager
    def on(side):
        with real[1](side) if DEVICE == "cuda" else contextlib.nullcontext():
            where["side"] = side is not None
            yield
            where["side"] = False

    def join(device, side):
        assert not where["side"]
        if side is not None:
            log.append("join")
        if DEVICE == "cuda":
            real[2](device, side)

    real_launch, real_bind = launch._launch, launch.bind_main

    warps: list = []
    grids: list = []

    def launched(*args, **kwargs):
        log.append(("launch", where["side"]))
        warps.append((where["side"], dict(args[3])["num_warps"]))
        source = getattr(args[0], "src", None) or inspect.getsource(args[0].fn)
        if "span_blocks" in source:  # (the spanned main kernel's)
            grids.append((where["side"], args[1][0]))
        return real_launch(*args, **kwargs)

    def bind(*args, **kwargs):
        bound = real_bind(*args, **kwargs)
        for b in bound or ():
            # (a bound launch on the second stream names it, not made current)
            b.runner = (lambda *a, _run=b.runner, _b=b, **k:
                        (log.append(("bound", _b.group.beside,
                                     "stream" in k and k["stream"] == raw["side"]
                                     and not where["side"])), _run(*a, **k))[1])
        return bound

    tx = ftopt.adam(1e-2, skip_zeros=True, **kw)
    state = tx.init(params)
    monkeypatch.setattr(streams, "ON", False)
    monkeypatch.setattr(tiles, "CARVE_PROGRAMS", {})
    in_turn = _run(tx, params, state, grads)  # (a program a span)
    monkeypatch.setattr(streams, "ON", True)
    monkeypatch.setattr(tiles, "CARVE_PROGRAMS",
                        {key: carve_programs} if carve_programs else {})
    monkeypatch.setattr(streams, "multiprocessors", lambda device: 1)  # (fewer than spans)
    tx = ftopt.adam(1e-2, skip_zeros=True, **kw)  # (its carve built anew)
    for name, stand_in in (("fork", fork), ("on", on), ("join", join), ("handle", handle)):
        monkeypatch.setattr(streams, name, stand_in)
    monkeypatch.setattr(launch, "_launch", launched)
    monkeypatch.setattr(launch, "bind_main", bind)
    modes: list = []
    assert same_bits(_run(tx, params, state, grads, modes), in_turn)
    assert 3 in modes  # (it carved)
    (group,) = plan_chain(tx).prepared.groups
    (rest, _), (spanned, _) = group.watch.carves[group.watch.carve]
    assert spanned.beside and not rest.beside
    # Each fork is joined after the launches that follow it; the bound launches of the
    # spanned group ran on the second stream, the others' on the caller's.
    bound = [x for x in log if x[0] == "bound"]
    assert bound and all([beside == side for _, beside, side in bound])
    assert {beside for _, beside, _ in bound} == {True, False}
    forks = [i for i, x in enumerate(log) if x == "fork"]
    joins = [i for i, x in enumerate(log) if x == "join"]
    assert len(forks) == len(joins) >= 2 and all([f < j for f, j in zip(forks, joins)])
    assert all([f > j for f, j in zip(forks[1:], joins)])
    # (unbound: the carve's first step launches through run_main, the spanned group's
    # kernels on the second stream)
    assert any([x == ("launch", True) for x in log])
    beside_warps = {w for side, w in warps if side}
    others = {w for side, w in warps if not side}
    assert len(others) == 1 and beside_warps == ({carve_warps} if carve_warps else others)
    # (a program a span, or fewer, each looping over spans)
    programs = carve_programs
    spans = -(-len(spanned.work.main_leaf) // spanned.span)
    assert spans >= 5 and spans > programs
    assert {n for side, n in grids if side} == {programs or spans}
    source = codegen.main_source(spanned.traced, spanned.variant([0.0]))
    assert spanned.variant([0.0]).looped == (spans if programs else 0)
    assert ("for span_at in range(" in source) == bool(programs)


def test_a_carves_probe_kernels_launch_first_in_a_loops_first_steps(small_blocks,
                                                                   small_tiles,
                                                                   monkeypatch):
    """The first probe of a mode comes at a step 1 mod tiles.WATCH_FIRST_PROBE, so that
    the kernels its probe runs (a carve's, counting) launch first, and compile, in a
    loop's first steps and not a probe period in. bf16 states, an embedding's rows
    mostly zero beside dense gradients: the carve runs select beside the spanned leaf,
    its probe split and counting. With the first probe at step 3 no step after it
    launches a kernel (and constants) not launched before; the control (the first probe
    a probe period in, step 9) launches new ones there. The same bytes either way."""
    dtype, kw = _one_block_layout("bf16 states", monkeypatch)
    monkeypatch.setattr(tiles, "CARVE_MIN_BLOCKS", 8)
    monkeypatch.setattr(tiles, "WATCH_PROBE", 8)
    gen = fresh_generator()
    params, grads = _embedding_tree(gen, dtype, 12)
    for g in grads:
        g["emb"].view(20, 256)[torch.randperm(20, generator=gen)[:18]] = 0.0
    real = launch._launch
    seen: dict = {}

    def launched(kernel, grid, args, constants, device, key=()):
        seen.setdefault((kernel, constants, key), step[0])
        return real(kernel, grid, args, constants, device, key)

    monkeypatch.setattr(launch, "_launch", launched)
    out, firsts, probes = [], [], []
    for first in (2, 8):
        monkeypatch.setattr(tiles, "WATCH_FIRST_PROBE", first)
        seen.clear()
        tx = ftopt.adam(1e-2, skip_zeros=True, **kw)
        p, s = cloned(params), tx.init(params)
        step, sampled = [0], []
        for k, g in enumerate(grads, 1):
            step[0] = k
            p, s = ftopt.step(tx, p, g, s, backend="fused", donate=True)
            _counted()
            (group,) = plan_chain(tx).prepared.groups
            if group.watch.now == 3 and group.watch.carve_now != group.watch.carve:
                sampled.append(k)  # (a probe: the carve, the others split)
        out.append((p, s))
        firsts.append(sorted(set(seen.values())))
        probes.append(sampled)
        assert group.watch.carve[1]  # (the others ran select: the probe is another carve)
    assert probes[0][:2] == [3, 9] and probes[1][:1] == [9]
    assert max(firsts[0]) <= 3
    assert 9 in firsts[1]  # (the control: the kernels of the probe launched first there)
    assert same_bits(*out)


def test_the_default_schedule_counts_at_1_and_17_then_every_64(monkeypatch):
    """With the default periods (tiles.WATCH_PERIOD 16, WATCH_FIRST_PROBE 16,
    WATCH_PROBE 64), a group whose blocks are all part zero counts at step 1, runs its
    alternate from step 2, probes first at step 17 and then at 65, 129, 193; a group that
    stays in its own mode counts every 16 steps."""
    for name, value in (("WATCH_PERIOD", 16), ("WATCH_FIRST_PROBE", 16), ("WATCH_PROBE", 64)):
        monkeypatch.setattr(tiles, name, value)
    for values, other, expected in (([1] * 8, 1, [1, 17, 65, 129, 193]),
                                    ([0] * 8, 0, list(range(1, 200, 16)))):
        flags = torch.zeros(8, dtype=torch.uint8)
        watch = SkipWatch(flags, 8, False, 0.2)
        counted, modes = [], []
        for step in range(1, 200):
            watch.plan()
            modes.append(watch.now)
            if watch.sampling:
                counted.append(step)
                flags[:] = torch.tensor(values, dtype=torch.uint8)
            watch.after()  # (on the CPU the count is read at the next step)
        assert counted == expected
        assert set(modes[1:]) - {0} == ({other} if other else set())
        assert all(modes[k - 1] == 0 for k in counted)
