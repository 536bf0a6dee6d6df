"""Tests for ftopt.schedules: reference formulas, int/tensor agreement, no host sync."""

import inspect
import math
import re
from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ftopt.schedules as sched_mod
from ftopt.schedules import (
    ademamix_alpha_warmup,
    ademamix_b3_warmup,
    constant_schedule,
    cosine_decay_schedule,
    exponential_decay,
    join_schedules,
    linear_schedule,
    piecewise_constant_schedule,
    polynomial_schedule,
    warmup_constant_schedule,
    warmup_cosine_decay_schedule,
)

COUNTS = list(range(-3, 12)) + [19, 20, 21, 49, 50, 51, 99, 100, 101, 1000, 10**6]


# ---------------------------------------------------------------- independent references
# Written from optax's / bitsandbytes' definitions (float64), not from ftopt's code.


def ref_polynomial(init, end, power, steps, begin, t):
    if steps <= 0:
        return init
    begin = max(begin, 0)
    c = min(max(t - begin, 0), steps)
    return (init - end) * (1 - c / steps) ** power + end


def ref_exponential(init, steps, rate, begin, staircase, end, t):
    if steps <= 0 or rate == 0:
        return init
    begin = max(begin, 0)
    p = (t - begin) / steps
    if staircase:
        p = math.floor(p)
    v = init if t - begin <= 0 else init * rate**p
    if end is not None:
        v = max(v, end) if rate < 1 else min(v, end)
    return v


def ref_cosine(init, steps, alpha, exponent, t):
    c = min(t, steps)
    return init * ((1 - alpha) * (0.5 * (1 + math.cos(math.pi * c / steps))) ** exponent + alpha)


def ref_warmup_cosine(init, peak, warmup, total, end, exponent, t):
    if t < warmup:
        return init + (peak - init) * max(t, 0) / warmup
    d = min(t - warmup, total - warmup)
    cos = 0.5 * (1 + math.cos(math.pi * d / (total - warmup)))
    return end + (peak - end) * cos**exponent


def ref_piecewise(init, bs, t):
    v = init
    for b in sorted(bs):
        if t >= b:
            v *= bs[b]
    return v


def bnb_alpha(alpha, t_alpha, step):  # bitsandbytes AdEMAMix.update_step
    return min(step * alpha / t_alpha, alpha)


def bnb_beta3(beta1, beta3, t_beta3, step):  # bitsandbytes AdEMAMix.update_step
    ln_beta1, ln_beta3 = math.log(beta1), math.log(beta3)
    s = step / t_beta3
    return min(math.exp((ln_beta1 * ln_beta3) / (((1 - s) * ln_beta3) + (s * ln_beta1))), beta3)


# ---------------------------------------------------------------- helpers


def as_tensor_value(fn, t, dtype=torch.int64):
    out = fn(torch.tensor(t, dtype=dtype))
    # float32, except the AdEMAMix β3 warm-up (float64: see its docstring)
    assert isinstance(out, torch.Tensor) and out.shape == ()
    assert out.dtype in (torch.float32, torch.float64)
    return out


def check(fn, ref, counts=COUNTS, rtol=1e-6, atol=1e-7, host_rtol=1e-12, host_atol=1e-15):
    """Host path == reference (float64) and tensor path == reference (float32)."""
    for t in counts:
        want = ref(t)
        got = fn(t)
        assert type(got) is float, (t, type(got))
        assert got == pytest.approx(want, rel=host_rtol, abs=host_atol), t
        dev = as_tensor_value(fn, t).item()
        assert dev == pytest.approx(want, rel=rtol, abs=atol), t
        assert dev == pytest.approx(got, rel=rtol, abs=atol), t


# ---------------------------------------------------------------- schedules vs references


def test_constant():
    check(constant_schedule(0.3), lambda t: 0.3)
    assert constant_schedule(2)(5) == 2.0 and type(constant_schedule(2)(5)) is float


@pytest.mark.parametrize("begin", [0, 5, -4])
@pytest.mark.parametrize("power", [1, 2, 0.5, 3.0])
def test_polynomial(begin, power):
    fn = polynomial_schedule(2.0, 0.1, power, 50, begin)
    check(fn, lambda t: ref_polynomial(2.0, 0.1, power, 50, begin, t), atol=2e-7)


