"""Schedules: plain callables ``schedule(count) -> value``, with optax's names and semantics.

An ``int`` count gives a ``float`` (float64 host math, for kernel scalars); a 0-d integer
tensor count gives a 0-d float32 tensor on its device, from torch ops only (no ``.item()``,
no host sync: CUDA-graph capturable and traceable). The two agree up to float32 rounding.
Integer work on the count comes before any float conversion, so large counts stay exact.
"""

import math
from collections.abc import Callable, Mapping, Sequence

import torch

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
    value = float(value)
    return lambda count: _full(value, count) if _is_tensor(count) else value


def polynomial_schedule(init_value: float, end_value: float, power: float, transition_steps: int,
                        transition_begin: int = 0) -> Schedule:  # fmt: skip
    """Polynomial: ``v(t) = (I - E)·(1 - clip(t - B, 0, T)/T)^P + E``.

    Args: init_value ``I``; end_value ``E``; power ``P``; transition_steps ``T`` (``<= 0``:
        constant ``I``); transition_begin ``B`` (negative: 0).
    Returns: the schedule; ``polynomial_schedule(1.0, 0.0, 2, 10)(5) == 0.25``.
    """
    if transition_steps <= 0 or power == 0:  # as optax: constant init_value
        return constant_schedule(init_value)
    transition_begin = max(transition_begin, 0)  # optax: a negative begin falls back to 0
    init, end, power = float(init_value), float(end_value), float(power)

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

    Args: init_value ``I``; end_value ``E``; transition_steps ``T`` (``<= 0``: constant
        ``I``); transition_begin ``B`` (negative: 0).
    Returns: the schedule; ``linear_schedule(1.0, 0.0, 10)(5) == 0.5``.
    """
    return polynomial_schedule(init_value, end_value, 1, transition_steps, transition_begin)


def exponential_decay(init_value: float, transition_steps: int, decay_rate: float,
                      transition_begin: int = 0, staircase: bool = False,
                      end_value: float | None = None) -> Schedule:  # fmt: skip
    """Exponential: ``v(t) = I·r^((t - B)/T)`` for ``t > B``, else ``I``.

    Args: init_value ``I``; transition_steps ``T`` (``<= 0``: constant ``I``); decay_rate
        ``r`` (``0``: constant ``I``; negative: ``ValueError``); transition_begin ``B``
        (negative: 0); staircase: use ``(t - B) // T``; end_value: a lower bound on the
        value if ``r < 1``, else an upper bound.
    Returns: the schedule; ``exponential_decay(1.0, 10, 0.5)(20) == 0.25``.
    """
    if transition_steps <= 0 or decay_rate == 0:  # as optax: constant init_value
        return constant_schedule(init_value)
    if decay_rate < 0:
        raise ValueError(f"exponential_decay requires decay_rate >= 0, got {decay_rate=}.")
    transition_begin = max(transition_begin, 0)  # optax: a negative begin falls back to 0
    init, rate, steps = float(init_value), float(decay_rate), transition_steps
    end = None if end_value is None else float(end_value)

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

    Args: init_value ``I``; decay_steps ``T`` (must be positive, else ``ValueError``);
        alpha ``a`` (the final multiplier); exponent ``e``.
    Returns: the schedule; ``cosine_decay_schedule(2.0, 10)(10) == 0.0``.
    """
    if not decay_steps > 0:
        raise ValueError(f"cosine_decay_schedule requires decay_steps > 0, got {decay_steps=}.")
    init, alpha, exponent = float(init_value), float(alpha), float(exponent)
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

    Args: init_value, peak_value, end_value: the three levels; warmup_steps ``W``;
        decay_steps ``D``, the total length, warmup included (``D <= W``: ``ValueError``);
        exponent: of the cosine factor.
    Returns: the schedule; ``warmup_cosine_decay_schedule(0.0, 1.0, 10, 20)(5) == 0.5``.
    """
    if not decay_steps > warmup_steps:
        raise ValueError(f"warmup_cosine_decay_schedule needs decay_steps (total length, warmup "
                         f"included) > warmup_steps, got {decay_steps=}, {warmup_steps=}.")
    peak = float(peak_value)
    alpha = 0.0 if peak == 0.0 else float(end_value) / peak
    warmup = linear_schedule(init_value, peak, warmup_steps)
    decay = cosine_decay_schedule(peak, decay_steps - warmup_steps, alpha, exponent)
    return join_schedules([warmup, decay], [warmup_steps])


def warmup_constant_schedule(init_value: float, peak_value: float, warmup_steps: int) -> Schedule:
    """Warmup then constant: ``v(t) = init + min(t, W)/W·(peak - init)``.

    Args: init_value; peak_value; warmup_steps ``W`` (``<= 0``: constant ``init_value``).
    Returns: the schedule; ``warmup_constant_schedule(0.0, 1.0, 4)(9) == 1.0``.
    """
    return linear_schedule(init_value, peak_value, warmup_steps)


def piecewise_constant_schedule(
    init_value: float, boundaries_and_scales: Mapping[int, float] | None = None
) -> Schedule:
    """Piecewise constant: ``v(t) = init·∏{s_i : t >= b_i}`` over ``{b_i: s_i}``.

    Args: init_value; boundaries_and_scales: ``{step: scale}``, scales non-negative
        (else ``ValueError``).
    Returns: the schedule; ``piecewise_constant_schedule(1.0, {2: 0.5})(2) == 0.5``.
    """
    items = sorted((boundaries_and_scales or {}).items())
    if any(scale < 0 for _, scale in items):
        raise ValueError(f"piecewise_constant_schedule needs scales >= 0, got {dict(items)}.")
    init = float(init_value)
    levels, level = [], init
    for boundary, scale in items:  # cumulative products in float64, rounded once
        level *= float(scale)
        levels.append((boundary, level))

    def schedule(count: Count) -> Value:
        out = _full(init, count) if _is_tensor(count) else init
        for boundary, value in levels:
            if _is_tensor(count):
                out = torch.where(count >= boundary, value, out)
            elif count >= boundary:
                out = value
        return out

    return schedule


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Join: ``v(t) = s_k(t - b_k)`` for the last ``k`` with ``t >= b_k`` (``s_0(t)`` before).

    Args: schedules ``[s_0, ..., s_n]``; boundaries ``[b_1, ..., b_n]``, one fewer than the
        schedules (else ``ValueError``).
    Returns: the schedule; ``join_schedules([constant_schedule(1.0), linear_schedule(1.0,
        0.0, 10)], [5])(10) == 0.5`` (the linear part is called with ``t - 5``).
    """
    schedules, boundaries = list(schedules), list(boundaries)
    if not schedules or len(boundaries) != len(schedules) - 1:
        raise ValueError("join_schedules needs len(boundaries) == len(schedules) - 1 >= 0.")

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

    Args: alpha ``α`` (non-negative, else ``ValueError``); warmup_steps ``T`` (``<= 0``:
        no warmup, constant ``α``).
    Returns: the schedule; ``ademamix_alpha_warmup(5.0, 10)(2) == 1.0``.
    """
    alpha = float(alpha)
    if alpha < 0:
        raise ValueError(f"ademamix_alpha_warmup requires alpha >= 0, got {alpha=}.")
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

    Args: b1, b3: the fast decay and the final slow decay, in ``(0, 1)`` (else
        ``ValueError``); warmup_steps ``T`` (``<= 0``: no warmup, constant ``b3``).
    Returns: the schedule; ``ademamix_b3_warmup(0.9, 0.999, 100)(100) == 0.999``.
    """
    b1, b3 = float(b1), float(b3)
    if not (0.0 < b1 < 1.0 and 0.0 < b3 < 1.0):
        raise ValueError(f"ademamix_b3_warmup requires b1, b3 in (0, 1), got {b1=}, {b3=}.")
    if warmup_steps <= 0:
        return constant_schedule(b3)
    ln1, ln3 = math.log(b1), math.log(b3)

    def schedule(count: Count) -> Value:
        if _is_tensor(count):
            s = count.clamp(0, warmup_steps).float() / warmup_steps
            beta = torch.exp(ln1 * ln3 / (ln3 + s * (ln1 - ln3))).clamp(max=b3)
            return torch.where(count >= warmup_steps, b3, beta)
        if count >= warmup_steps:
            return b3
        s = max(count, 0) / warmup_steps
        return min(math.exp(ln1 * ln3 / ((1 - s) * ln3 + s * ln1)), b3)

    return schedule
