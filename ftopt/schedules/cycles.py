"""Schedules of interpolated pieces and of other schedules: optax's
``piecewise_interpolate_schedule``, the one-cycle schedules, a warmup before an
exponential decay, and SGDR's warm restarts."""

import math
from collections.abc import Iterable, Mapping

import torch

from ftopt.domains import NONNEG, POSITIVE, check_finite
from ftopt.schedules.decays import (
    Count,
    Schedule,
    Value,
    _check_steps,
    _full,
    _is_tensor,
    _scaled_levels,
    exponential_decay,
    join_schedules,
    linear_schedule,
    warmup_cosine_decay_schedule,
)

__all__ = ["piecewise_interpolate_schedule", "linear_onecycle_schedule",
           "cosine_onecycle_schedule", "warmup_exponential_decay_schedule", "sgdr_schedule"]

_KINDS = ("linear", "cosine")


def piecewise_interpolate_schedule(
    interpolate_type: str, init_value: float,
    boundaries_and_scales: Mapping[int, float] | None = None,
) -> Schedule:  # fmt: skip
    """Piecewise interpolated: levels ``L_0 = init``, ``L_i = L_(i-1)·s_i`` at the sorted
    boundaries ``b_1 <= ... <= b_n`` (``b_0 = 0``); from ``b_(i-1)`` to ``b_i`` the value
    moves from ``L_(i-1)`` to ``L_i``, linearly (``L_(i-1)·(1 - f) + L_i·f``, ``f`` the
    fraction of the piece done) or along a half cosine (``f`` replaced by
    ``sin²(π·f/2)``), and is ``L_n`` from ``b_n`` on. As optax: the levels are
    interpolated, not the scales, and a count below 0 gives 0.

    Args: interpolate_type: ``"linear"`` or ``"cosine"``; init_value, finite;
        boundaries_and_scales: ``{step: scale}``, int steps and finite scales >= 0.
    Returns: the schedule;
        ``piecewise_interpolate_schedule("linear", 1.0, {4: 0.1})(2) == 0.55``.
    """
    return _interpolated("piecewise_interpolate_schedule", interpolate_type, init_value,
                         boundaries_and_scales)


def _interpolated(name: str, kind: str, init_value: float,
                  boundaries_and_scales: Mapping[int, float] | None) -> Schedule:
    if kind not in _KINDS:
        raise ValueError(f"{name}: interpolate_type must be 'linear' or 'cosine', got {kind!r}")
    init = check_finite(name, "init_value", init_value)
    scaled = _scaled_levels(name, init, boundaries_and_scales)
    bounds, levels = [0] + [b for b, _ in scaled], [init] + [x for _, x in scaled]
    # (lo, hi, a, b): from a at lo to b at hi; the pieces are disjoint (sorted bounds)
    pieces = [x for x in zip(bounds, bounds[1:], levels, levels[1:]) if x[1] > x[0]]
    last_bound, last = bounds[-1], levels[-1]
    cosine = kind == "cosine"

    def host(count: int) -> float:
        for lo, hi, a, b in pieces:
            if lo <= count < hi:
                f, g = (hi - count) / (hi - lo), (count - lo) / (hi - lo)
                if cosine:
                    f, g = math.sin(math.pi / 2 * f) ** 2, math.sin(math.pi / 2 * g) ** 2
                return a * f + b * g
        return last if count >= last_bound else 0.0

    def schedule(count: Count) -> Value:
        if not _is_tensor(count):
            return host(count)
        out = torch.where(count >= last_bound, last, _full(0.0, count))
        for lo, hi, a, b in pieces:
            # the integer distances to both ends first: exact, and no cancellation near
            # either end (a·f + b·g, not a + (b - a)·g)
            fg = torch.stack([hi - count, count - lo]).float() / (hi - lo)
            if cosine:
                fg = (fg * (math.pi / 2)).sin().square()
            out = torch.where((count >= lo) & (count < hi), a * fg[0] + b * fg[1], out)
        return out

    return schedule


def linear_onecycle_schedule(transition_steps: int, peak_value: float, pct_start: float = 0.3,
                             pct_final: float = 0.85, div_factor: float = 25.0,
                             final_div_factor: float = 1e4) -> Schedule:  # fmt: skip
    """One cycle in three linear pieces (Smith et al. 2017, as optax): from ``peak/div``
    up to ``peak`` at ``int(pct_start·T)``, down to ``peak/div`` at ``int(pct_final·T)``,
    then to ``peak/(div·final_div)`` at ``T`` (then constant): a
    :func:`piecewise_interpolate_schedule` of those boundaries.

    Args: transition_steps ``T``, a positive int; peak_value, finite; pct_start,
        pct_final: finite fractions of ``T``; div_factor, final_div_factor: finite, > 0.
    Returns: the schedule; ``linear_onecycle_schedule(100, 1.0, div_factor=10.0)(15) == 0.55``.
    """
    name = "linear_onecycle_schedule"
    steps, peak, div, final_div = _onecycle_args(name, transition_steps, peak_value,
                                                 div_factor, final_div_factor)
    pct_start = check_finite(name, "pct_start", pct_start)
    pct_final = check_finite(name, "pct_final", pct_final)
    # (a dict literal, as optax: a later boundary equal to an earlier one replaces it)
    return _interpolated(name, "linear", peak / div, {int(pct_start * steps): div,
                                                      int(pct_final * steps): 1.0 / div,
                                                      steps: 1.0 / final_div})


