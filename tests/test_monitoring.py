"""snapshot, monitor and measure_with_ema (ftopt.monitoring): measurements of a chain's
intermediate updates kept in the state, on both backends; the registry suites cover
snapshot and monitor as transforms (purity, pytrees, errors, checkpoints, fused against
eager), this file their values and measure_with_ema, whose update gives a measurement."""

from __future__ import annotations

import math

import pytest
import torch
from step_checks import bits, cloned, fresh_generator, same_bits

import ftopt

FUSED = "fused"  # (the Triton interpreter on a CPU: conftest sets TRITON_INTERPRET)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _f_grads(p: dict) -> dict:
    return {"x": 2 * p["x"]}  # f(x) = sum x², as optax's examples


def _clip_steps(tx, steps: int, backend: str, names: tuple) -> list:
    params = {"x": torch.tensor([1.0, 2.0, 3.0], device=DEVICE)}
    state = tx.init(params)
    seen = []
    for _ in range(steps):
        params, state = ftopt.step(tx, params, _f_grads(params), state, backend=backend)
        seen.append([float(ftopt.tree.get(state, n)) for n in names])
    return seen


def _reference(steps: int, clip: float) -> list:
    """float64: SGD with momentum 0.9 and lr 0.1, the update's norm before
    clip_by_global_norm(clip), and an EMA (0.9, debiased) of whether it exceeds ``clip``."""
    x, trace, ema, out = [1.0, 2.0, 3.0], [0.0] * 3, 0.0, []
    for t in range(1, steps + 1):
        g = [2 * v for v in x]
        trace = [gi + 0.9 * ti for gi, ti in zip(g, trace)]
        u = [-0.1 * ti for ti in trace]
        norm = math.sqrt(sum(v * v for v in u))
        ema = 0.9 * ema + 0.1 * float(norm > clip)
        out.append((norm, ema / (1 - 0.9 ** t)))
        scale = min(1.0, clip / norm)
        x = [xi + scale * ui for xi, ui in zip(x, u)]
    return out


@pytest.mark.parametrize("backend", ["eager", FUSED])
def test_snapshot_keeps_the_norm_before_the_clip(backend):
    """optax's example: the norm of SGD's update before clip_by_global_norm(0.05), 0.748
    then 1.41, against float64."""
    tx = ftopt.chain(ftopt.sgd(0.1, momentum=0.9),
                     ftopt.snapshot("norm_before_clip", ftopt.tree.norm),
                     ftopt.clip_by_global_norm(0.05))
    got = _clip_steps(tx, 4, backend, ("norm_before_clip",))
    want = _reference(4, 0.05)
    assert [round(g[0], 2) for g in got[:2]] == [0.75, 1.41]
    for (g,), (w, _) in zip(got, want):
        assert g == pytest.approx(w, rel=1e-6)


@pytest.mark.parametrize("backend", ["eager", FUSED])
def test_monitor_keeps_a_norm_and_an_average(backend):
    """optax's monitor example: the norm before clip_by_global_norm(1.0) and a debiased EMA
    (0.9) of whether it clipped: 0 at step 1, 0.526 at step 2, against float64."""
    tx = ftopt.chain(ftopt.sgd(0.1, momentum=0.9),
                     ftopt.monitor({"norm_before_clip": ftopt.tree.norm,
                                    "is_clipped_ema": ftopt.measure_with_ema(
                                        lambda u: ftopt.tree.norm(u) > 1.0, decay=0.9)}),
                     ftopt.clip_by_global_norm(1.0))
    params = {"x": torch.tensor([1.0, 2.0, 3.0], device=DEVICE)}
    state = tx.init(params)
    # At init: the function's value on the params, zeros for the transform's.
    assert float(ftopt.tree.get(state, "norm_before_clip")) == pytest.approx(math.sqrt(14))
    assert float(ftopt.tree.get(state, "is_clipped_ema")) == 0.0
    got = _clip_steps(tx, 5, backend, ("norm_before_clip", "is_clipped_ema"))
    want = _reference(5, 1.0)
    assert round(got[1][1], 3) == 0.526
    for g, w in zip(got, want):
        assert g == pytest.approx(list(w), rel=1e-6)


def _chain(measure, skip: bool):
    return ftopt.chain(ftopt.adam(1e-2), ftopt.snapshot("u", measure), ftopt.trace(0.5),
                       *([ftopt.skip_zeros()] if skip else []))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("donate", [False, True])