@pytest.mark.parametrize("begin", [0, 7])
def test_linear(begin):
    fn = linear_schedule(1e-3, 1e-5, 100, begin)
    check(fn, lambda t: ref_polynomial(1e-3, 1e-5, 1, 100, begin, t), atol=1e-10)
    up = linear_schedule(0.0, 1.0, 10)
    assert [up(t) for t in (0, 5, 10, 11)] == [0.0, 0.5, 1.0, 1.0]


def test_linear_end_of_transition_is_exact_in_float32():
    # 1 - t/T near t = T would lose ~T ulps if computed from t in float32.
    fn = linear_schedule(1.0, 0.0, 10**6)
    for t in (10**6 - 1, 10**6 - 3):
        assert as_tensor_value(fn, t).item() == pytest.approx(fn(t), rel=1e-6)


@pytest.mark.parametrize("steps", [0, -5])
def test_polynomial_nonpositive_steps_is_constant_init(steps):
    for fn in (polynomial_schedule(3.0, 1.0, 2, steps), linear_schedule(3.0, 1.0, steps)):
        check(fn, lambda t: 3.0)


@pytest.mark.parametrize(
    "fn,ref",
    [  # warmups from ~0 and rising cosines: (I - E)·f + E would cancel in float32
        (linear_schedule(0.0, 1.0, 1000), partial(ref_polynomial, 0.0, 1.0, 1, 1000, 0)),
        (linear_schedule(1e-7, 1e-3, 10**5), partial(ref_polynomial, 1e-7, 1e-3, 1, 10**5, 0)),
        (polynomial_schedule(1e-6, 1.0, 2.0, 1000), partial(ref_polynomial, 1e-6, 1, 2, 1000, 0)),
        (polynomial_schedule(1.0, 1e-6, 0.5, 1000), partial(ref_polynomial, 1, 1e-6, 0.5, 1000, 0)),
        (cosine_decay_schedule(1e-3, 1000, 1000.0), partial(ref_cosine, 1e-3, 1000, 1000.0, 1.0)),
        (cosine_decay_schedule(1.0, 1000, 0.1, 0.5), partial(ref_cosine, 1.0, 1000, 0.1, 0.5)),
    ],
)
def test_tensor_path_is_accurate_in_float32(fn, ref):
    for t in (0, 1, 2, 3, 10, 500, 990, 997, 998, 999, 1000, 10**5 - 1):
        assert as_tensor_value(fn, t).item() == pytest.approx(ref(t), rel=2e-6, abs=1e-30), t


@pytest.mark.parametrize("staircase", [False, True])
@pytest.mark.parametrize("begin", [0, 10, -2])
@pytest.mark.parametrize(
    "rate,end", [(0.5, None), (0.9, 0.5), (1.5, None), (1.5, 4.0), (0.1, 1e-3)]
)
def test_exponential(staircase, begin, rate, end):
    fn = exponential_decay(2.0, 7, rate, begin, staircase, end)
    ref = lambda t: ref_exponential(2.0, 7, rate, begin, staircase, end, t)
    counts = [t for t in COUNTS if t <= 200]
    check(fn, ref, counts=counts, rtol=2e-5, atol=1e-30)


def test_exponential_degenerate_and_overflow():
    check(exponential_decay(0.7, 0, 0.5), lambda t: 0.7)
    check(exponential_decay(0.7, 10, 0.0), lambda t: 0.7)
    grow = exponential_decay(1.0, 1, 2.0)
    assert grow(5000) == math.inf and as_tensor_value(grow, 5000).item() == math.inf
    capped = exponential_decay(1.0, 1, 2.0, end_value=8.0)
    assert capped(5000) == 8.0 and as_tensor_value(capped, 5000).item() == 8.0


def test_exponential_staircase_large_count():
    fn = exponential_decay(1.0, 1000, 0.5, staircase=True)
    assert fn(1999) == 0.5 and as_tensor_value(fn, 1999).item() == 0.5
    assert fn(2000) == 0.25 and as_tensor_value(fn, 2000).item() == 0.25


