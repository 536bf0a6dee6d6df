"""Tests for ftopt.schedules.cycles against float64 transcriptions of optax's definitions:
piecewise interpolation, one-cycle, warmup + exponential decay, SGDR."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_schedules import COUNTS, as_tensor_value, check, ref_exponential, ref_warmup_cosine

from ftopt.schedules import (
    cosine_onecycle_schedule,
    linear_onecycle_schedule,
    piecewise_interpolate_schedule,
    sgdr_schedule,
    warmup_exponential_decay_schedule,
)

# ---------------------------------------------------------------- optax's formulas, float64


def ref_interpolate(kind, init, bs, t):
    """optax.piecewise_interpolate_schedule, its array formula in Python floats."""
    items = sorted(bs.items())
    bounds = [0] + [b for b, _ in items]
    values = [init]
    for _, s in items:
        values.append(values[-1] * s)
    out = 0.0
    for i in range(len(bounds) - 1):
        size = max(bounds[i + 1] - bounds[i], 1)
        if bounds[i] <= t < bounds[i + 1]:
            pct = (t - bounds[i]) / size
            start, end = values[i], values[i + 1]
            if kind == "linear":
                out += (end - start) * pct + start
            else:
                out += end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
    return out + (values[-1] if bounds[-1] <= t else 0.0)


def ref_linear_onecycle(steps, peak, pct_start, pct_final, div, final_div, t):
    bs = {int(pct_start * steps): div, int(pct_final * steps): 1.0 / div,
          steps: 1.0 / final_div}
    return ref_interpolate("linear", peak / div, bs, t)


def ref_cosine_onecycle(steps, peak, pct_start, div, final_div, t):
    bs = {int(pct_start * steps): div, int(steps): 1.0 / (div * final_div)}
    return ref_interpolate("cosine", peak / div, bs, t)


def ref_linear(init, end, steps, t):
    return init if steps <= 0 else init + (end - init) * min(max(t, 0), steps) / steps


# ---------------------------------------------------------------- piecewise interpolation


@pytest.mark.parametrize("kind", ["linear", "cosine"])
@pytest.mark.parametrize(
    "bs", [None, {}, {4: 0.1, 8: 0.01}, {30: 0.1, 10: 0.5, 20: 2.0}, {0: 0.25, 5: 0.0},
           {7: 3.0, 9: 1.0}, {-2: 3.0, 6: 0.5}, {100: 1e-4}],
)
def test_piecewise_interpolate(kind, bs):
    fn = piecewise_interpolate_schedule(kind, 0.8, bs)
    counts = COUNTS + [b + d for b in (bs or {}) for d in (-1, 0, 1)]
    check(fn, lambda t: ref_interpolate(kind, 0.8, bs or {}, t), counts=counts, atol=1e-12,
          host_rtol=1e-12)


def test_piecewise_interpolate_optax_example():
    # optax's docstring: linear, init 1.0, {4: 0.1, 8: 0.01}, at steps 0, 2, ..., 10
    fn = piecewise_interpolate_schedule("linear", 1.0, {4: 0.1, 8: 0.01})
    want = [1.0, 0.55, 0.1, 0.0505, 0.001, 0.001]
    assert [fn(t) for t in range(0, 11, 2)] == pytest.approx(want, rel=1e-12)


def test_piecewise_interpolate_negative_count_is_zero_as_optax():
    for fn in (piecewise_interpolate_schedule("linear", 2.0, {5: 0.5}),
               piecewise_interpolate_schedule("cosine", 2.0)):
        assert fn(-1) == 0.0 and as_tensor_value(fn, -1).item() == 0.0
        assert fn(0) == 2.0 and as_tensor_value(fn, 0).item() == 2.0


def test_piecewise_interpolate_tensor_path_keeps_small_levels():
    # down by 1e-6 over 1000 steps: a + (b - a)·g in float32 would leave ~1e-7 absolute
    # error, 10% of the value near the end; a·f + b·g keeps it relative.
    for kind in ("linear", "cosine"):
        fn = piecewise_interpolate_schedule(kind, 1.0, {1000: 1e-6})
        for t in (990, 997, 998, 999, 1000):
            want = ref_interpolate(kind, 1.0, {1000: 1e-6}, t)
            assert as_tensor_value(fn, t).item() == pytest.approx(want, rel=2e-6), (kind, t)


def test_piecewise_interpolate_large_counts_exact():
    big = 2**40
    fn = piecewise_interpolate_schedule("linear", 1.0, {big: 0.5, big + 4: 0.0})
    assert fn(big + 1) == 0.375 and as_tensor_value(fn, big + 1).item() == 0.375
    assert fn(big // 2) == 0.75 and as_tensor_value(fn, big // 2).item() == 0.75
    assert as_tensor_value(fn, big + 3).item() == fn(big + 3) == 0.125


# ---------------------------------------------------------------- one cycle


@pytest.mark.parametrize("steps", [1, 7, 100, 1000])
@pytest.mark.parametrize("pct_start,pct_final", [(0.3, 0.85), (0.25, 0.5), (0.0, 1.0)])
def test_linear_onecycle(steps, pct_start, pct_final):
    fn = linear_onecycle_schedule(steps, 0.1, pct_start, pct_final, 20.0, 1e3)
    ref = lambda t: ref_linear_onecycle(steps, 0.1, pct_start, pct_final, 20.0, 1e3, t)
    counts = [t for t in COUNTS if t >= 0] + [int(pct_start * steps), int(pct_final * steps),
                                              steps - 1, steps, steps + 1]
    check(fn, ref, counts=counts, atol=1e-12, host_rtol=1e-12)


@pytest.mark.parametrize("steps", [1, 9, 100, 1000])
@pytest.mark.parametrize("pct_start", [0.3, 0.0, 1.0])
def test_cosine_onecycle(steps, pct_start):
    fn = cosine_onecycle_schedule(steps, 0.1, pct_start, 25.0, 1e4)
    ref = lambda t: ref_cosine_onecycle(steps, 0.1, pct_start, 25.0, 1e4, t)
    counts = [t for t in COUNTS if t >= 0] + [int(pct_start * steps), steps - 1, steps]
    check(fn, ref, counts=counts, atol=1e-12, host_rtol=1e-12)


def test_onecycle_shape():
    lin = linear_onecycle_schedule(1000, 2.0)  # optax's defaults: 0.3, 0.85, 25, 1e4
    assert lin(0) == pytest.approx(2.0 / 25) and lin(300) == pytest.approx(2.0)
    assert lin(850) == pytest.approx(2.0 / 25) and lin(1000) == pytest.approx(2.0 / 25 / 1e4)
    assert lin(10**6) == lin(1000)
    cos = cosine_onecycle_schedule(1000, 2.0)
    assert cos(0) == pytest.approx(2.0 / 25) and cos(300) == pytest.approx(2.0)
    assert cos(1000) == pytest.approx(2.0 / 25 / 1e4) and cos(10**6) == cos(1000)
    values = [cos(t) for t in range(0, 1001)]
    assert all(a < b for a, b in zip(values[:300], values[1:301]))
    assert all(a > b for a, b in zip(values[300:1000], values[301:1001]))


@settings(max_examples=30, deadline=None)
@given(steps=st.integers(1, 10**5), peak=st.floats(1e-6, 10.0), pct=st.floats(0.0, 1.0),
       frac=st.floats(0.0, 1.5))
def test_onecycle_int_and_tensor_paths_agree(steps, peak, pct, frac):
    t = int(frac * steps)
    for fn in (linear_onecycle_schedule(steps, peak, pct, max(pct, 0.85)),
               cosine_onecycle_schedule(steps, peak, pct)):
        want = fn(t)
        assert as_tensor_value(fn, t).item() == pytest.approx(want, rel=2e-6, abs=1e-12 * peak)


# ---------------------------------------------------------------- warmup + exponential


@pytest.mark.parametrize("warmup", [0, 1, 10])
@pytest.mark.parametrize("begin,staircase,end", [(0, False, None), (5, True, None),
                                                 (3, False, 1e-2)])
def test_warmup_exponential(warmup, begin, staircase, end):
    fn = warmup_exponential_decay_schedule(1e-4, 1e-2, warmup, 7, 0.5, begin, staircase, end)

    def ref(t):
        if t < warmup:
            return ref_linear(1e-4, 1e-2, warmup, t)
        return ref_exponential(1e-2, 7, 0.5, begin, staircase, end, t - warmup)

    counts = [t for t in COUNTS if 0 <= t <= 200] + [warmup - 1, warmup, warmup + 1]
    check(fn, ref, counts=[t for t in counts if t >= 0], rtol=2e-5, atol=1e-30)


# ---------------------------------------------------------------- SGDR


def test_sgdr():
    cycles = [dict(init_value=0.0, peak_value=1.0, warmup_steps=3, decay_steps=10),
              dict(init_value=0.1, peak_value=0.5, warmup_steps=0, decay_steps=20,
                   end_value=0.05),
              dict(init_value=0.0, peak_value=0.25, warmup_steps=5, decay_steps=15.0,
                   exponent=2.0)]
    fn = sgdr_schedule(iter(cycles))  # any iterable, as optax

    def ref(t):  # optax: join_schedules(cycles, cumulative decay_steps[:-1])
        start = 0
        for i, kw in enumerate(cycles):
            steps = int(kw["decay_steps"])
            if t < start + steps or i == len(cycles) - 1:
                return ref_warmup_cosine(kw["init_value"], kw["peak_value"], kw["warmup_steps"],
                                         steps, kw.get("end_value", 0.0),
                                         kw.get("exponent", 1.0), max(t - start, 0))
            start += steps

    check(fn, ref, counts=list(range(0, 60)) + [100, 10**4], atol=1e-12, host_rtol=1e-9)
    assert fn(10) == pytest.approx(0.5) and fn(30) == 0.0  # each restart at its peak


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: piecewise_interpolate_schedule("step", 1.0), ValueError, "interpolate_type"),
        (lambda: piecewise_interpolate_schedule("linear", 1.0, {3: -0.5}), ValueError,
         "scale at boundary 3"),
        (lambda: piecewise_interpolate_schedule("cosine", math.nan), ValueError, "init_value"),
        (lambda: piecewise_interpolate_schedule("linear", 1.0, [(3, 0.5)]), TypeError,
         "mapping"),
        (lambda: piecewise_interpolate_schedule("linear", 1.0, {2.5: 0.5}), TypeError,
         "boundary"),
        (lambda: linear_onecycle_schedule(0, 1.0), ValueError, "transition_steps"),
        (lambda: cosine_onecycle_schedule(-5, 1.0), ValueError, "transition_steps"),
        (lambda: linear_onecycle_schedule(10, 1.0, div_factor=0.0), ValueError, "div_factor"),
        (lambda: cosine_onecycle_schedule(10, 1.0, final_div_factor=-1.0), ValueError,
         "final_div_factor"),
        (lambda: cosine_onecycle_schedule(10, 1.0, div_factor=1e-200,
                                          final_div_factor=1e-200), ValueError, "div_factor"),
        (lambda: linear_onecycle_schedule(10, math.inf), ValueError, "peak_value"),
        (lambda: warmup_exponential_decay_schedule(0.0, 1.0, 5, 10, -0.5), ValueError,
         "warmup_exponential_decay_schedule: decay_rate"),
        (lambda: warmup_exponential_decay_schedule(0.0, 1.0, 2.5, 10, 0.5), TypeError,
         "warmup_steps"),
        (lambda: sgdr_schedule([]), ValueError, "at least one"),
        (lambda: sgdr_schedule([dict(init_value=0.0, peak_value=1.0, warmup_steps=1)]),
         TypeError, r"cosine_kwargs\[0\].*decay_steps"),
        (lambda: sgdr_schedule([dict(init_value=0.0, peak_value=1.0, warmup_steps=1,
                                     decay_steps=4),
                                dict(init_value=0.0, peak_value=1.0, warmup_steps=4,
                                     decay_steps=4)]),
         ValueError, r"sgdr_schedule: cosine_kwargs\[1\]: .*decay_steps"),
    ],
)
def test_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_tensor_path_dtype_and_device():
    fn = cosine_onecycle_schedule(50, 1.0)
    out = fn(torch.tensor(7, dtype=torch.int32))
    assert out.dtype == torch.float32 and out.shape == () and out.device.type == "cpu"