def test_fused_segments_match_eager_and_see_the_masked_update(dtype, donate):
    """In a skip_zeros chain the measure sees (and the stage passes on) -0.0 where the raw
    gradient is zero, in fp32 for bf16 params. The fused step (segments around the stage)
    measures what the eager step does, and on each backend the chain steps the params as
    it does without the stage, bit for bit. The control: without skip_zeros those elements
    of the measured update are not -0.0."""
    gen = fresh_generator()
    params = {"w": torch.randn(3, 70, generator=gen).to(DEVICE, dtype),
              "b": torch.randn(33, generator=gen).to(DEVICE, dtype)}
    grads = [{k: torch.randn(v.shape, generator=gen).to(DEVICE, dtype)
              for k, v in params.items()} for _ in range(3)]
    grads[2]["w"][1] = 0.0
    grads[2]["b"][::4] = 0.0
    zero = {k: v == 0 for k, v in grads[2].items()}

    def run(tx, backend):
        p, s = cloned(params), tx.init(params)
        for g in grads:
            p, s = ftopt.step(tx, p, g, s, backend=backend, donate=donate)
        return p, s

    out = {}
    for skip in (True, False):
        for backend in ("eager", FUSED):
            p, s = run(_chain(lambda u: ftopt.tree.map(torch.clone, u), skip), backend)
            out[skip, backend] = ftopt.tree.get(s, "u")
            unmeasured = ftopt.chain(ftopt.adam(1e-2), ftopt.trace(0.5),
                                     *([ftopt.skip_zeros()] if skip else []))
            assert same_bits(p, run(unmeasured, backend)[0]), (skip, backend)
        for k in params:
            eager, fused = out[skip, "eager"][k], out[skip, FUSED][k]
            assert eager.dtype == fused.dtype == torch.float32
            torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-6)
    for backend in ("eager", FUSED):
        for k in params:
            masked, plain = out[True, backend][k], out[False, backend][k]
            assert (bits(masked)[zero[k]] == bits(torch.tensor(-0.0, device=DEVICE))).all()
            assert (plain[zero[k]] != 0).all()  # (Adam's update from its moments)


@pytest.mark.parametrize("backend", ["eager", FUSED])
def test_a_first_stage_measures_the_masked_gradient(backend):
    """A snapshot at the head of a skip_zeros chain sees the raw gradient with -0.0 where
    it is zero (SPEC §3: a reduction sees the masked update); the control: without
    skip_zeros it sees the gradient's +0.0."""
    gen = fresh_generator()
    params = {"w": torch.randn(50, generator=gen).to(DEVICE)}
    g = {"w": torch.randn(50, generator=gen).to(DEVICE)}
    g["w"][::3] = 0.0
    for skip, want in ((True, -0.0), (False, 0.0)):
        tx = ftopt.chain(ftopt.snapshot("g", lambda u: ftopt.tree.map(torch.clone, u)),
                         ftopt.adam(1e-2), *([ftopt.skip_zeros()] if skip else []))
        _, state = ftopt.step(tx, params, g, tx.init(params), backend=backend)
        seen = ftopt.tree.get(state, "g")["w"]
        assert (bits(seen[::3]) == bits(torch.tensor(want, device=DEVICE))).all(), skip
        assert torch.equal(seen[1::3], g["w"][1::3])


def test_a_measure_that_changes_its_form_is_refused_naming_it():
    params = {"w": torch.randn(8)}
    calls = []

    def grows(u):
        calls.append(1)
        return torch.zeros(len(calls))

    tx = ftopt.chain(ftopt.sgd(0.1), ftopt.snapshot("grows", grows))
    state = tx.init(params)
    before = cloned((params, state))
    with pytest.raises(ValueError, match="measure 'grows' gave a value of another"):
        ftopt.step(tx, params, {"w": torch.randn(8)}, state, backend="eager")
    assert same_bits(before, (params, state))


def test_later_values_are_stored_in_the_first_ones_dtype():
    """A measure that gives an int (a sum over no element) or a wider float later is
    stored in the dtype of its value at init."""
    params = {"w": torch.randn(8)}
    given = iter([torch.tensor(1.5), 7, torch.tensor(2.25, dtype=torch.float64)])
    tx = ftopt.chain(ftopt.sgd(0.1), ftopt.snapshot("m", lambda u: next(given)))
    state = tx.init(params)
    for want in (7.0, 2.25):
        params, state = ftopt.step(tx, params, {"w": torch.randn(8)}, state, backend="eager")
        got = ftopt.tree.get(state, "m")
        assert got.dtype == torch.float32 and float(got) == want