@pytest.mark.parametrize("alpha", [0.0, 0.1])
@pytest.mark.parametrize("exponent", [1.0, 2.0, 0.5])
@pytest.mark.parametrize("steps", [1, 50, 1000])
def test_cosine(alpha, exponent, steps):
    fn = cosine_decay_schedule(3.0, steps, alpha, exponent)
    ref = lambda t: ref_cosine(3.0, steps, alpha, exponent, t)
    check(fn, ref, counts=[t for t in COUNTS if t >= 0] + [steps - 1, steps, steps + 1],
          atol=1e-12, host_rtol=1e-9)
    for t in (-1, -steps, -3 * steps):  # optax's formula continues to negative counts
        assert fn(t) == pytest.approx(ref(t), rel=1e-9, abs=1e-7)
    assert fn(steps) == pytest.approx(3.0 * alpha, abs=1e-15)
    assert fn(0) == pytest.approx(3.0)


@pytest.mark.parametrize("warmup", [0, 1, 10])
@pytest.mark.parametrize("end,exponent", [(0.0, 1.0), (1e-4, 1.0), (2e-4, 2.0)])
def test_warmup_cosine(warmup, end, exponent):
    fn = warmup_cosine_decay_schedule(1e-5, 1e-3, warmup, 60, end, exponent)
    ref = lambda t: ref_warmup_cosine(1e-5, 1e-3, warmup, 60, end, exponent, t)
    counts = [t for t in COUNTS if t >= 0] + [warmup - 1, warmup, warmup + 1, 59, 60, 61]
    check(fn, ref, counts=[t for t in counts if t >= 0], atol=1e-12, host_rtol=1e-9)
    assert fn(warmup) == pytest.approx(1e-3) and fn(10**5) == pytest.approx(end)


def test_warmup_cosine_zero_peak():
    fn = warmup_cosine_decay_schedule(0.5, 0.0, 4, 8, end_value=1.0)
    check(fn, lambda t: 0.5 - 0.5 * min(t, 4) / 4 if t < 4 else 0.0, counts=range(0, 12))


def test_warmup_constant():
    fn = warmup_constant_schedule(0.1, 1.0, 8)
    check(fn, lambda t: 0.1 + 0.9 * min(max(t, 0), 8) / 8)
    check(warmup_constant_schedule(0.1, 1.0, 0), lambda t: 0.1)


@pytest.mark.parametrize(
    "bs", [None, {}, {10: 0.5}, {30: 0.1, 10: 0.5, 20: 2.0}, {0: 0.25, 5: 0.0}, {-2: 3.0}]
)
def test_piecewise_constant(bs):
    fn = piecewise_constant_schedule(0.8, bs)
    check(fn, lambda t: ref_piecewise(0.8, bs or {}, t))


# ---------------------------------------------------------------- join_schedules


def _recorder(offset, seen):
    def s(count):
        seen.append(count)
        return offset + count

    return s


@pytest.mark.parametrize("boundaries", [[3, 7], [5, 5], [7, 3], [0, 10]])
def test_join_semantics_match_optax(boundaries):
    seen = []
    fn = join_schedules([_recorder(100.0, seen), _recorder(200.0, []), _recorder(300.0, [])],
                        boundaries)

    def optax_ref(t):  # optax: out = where(t < b_k, out, s_k(t - b_k)) in order
        out = 100.0 + t
        for b, off in zip(boundaries, (200.0, 300.0)):
            out = out if t < b else off + (t - b)
        return out

    check(fn, optax_ref, counts=range(-2, 15), atol=0.0)
    seen.clear()
    fn(2)
    assert seen == [2] and type(seen[0]) is int


def test_join_tensor_path_passes_shifted_tensor_counts():
    got = []

    def s1(count):
        got.append(count)
        return count.float() * 2.0 if isinstance(count, torch.Tensor) else 2.0 * count

    fn = join_schedules([constant_schedule(1.0), s1], [4])
    out = fn(torch.tensor(9))
    assert out.item() == 10.0 and isinstance(got[0], torch.Tensor) and got[0].item() == 5
    assert fn(9) == 10.0 and got[-1] == 5 and fn(4) == 0.0 and fn(3) == 1.0