def cosine_onecycle_schedule(transition_steps: int, peak_value: float, pct_start: float = 0.3,
                             div_factor: float = 25.0,
                             final_div_factor: float = 1e4) -> Schedule:  # fmt: skip
    """One cycle in two half cosines (Smith et al. 2017, as optax): from ``peak/div`` up
    to ``peak`` at ``int(pct_start·T)``, then down to ``peak/(div·final_div)`` at ``T``
    (then constant): a cosine :func:`piecewise_interpolate_schedule`.

    Args: transition_steps ``T``, a positive int; peak_value, finite; pct_start: a finite
        fraction of ``T``; div_factor, final_div_factor: finite, > 0.
    Returns: the schedule; ``cosine_onecycle_schedule(100, 1.0, div_factor=10.0)(15) == 0.55``.
    """
    name = "cosine_onecycle_schedule"
    steps, peak, div, final_div = _onecycle_args(name, transition_steps, peak_value,
                                                 div_factor, final_div_factor)
    pct_start = check_finite(name, "pct_start", pct_start)
    return _interpolated(name, "cosine", peak / div, {int(pct_start * steps): div,
                                                      steps: 1.0 / (div * final_div)})


def _onecycle_args(name: str, transition_steps: int, peak_value: float, div_factor: float,
                   final_div_factor: float) -> tuple[int, float, float, float]:
    steps = _check_steps(name, "transition_steps", transition_steps, minimum=1)
    peak = check_finite(name, "peak_value", peak_value)
    div = check_finite(name, "div_factor", div_factor, POSITIVE)
    final_div = check_finite(name, "final_div_factor", final_div_factor, POSITIVE)
    if not div * final_div > 0.0:  # (the cosine cycle's last scale divides by it)
        raise ValueError(f"{name}: div_factor * final_div_factor must be > 0, got "
                         f"{div} * {final_div} = {div * final_div}")
    return steps, peak, div, final_div


def warmup_exponential_decay_schedule(
    init_value: float, peak_value: float, warmup_steps: int, transition_steps: int,
    decay_rate: float, transition_begin: int = 0, staircase: bool = False,
    end_value: float | None = None,
) -> Schedule:  # fmt: skip
    """Warmup then exponential decay (as optax): ``linear(init, peak, W)(t)`` for
    ``t < W``, else ``exponential_decay(peak, T, r, B, staircase, end)(t - W)``.

    Args: init_value, peak_value: finite; warmup_steps ``W``, an int (``<= 0``: no
        warmup); transition_steps ``T``, decay_rate ``r`` (finite, >= 0),
        transition_begin ``B``, staircase, end_value: as :func:`exponential_decay`.
    Returns: the schedule;
        ``warmup_exponential_decay_schedule(0.0, 1.0, 10, 10, 0.5)(30) == 0.25``.
    """
    name = "warmup_exponential_decay_schedule"
    init = check_finite(name, "init_value", init_value)
    peak = check_finite(name, "peak_value", peak_value)
    warmup_steps = _check_steps(name, "warmup_steps", warmup_steps)
    transition_steps = _check_steps(name, "transition_steps", transition_steps)
    decay_rate = check_finite(name, "decay_rate", decay_rate, NONNEG)
    transition_begin = _check_steps(name, "transition_begin", transition_begin)
    if end_value is not None:
        end_value = check_finite(name, "end_value", end_value)
    return join_schedules([linear_schedule(init, peak, warmup_steps),
                           exponential_decay(peak, transition_steps, decay_rate,
                                             transition_begin, staircase, end_value)],
                          [warmup_steps])


def sgdr_schedule(cosine_kwargs: Iterable[Mapping[str, float]]) -> Schedule:
    """SGD with warm restarts (Loshchilov and Hutter 2017, as optax): cycles of
    :func:`warmup_cosine_decay_schedule`, one a mapping of its arguments, each starting
    where the last one's ``decay_steps`` end.

    Args: cosine_kwargs: the cycles, at least one; each a mapping with ``init_value``,
        ``peak_value``, ``warmup_steps`` and ``decay_steps`` (and optionally ``end_value``
        and ``exponent``), checked as that schedule checks them.
    Returns: the schedule; ``sgdr_schedule([dict(init_value=0.0, peak_value=1.0,
        warmup_steps=2, decay_steps=4)] * 2)(5) == 0.5``.
    """
    name = "sgdr_schedule"
    schedules, boundaries, step = [], [], 0
    for i, kwargs in enumerate(cosine_kwargs):
        if not isinstance(kwargs, Mapping) or "decay_steps" not in kwargs:
            raise TypeError(f"{name}: cosine_kwargs[{i}] must be a mapping of "
                            f"warmup_cosine_decay_schedule's arguments with decay_steps, "
                            f"got {kwargs!r}")
        try:
            schedules.append(warmup_cosine_decay_schedule(**kwargs))
        except (TypeError, ValueError) as err:
            raise type(err)(f"{name}: cosine_kwargs[{i}]: {err}") from err
        step += _check_steps(name, f"cosine_kwargs[{i}]['decay_steps']", kwargs["decay_steps"])
        boundaries.append(step)
    if not schedules:
        raise ValueError(f"{name}: cosine_kwargs must hold at least one cycle")
    return join_schedules(schedules, boundaries[:-1])
