"""Decays, warmups, piecewise constants, joins and the AdEMAMix warmups: see
:mod:`ftopt.schedules` for what every schedule shares."""

import functools
import math
from collections.abc import Callable, Mapping, Sequence

import torch

from ftopt.domains import NONNEG, OPEN_UNIT, check_finite, check_int

# Step counts and boundaries: ints, or floats of integer value (``1e4``), as optax takes.
_check_steps = functools.partial(check_int, integral_floats=True)

__all__ = [
    "Schedule", "ScalarOrSchedule", "constant_schedule", "linear_schedule", "polynomial_schedule",
    "exponential_decay", "cosine_decay_schedule", "warmup_cosine_decay_schedule",
    "warmup_constant_schedule", "piecewise_constant_schedule", "join_schedules",
    "ademamix_alpha_warmup", "ademamix_b3_warmup",
]  # fmt: skip

Schedule = Callable[[int | torch.Tensor], float | torch.Tensor]
ScalarOrSchedule = float | torch.Tensor | Schedule
Count = int | torch.Tensor
Value = float | torch.Tensor


def _is_tensor(x: object) -> bool:
    return isinstance(x, torch.Tensor)


def _full(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.full((), value, dtype=torch.float32, device=like.device)


def _as_value(x: Value, count: Count) -> Value:
    if not _is_tensor(count):
        return float(x)
    return x.float().to(count.device) if _is_tensor(x) else _full(float(x), count)


def _clip(x: Count, lo: float | None, hi: float | None) -> Count:
    if _is_tensor(x):
        return x.clamp(lo, hi)
    x = x if lo is None else max(x, lo)
    return x if hi is None else min(x, hi)


def _fpow(base: float, exp: float) -> float:
    try:  # host ``base ** exp`` that overflows to ``inf`` (as torch does), never raises
        return float(base**exp)
    except (OverflowError, ZeroDivisionError):
        return math.inf


def _blend(init: float, end: float, f: torch.Tensor, g: torch.Tensor, p: float) -> torch.Tensor:
    """``init·f^p + end·(1 - f^p)`` for ``f = 1 - g``, given both: no cancellation in float32."""
    a = f.pow(p)  # 1 - a is exact enough when a < 1/2; otherwise g is small and log1p is exact
    return init * a + end * torch.where(a < 0.5, 1.0 - a, -torch.expm1(p * torch.log1p(-g)))


def constant_schedule(value: float) -> Schedule:
    """Constant: ``v(t) = value``.

    Args: value: the value at every count.
    Returns: the schedule; ``constant_schedule(0.1)(7) == 0.1``.
    """
    value = check_finite("constant_schedule", "value", value)
    return lambda count: _full(value, count) if _is_tensor(count) else value


def polynomial_schedule(init_value: float, end_value: float, power: float, transition_steps: int,
                        transition_begin: int = 0) -> Schedule:  # fmt: skip
    """Polynomial: ``v(t) = (I - E)·(1 - clip(t - B, 0, T)/T)^P + E``.

    Args: init_value ``I``, end_value ``E``: finite; power ``P`` >= 0 (a negative power is
        infinite at the end of the transition); transition_steps ``T``, an int (``<= 0``:
        constant ``I``); transition_begin ``B``, an int (negative: 0).
    Returns: the schedule; ``polynomial_schedule(1.0, 0.0, 2, 10)(5) == 0.25``.
    """
    return _polynomial("polynomial_schedule", init_value, end_value, power, transition_steps,
                       transition_begin)


def _polynomial(name: str, init_value: float, end_value: float, power: float,
                transition_steps: int, transition_begin: int) -> Schedule:
    init = check_finite(name, "init_value", init_value)
    end = check_finite(name, "end_value", end_value)
    power = check_finite(name, "power", power, NONNEG)
    transition_steps = _check_steps(name, "transition_steps", transition_steps)
    transition_begin = _check_steps(name, "transition_begin", transition_begin)
    if transition_steps <= 0 or power == 0:  # as optax: constant init_value
        return constant_schedule(init)
    transition_begin = max(transition_begin, 0)  # optax: a negative begin falls back to 0

    def schedule(count: Count) -> Value:
        done = _clip(count - transition_begin, 0, transition_steps)
        left = transition_steps - done
        if _is_tensor(count):
            frac, done = left.float() / transition_steps, done.float() / transition_steps
            return _blend(init, end, frac, done, power)
        return (init - end) * _fpow(left / transition_steps, power) + end

    return schedule


def linear_schedule(
    init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0
) -> Schedule:
    """Linear: ``v(t) = I + clip(t - B, 0, T)/T·(E - I)`` (polynomial with ``P = 1``).

    Args: init_value ``I``, end_value ``E``: finite; transition_steps ``T``, an int (``<= 0``:
        constant ``I``); transition_begin ``B``, an int (negative: 0).
    Returns: the schedule; ``linear_schedule(1.0, 0.0, 10)(5) == 0.5``.
    """
    return _polynomial("linear_schedule", init_value, end_value, 1, transition_steps,
                       transition_begin)


def exponential_decay(init_value: float, transition_steps: int, decay_rate: float,
                      transition_begin: int = 0, staircase: bool = False,
                      end_value: float | None = None) -> Schedule:  # fmt: skip
    """Exponential: ``v(t) = I·r^((t - B)/T)`` for ``t > B``, else ``I``.

    Args: init_value ``I``, finite; transition_steps ``T``, an int (``<= 0``: constant
        ``I``); decay_rate ``r``, finite and >= 0 (``0``: constant ``I``; a negative rate to
        a fractional power is NaN); transition_begin ``B``, an int (negative: 0); staircase:
        use ``(t - B) // T``; end_value: ``None`` or finite, a lower bound on the value if
        ``r < 1``, else an upper bound.
    Returns: the schedule; ``exponential_decay(1.0, 10, 0.5)(20) == 0.25``.
    """
    name = "exponential_decay"
    init = check_finite(name, "init_value", init_value)
    steps = _check_steps(name, "transition_steps", transition_steps)
    rate = check_finite(name, "decay_rate", decay_rate, NONNEG)
    transition_begin = _check_steps(name, "transition_begin", transition_begin)
    end = None if end_value is None else check_finite(name, "end_value", end_value)
    if steps <= 0 or rate == 0:  # as optax: constant init_value
        return constant_schedule(init)
    transition_begin = max(transition_begin, 0)  # optax: a negative begin falls back to 0

    def schedule(count: Count) -> Value:
        d = count - transition_begin
        if _is_tensor(count):
            p = torch.div(d, steps, rounding_mode="floor") if staircase else d.float() / steps
            value = torch.where(d <= 0, init, init * torch.pow(rate, p.float()))
        else:
            value = init if d <= 0 else init * _fpow(rate, d // steps if staircase else d / steps)
        if end is None:
            return value
        return _clip(value, end, None) if rate < 1.0 else _clip(value, None, end)

    return schedule


def cosine_decay_schedule(
    init_value: float, decay_steps: int, alpha: float = 0.0, exponent: float = 1.0
) -> Schedule:
    """Cosine: ``v(t) = I·((1 - a)·(½(1 + cos(π·min(t, T)/T)))^e + a)``.

    Args: init_value ``I``, finite; decay_steps ``T``, a positive int (else ``ValueError``);
        alpha ``a`` (the final multiplier), finite; exponent ``e`` >= 0 (a negative one is
        infinite at ``t = T``).
    Returns: the schedule; ``cosine_decay_schedule(2.0, 10)(10) == 0.0``.
    """
    name = "cosine_decay_schedule"
    init = check_finite(name, "init_value", init_value)
    decay_steps = _check_steps(name, "decay_steps", decay_steps, minimum=1)
    alpha = check_finite(name, "alpha", alpha)
    exponent = check_finite(name, "exponent", exponent, NONNEG)
    if exponent == 0:
        return constant_schedule(init)
    half_angle = math.pi / (2 * decay_steps)  # ½(1 + cos x) = sin²((π - x)/2): exact near T

    def schedule(count: Count) -> Value:
        done = _clip(count, None, decay_steps)
        if _is_tensor(count):  # I·c^e + I·a·(1 - c^e); c = sin²(π(T - t)/2T), 1 - c = sin²(πt/2T)
            c, g = (torch.stack([decay_steps - done, done]).float() * half_angle).sin().square()
            return _blend(init, init * alpha, c, g, exponent)
        c = math.sin((decay_steps - done) * half_angle) ** 2
        return init * ((1.0 - alpha) * _fpow(c, exponent) + alpha)

    return schedule


def warmup_cosine_decay_schedule(init_value: float, peak_value: float, warmup_steps: int,
                                 decay_steps: int, end_value: float = 0.0,
                                 exponent: float = 1.0) -> Schedule:  # fmt: skip
    """Warmup then cosine: ``v(t) = linear(init, peak, W)(t)`` for ``t < W``, else
    ``cosine_decay(peak, D - W, end/peak, exponent)(t - W)``.

    Args: init_value, peak_value, end_value: the three levels, finite; warmup_steps ``W``,
        an int >= 0; decay_steps ``D``, an int, the total length, warmup included (``D <= W``:
        ``ValueError``); exponent: of the cosine factor, >= 0.
    Returns: the schedule; ``warmup_cosine_decay_schedule(0.0, 1.0, 10, 20)(5) == 0.5``.
    """
    name = "warmup_cosine_decay_schedule"
    init = check_finite(name, "init_value", init_value)
    peak = check_finite(name, "peak_value", peak_value)
    end = check_finite(name, "end_value", end_value)
    warmup_steps = _check_steps(name, "warmup_steps", warmup_steps, minimum=0)
    decay_steps = _check_steps(name, "decay_steps", decay_steps)
    exponent = check_finite(name, "exponent", exponent, NONNEG)
    if not decay_steps > warmup_steps:
        raise ValueError(f"{name}: decay_steps (the total length, warmup included) must be > "
                         f"warmup_steps, got decay_steps={decay_steps}, "
                         f"warmup_steps={warmup_steps}")
    alpha = 0.0 if peak == 0.0 else end / peak
    if not math.isfinite(alpha):
        raise ValueError(f"{name}: end_value / peak_value must be finite, got {end} / {peak}")
    warmup = linear_schedule(init, peak, warmup_steps)
    decay = cosine_decay_schedule(peak, decay_steps - warmup_steps, alpha, exponent)
    return join_schedules([warmup, decay], [warmup_steps])


def warmup_constant_schedule(init_value: float, peak_value: float, warmup_steps: int) -> Schedule:
    """Warmup then constant: ``v(t) = init + min(t, W)/W·(peak - init)``.

    Args: init_value, peak_value: finite; warmup_steps ``W``, an int (``<= 0``: constant
        ``init_value``, as optax).
    Returns: the schedule; ``warmup_constant_schedule(0.0, 1.0, 4)(9) == 1.0``.
    """
    name = "warmup_constant_schedule"
    return _polynomial(name, init_value, peak_value, 1, warmup_steps, 0)


def piecewise_constant_schedule(
    init_value: float, boundaries_and_scales: Mapping[int, float] | None = None
) -> Schedule:
    """Piecewise constant: ``v(t) = init·∏{s_i : t >= b_i}`` over ``{b_i: s_i}``.

    Args: init_value, finite; boundaries_and_scales: ``{step: scale}``, int steps (any
        order; a negative step applies from the start, as optax) and finite scales >= 0
        (else ``ValueError``).
    Returns: the schedule; ``piecewise_constant_schedule(1.0, {2: 0.5})(2) == 0.5``.
    """
    name = "piecewise_constant_schedule"
    init = check_finite(name, "init_value", init_value)
    levels = _scaled_levels(name, init, boundaries_and_scales)

    def schedule(count: Count) -> Value:
        out = _full(init, count) if _is_tensor(count) else init
        for boundary, value in levels:
            if _is_tensor(count):
                out = torch.where(count >= boundary, value, out)
            elif count >= boundary:
                out = value
        return out

    return schedule


def _scaled_levels(name: str, init: float, boundaries_and_scales: Mapping[int, float] | None
                   ) -> list[tuple[int, float]]:
    """``{step: scale}`` checked (int steps, finite scales >= 0) and sorted by step, each
    with the level from there on: ``init`` times the scales so far (float64, rounded
    once)."""
    if boundaries_and_scales is not None and not isinstance(boundaries_and_scales, Mapping):
        raise TypeError(f"{name}: boundaries_and_scales must be a mapping {{step: scale}}, "
                        f"got {type(boundaries_and_scales).__name__}")
    items = []
    for boundary, scale in (boundaries_and_scales or {}).items():
        boundary = _check_steps(name, "boundary", boundary)
        items.append((boundary, check_finite(name, f"scale at boundary {boundary}", scale,
                                             NONNEG)))
    items.sort()
    levels, level = [], init
    for boundary, scale in items:
        level *= scale
        levels.append((boundary, level))
    return levels


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Join: ``v(t) = s_k(t - b_k)`` for the last ``k`` with ``t >= b_k`` (``s_0(t)`` before).

    Args: schedules ``[s_0, ..., s_n]``, callables; boundaries ``[b_1, ..., b_n]``, ints,
        one fewer than the schedules (else ``ValueError``); as in optax, they are taken in
        the order given (a later boundary below an earlier one takes over from there).
    Returns: the schedule; ``join_schedules([constant_schedule(1.0), linear_schedule(1.0,
        0.0, 10)], [5])(10) == 0.5`` (the linear part is called with ``t - 5``).
    """
    schedules, boundaries = list(schedules), list(boundaries)
    if not schedules or len(boundaries) != len(schedules) - 1:
        raise ValueError(f"join_schedules: needs at least one schedule and len(boundaries) == "
                         f"len(schedules) - 1, got {len(schedules)} schedules and "
                         f"{len(boundaries)} boundaries")
    for i, fn in enumerate(schedules):
        if not callable(fn):
            raise TypeError(f"join_schedules: schedules[{i}] must be callable, got "
                            f"{type(fn).__name__}")
    boundaries = [_check_steps("join_schedules", f"boundaries[{i}]", b)
                  for i, b in enumerate(boundaries)]

    def schedule(count: Count) -> Value:
        out = _as_value(schedules[0](count), count)
        for boundary, fn in zip(boundaries, schedules[1:]):
            if _is_tensor(count):
                out = torch.where(count < boundary, out, _as_value(fn(count - boundary), count))
            elif count >= boundary:
                out = _as_value(fn(count - boundary), count)
        return out

    return schedule


def ademamix_alpha_warmup(alpha: float, warmup_steps: int) -> Schedule:
    """AdEMAMix alpha warmup (bitsandbytes ``t_alpha``): ``α_t = min(t·α/T, α)``, ``t`` >= 1.

    Args: alpha ``α``, finite and >= 0 (else ``ValueError``); warmup_steps ``T``, an int
        (``<= 0``: no warmup, constant ``α``).
    Returns: the schedule; ``ademamix_alpha_warmup(5.0, 10)(2) == 1.0``.
    """
    alpha = check_finite("ademamix_alpha_warmup", "alpha", alpha, NONNEG)
    warmup_steps = _check_steps("ademamix_alpha_warmup", "warmup_steps", warmup_steps)
    if warmup_steps <= 0:
        return constant_schedule(alpha)

    def schedule(count: Count) -> Value:
        if _is_tensor(count):
            return torch.where(count >= warmup_steps, alpha, count.float() * alpha / warmup_steps)
        return min(count * alpha / warmup_steps, alpha)

    return schedule


def ademamix_b3_warmup(b1: float, b3: float, warmup_steps: int) -> Schedule:
    """AdEMAMix beta3 warmup (bitsandbytes ``t_beta3``), ``s = t/T``, ``b3`` for ``t >= T``:
    ``β3_t = min(exp(ln b1·ln b3 / ((1 - s)·ln b3 + s·ln b1)), b3)`` (``t < 0`` counts as 0).

    On a tensor count the value is a float64 tensor (on CPU and CUDA/ROCm devices): what
    the update reads is ``1 − β3``, which float32 would leave up to ~1e-3 off.

    Args: b1, b3: the fast decay and the final slow decay, in ``(0, 1)`` (else
        ``ValueError``: the formula divides by their logs); warmup_steps ``T``, an int
        (``<= 0``: no warmup, constant ``b3``).
    Returns: the schedule; ``ademamix_b3_warmup(0.9, 0.999, 100)(100) == 0.999``.
    """
    b1 = check_finite("ademamix_b3_warmup", "b1", b1, OPEN_UNIT)
    b3 = check_finite("ademamix_b3_warmup", "b3", b3, OPEN_UNIT)
    warmup_steps = _check_steps("ademamix_b3_warmup", "warmup_steps", warmup_steps)
    if warmup_steps <= 0:
        return constant_schedule(b3)
    ln1, ln3 = math.log(b1), math.log(b3)

    def schedule(count: Count) -> Value:
        if _is_tensor(count):
            # In float64 where the device has it: the update reads 1 − β3, and β3 is
            # often within 1e-4 of 1 (float32 would leave 1 − β3 ~1e-3 off).
            dtype = torch.float64 if count.device.type in ("cpu", "cuda") else torch.float32
            s = count.clamp(0, warmup_steps).to(dtype) / warmup_steps
            beta = torch.exp(ln1 * ln3 / (ln3 + s * (ln1 - ln3))).clamp(max=b3)
            return torch.where(count >= warmup_steps, b3, beta)
        if count >= warmup_steps:
            return b3
        s = max(count, 0) / warmup_steps
        return min(math.exp(ln1 * ln3 / ((1 - s) * ln3 + s * ln1)), b3)

    return schedule