def test_join_with_builtin_schedules():
    fn = join_schedules([linear_schedule(0.0, 1.0, 5), cosine_decay_schedule(1.0, 10)], [5])
    check(fn, lambda t: min(max(t, 0), 5) / 5 if t < 5 else ref_cosine(1.0, 10, 0.0, 1.0, t - 5),
          counts=range(-2, 30), atol=1e-12, host_rtol=1e-9)


def test_join_single_schedule():
    check(join_schedules([linear_schedule(1.0, 0.0, 4)], []), lambda t: 1 - min(max(t, 0), 4) / 4)


# ---------------------------------------------------------------- AdEMAMix schedules


@pytest.mark.parametrize("alpha,warmup", [(5.0, 10), (8.0, 1000), (0.0, 5), (2.5, 1)])
def test_ademamix_alpha(alpha, warmup):
    fn = ademamix_alpha_warmup(alpha, warmup)
    counts = list(range(0, 30)) + [warmup - 1, warmup, warmup + 1, 5 * warmup, 10**7]
    check(fn, lambda t: bnb_alpha(alpha, warmup, t), counts=[t for t in counts if t >= 0],
          atol=1e-30, host_rtol=0.0, host_atol=0.0)
    assert fn(1) == alpha / warmup if warmup > 1 else fn(1) == alpha