@pytest.mark.parametrize("make, match", [
    (lambda: ftopt.monitor({}), "non-empty dict"),
    (lambda: ftopt.monitor([ftopt.tree.norm]), "non-empty dict"),
    (lambda: ftopt.monitor({"n": 3.0}), "measure 'n' must be a function"),
    (lambda: ftopt.monitor({1: ftopt.tree.norm}), "names must be strings"),
    (lambda: ftopt.snapshot("n", ftopt.adam(1e-3)), "must be a function of the updates, "),
    (lambda: ftopt.snapshot(3, ftopt.tree.norm), "measure_name must be a string"),
    (lambda: ftopt.measure_with_ema(3, 0.9), "measure must be a function"),
    (lambda: ftopt.measure_with_ema(ftopt.tree.norm, 0.9, accumulator_dtype=torch.int32),
     "accumulator_dtype"),
])
def test_bad_arguments_are_refused(make, match):
    with pytest.raises(TypeError, match=match):
        make()


def test_a_state_of_another_monitor_is_refused():
    params = {"w": torch.randn(8)}
    a = ftopt.monitor({"n": ftopt.tree.norm})
    b = ftopt.monitor({"m": ftopt.tree.norm})
    with pytest.raises(ValueError, match=r"measurements are \['n'\], expected \['m'\]"):
        b.update({"w": torch.randn(8)}, a.init(params))
    with pytest.raises(TypeError, match="expected a MonitorState, got SnapshotState"):
        b.update({"w": torch.randn(8)}, ftopt.snapshot("m", ftopt.tree.norm).init(params))


def test_measure_with_ema_averages_the_measurement():
    """Its update gives the (debiased) average of the measure, in float64 here, a bool
    measure in the default float dtype; ``debias=False`` the average itself."""
    gen = fresh_generator()
    us = [{"w": torch.randn(5, generator=gen)} for _ in range(4)]
    for debias in (True, False):
        tx = ftopt.measure_with_ema(ftopt.tree.norm, 0.8, debias=debias,
                                    accumulator_dtype=torch.float64)
        state = tx.init(us[0])
        average = 0.0
        for t, u in enumerate(us, 1):
            value, state = tx.update(u, state)
            norm = float(ftopt.tree.norm(u))  # (the measure, in fp32; averaged in fp64)
            average = 0.8 * average + 0.2 * norm
            assert value.dtype == torch.float64
            assert float(value) == pytest.approx(average / (1 - 0.8 ** t) if debias
                                                 else average, rel=1e-12)
    flag = ftopt.measure_with_ema(lambda u: ftopt.tree.norm(u) > 0.0, 0.5)
    value, _ = flag.update(us[0], flag.init(us[0]))
    assert value.dtype == torch.float32 and float(value) == 1.0


def test_explain_names_the_measuring_segment():
    tx = ftopt.chain(ftopt.adam(1e-3), ftopt.monitor({"n": ftopt.tree.norm}),
                     ftopt.clip_by_global_norm(1.0))
    text = ftopt.explain(tx, {"w": torch.randn(4)})
    assert ("[scale_by_adam, scale_by_learning_rate] fused -> monitor (matrix stage: torch, "
            "the measures on the updates tree) -> [clip_by_global_norm] fused") in text


@pytest.mark.parametrize("backend", ["eager", FUSED])
def test_leaves_split_across_ranks_are_refused_where_no_dtensor_view(backend):
    """On local shards (FSDP2's Shard(0)) a measure sees whole leaves as DTensors
    (tests/test_distributed.py); a call whose context cannot give those (one process: the
    context here says what the shards are, no more) refuses a split leaf before anything
    is written, naming the stage, the leaf and its placements, rather than measure each
    rank's part; a replicated leaf is fine."""
    from torch.distributed.tensor import Shard

    gen = fresh_generator()
    params = {"w": torch.randn(4, 6, generator=gen).to(DEVICE),
              "b": torch.randn(6, generator=gen).to(DEVICE)}
    grads = {k: torch.randn(v.shape, generator=gen).to(DEVICE) for k, v in params.items()}
    tx = ftopt.chain(ftopt.adam(1e-2), ftopt.monitor({"n": ftopt.tree.norm}))
    state = tx.init(params)
    before = cloned((params, state))
    context = ftopt.shards.LocalShards(splits={"['w']": ((Shard(0),), frozenset({0}))},
                                       shapes={"['w']": (8, 6)})
    with ftopt.shards.local_shards(context), pytest.raises(ValueError) as err:
        ftopt.step(tx, params, grads, state, donate=True, backend=backend)
    assert "monitor at ['w']: the leaf is sharded with placements (Shard(dim=0),)" in str(
        err.value)
    assert same_bits(before, (params, state))
    context = ftopt.shards.LocalShards(splits={"['w']": ((Shard(0),), frozenset())})
    with ftopt.shards.local_shards(context):
        ftopt.step(tx, params, grads, state, backend=backend)