@pytest.mark.parametrize(
    "b1,b3,warmup", [(0.9, 0.999, 100), (0.9, 0.9999, 5000), (0.5, 0.99, 3), (0.95, 0.95, 10)]
)
def test_ademamix_b3(b1, b3, warmup):
    fn = ademamix_b3_warmup(b1, b3, warmup)
    counts = list(range(0, 25)) + [warmup // 2, warmup - 1, warmup, warmup + 1, 3 * warmup]
    ref = lambda t: b3 if t >= warmup else bnb_beta3(b1, b3, warmup, t)
    check(fn, ref, counts=counts, host_rtol=1e-15)
    assert fn(0) == pytest.approx(b1, rel=1e-15)
    assert fn(warmup) == b3 and fn(10 * warmup) == b3
    assert as_tensor_value(fn, warmup).item() == b3  # float64: exact
    # strictly increasing during warmup when b1 < b3 (the half-life grows linearly)
    if b1 < b3:
        vals = [fn(t) for t in range(warmup + 1)]
        assert all(a < b for a, b in zip(vals, vals[1:]))
        half = [math.log(0.5) / math.log(v) for v in vals]
        steps = [b - a for a, b in zip(half, half[1:])]
        assert max(steps) == pytest.approx(min(steps), rel=1e-6)


def test_ademamix_no_warmup_is_constant():
    check(ademamix_alpha_warmup(5.0, 0), lambda t: 5.0, counts=range(0, 5))
    check(ademamix_b3_warmup(0.9, 0.999, 0), lambda t: 0.999, counts=range(0, 5))


def test_ademamix_b3_matches_bnb_in_float32():
    # bnb hands float64 host values to its kernels; the tensor path must round to the same.
    fn = ademamix_b3_warmup(0.9, 0.9999, 256000)
    for t in (1, 2, 10, 1000, 100000, 255999):
        want = torch.tensor(bnb_beta3(0.9, 0.9999, 256000, t), dtype=torch.float32)
        got = as_tensor_value(fn, t)
        assert abs(got.item() - want.item()) <= 2 * torch.finfo(torch.float32).eps


@pytest.mark.parametrize("b1,b3", [(0.999, 0.643), (0.8, 0.9999), (0.9, 0.99999)])
def test_ademamix_b3_tensor_count_keeps_one_minus_b3(b1, b3):
    """The update reads 1 − β3: on a tensor count it agrees with the host value to ~1e-12
    relative (in float32 it was up to ~1e-3 off when β3 is within 1e-4 of 1)."""
    fn = ademamix_b3_warmup(b1, b3, 7)
    for t in range(10):
        host = 1 - fn(t)
        tensor = float(1 - fn(torch.tensor(t)))
        assert abs(tensor - host) <= 1e-12 * host, (t, host, tensor)


# ---------------------------------------------------------------- tensor path properties


def all_schedules():
    return {
        "constant": constant_schedule(0.5),
        "linear": linear_schedule(1.0, 0.1, 20, 3),
        "poly": polynomial_schedule(1.0, 0.1, 2.0, 20),
        "exp": exponential_decay(1.0, 5, 0.5, 2, False, 0.01),
        "exp_stair": exponential_decay(1.0, 5, 0.5, staircase=True),
        "cosine": cosine_decay_schedule(1.0, 30, 0.1, 2.0),
        "warmup_cosine": warmup_cosine_decay_schedule(0.0, 1.0, 5, 30, 0.1),
        "warmup_const": warmup_constant_schedule(0.0, 1.0, 5),
        "piecewise": piecewise_constant_schedule(1.0, {3: 0.5, 9: 0.1}),
        "join": join_schedules([constant_schedule(1.0), linear_schedule(1.0, 0.0, 10)], [4]),
        "join_user": join_schedules([lambda c: 0.25, cosine_decay_schedule(1.0, 8)], [3]),
        "alpha": ademamix_alpha_warmup(5.0, 12),
        "b3": ademamix_b3_warmup(0.9, 0.999, 12),
        "interp_linear": sched_mod.piecewise_interpolate_schedule("linear", 1.0, {3: 0.5, 9: 0.1}),
        "interp_cosine": sched_mod.piecewise_interpolate_schedule("cosine", 1.0, {3: 2.0, 9: 0.1}),
        "linear_onecycle": sched_mod.linear_onecycle_schedule(30, 1.0),
        "cosine_onecycle": sched_mod.cosine_onecycle_schedule(30, 1.0),
        "warmup_exp": sched_mod.warmup_exponential_decay_schedule(0.0, 1.0, 5, 4, 0.5, 2),
        "sgdr": sched_mod.sgdr_schedule([dict(init_value=0.0, peak_value=1.0, warmup_steps=2,
                                              decay_steps=10)] * 3),
    }


def _forbid(*_args, **_kwargs):
    raise AssertionError("host sync or host->device copy in a schedule's tensor path")


def _needs_device(factory):
    def checked(*args, **kwargs):
        if kwargs.get("device") is None:
            raise AssertionError(f"torch.{factory.__name__} without device=")
        return factory(*args, **kwargs)

    return checked


def _install_traps(monkeypatch):
    for attr in ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, attr, _forbid)  # reading or branching on a value
    for attr in ("tensor", "as_tensor", "from_numpy"):  # data from the host (a H2D copy)
        monkeypatch.setattr(torch, attr, _forbid)
    for attr in ("full", "zeros", "ones", "empty", "arange", "scalar_tensor"):
        monkeypatch.setattr(torch, attr, _needs_device(getattr(torch, attr)))


@pytest.mark.parametrize("name", sorted(all_schedules()))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_tensor_path_no_host_sync_and_stays_on_device(name, dtype, monkeypatch):
    fn = all_schedules()[name]
    counts = [torch.tensor(t, dtype=dtype) for t in (0, 1, 4, 9, 13, 40)]
    _install_traps(monkeypatch)
    outs = [fn(c) for c in counts]
    monkeypatch.undo()
    for c, out in zip(counts, outs):
        want = torch.float64 if name == "b3" else torch.float32
        assert out.dtype == want and out.shape == () and out.device == c.device
        # the same callable evaluated at other counts: nothing was baked in
        assert out.item() == pytest.approx(fn(int(c)), rel=1e-6, abs=1e-7)


@pytest.mark.parametrize(
    "bad",
    [
        lambda c: torch.full((), 0.5 * c.item(), device=c.device),
        lambda c: torch.full((), 1.0, device=c.device) if c > 3 else c.float(),
        lambda c: torch.full((), 1.0) + c.float(),
        lambda c: torch.tensor(1.0, device=c.device) + c.float(),
        lambda c: c.float() * float(c),
    ],
)
def test_traps_catch_offenders(bad, monkeypatch):
    count = torch.tensor(5)
    assert isinstance(bad(count), torch.Tensor)
    _install_traps(monkeypatch)
    with pytest.raises(AssertionError):
        bad(count)


def test_large_counts_use_integer_arithmetic():
    big = 2**40  # float32(big + 1) == big: the offset must be taken in integers
    fn = linear_schedule(1.0, 0.0, 4, transition_begin=big)
    assert fn(big + 1) == 0.75 and as_tensor_value(fn, big + 1).item() == 0.75
    cos = cosine_decay_schedule(1.0, big)
    assert as_tensor_value(cos, big - 1).item() == pytest.approx(cos(big - 1), rel=1e-6)
    pw = piecewise_constant_schedule(1.0, {big + 1: 0.5})
    assert as_tensor_value(pw, big).item() == 1.0 and as_tensor_value(pw, big + 1).item() == 0.5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(all_schedules()))
def test_cuda_graph_capture(name):
    fn = all_schedules()[name]
    count = torch.zeros((), dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(count)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(count)
    for t in (0, 1, 5, 12, 31):
        count.fill_(t)
        graph.replay()
        assert out.item() == pytest.approx(fn(t), rel=1e-6, abs=1e-7)


@settings(max_examples=30, deadline=None)
@given(
    init=st.floats(1e-6, 10.0),
    end=st.floats(0.0, 10.0),
    steps=st.integers(1, 10**5),
    begin=st.integers(0, 100),
    t=st.integers(0, 2 * 10**5),
)
def test_int_and_tensor_paths_agree(init, end, steps, begin, t):
    for fn in (
        linear_schedule(init, end, steps, begin),
        cosine_decay_schedule(init, steps, end / 10.0),
        warmup_cosine_decay_schedule(0.0, init, begin, begin + steps, end),
    ):
        want = fn(t)
        assert as_tensor_value(fn, t).item() == pytest.approx(want, rel=2e-6, abs=1e-6 * init)


# ---------------------------------------------------------------- errors and docs


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: cosine_decay_schedule(1.0, 0), "decay_steps"),
        (lambda: cosine_decay_schedule(1.0, -3), "decay_steps"),
        (lambda: warmup_cosine_decay_schedule(0.0, 1.0, 10, 10), "decay_steps"),
        (lambda: warmup_cosine_decay_schedule(0.0, 1.0, 10, 5), "warmup_steps"),
        (lambda: piecewise_constant_schedule(1.0, {5: -0.1}), "non-negative|>= 0"),
        (lambda: join_schedules([constant_schedule(1.0)] * 2, []), "boundar"),
        (lambda: join_schedules([constant_schedule(1.0)], [3]), "boundar"),
        (lambda: join_schedules([], []), "schedule"),
        (lambda: exponential_decay(1.0, 10, -0.5), "decay_rate"),
        (lambda: ademamix_alpha_warmup(-1.0, 10), "alpha"),
        (lambda: ademamix_b3_warmup(0.0, 0.999, 10), "b1"),
        (lambda: ademamix_b3_warmup(0.9, 1.0, 10), "b3"),
        (lambda: ademamix_b3_warmup(1.2, 0.999, 10), "b1"),
    ],
)
def test_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_docstring_examples_hold():
    pattern = re.compile(r"``(\w+\([^`]*?\)\(\d+\)) == ([-\d.e]+)``")
    found = 0
    for name in sched_mod.__all__:
        obj = getattr(sched_mod, name)
        # (the namespace also holds optax's wrappers defined elsewhere: inject_hyperparams)
        if not inspect.isfunction(obj) or not obj.__module__.startswith("ftopt.schedules"):
            continue
        assert obj.__doc__ and "Args" in obj.__doc__ and "Returns" in obj.__doc__, name
        for expr, value in pattern.findall(obj.__doc__):
            found += 1
            assert eval(expr, vars(sched_mod)) == pytest.approx(float(value)), expr
    assert found >= 10


def test_type_aliases_exported():
    assert sched_mod.Schedule is not None and sched_mod.ScalarOrSchedule is not None
    assert callable(linear_schedule(1.0, 0.0, 3))
