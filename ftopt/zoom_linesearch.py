"""optax's zoom line search (``scale_by_zoom_linesearch``): a step satisfying the strong
Wolfe conditions (Nocedal & Wright's Algorithms 3.5 and 3.6), with Hager and Zhang's
approximate sufficient decrease near a minimum, cubic and quadratic interpolation in the
zoom. The loop and its scalar decisions run on the host (see :mod:`ftopt.linesearch`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch

from ftopt import tree as tree_lib
from ftopt.base import GradientTransformation, register_owner, register_state
from ftopt.domains import NONNEG, check_finite, check_int
from ftopt.linesearch import Line, check_refuses_mask, nan_to_inf, objective_args, value_dtype
from ftopt.rules import checked_params

__all__ = ["ZoomLinesearchInfo", "ScaleByZoomLinesearchState", "scale_by_zoom_linesearch"]


@register_state
class ZoomLinesearchInfo(NamedTuple):
    """optax's: the trials of the last search and its final sufficient decrease and
    curvature errors (> 0: the condition does not hold at the last trial)."""

    num_linesearch_steps: torch.Tensor
    decrease_error: torch.Tensor
    curvature_error: torch.Tensor


@register_state
class ScaleByZoomLinesearchState(NamedTuple):
    """optax's layout: the step found, the objective and its gradient there (for
    :func:`ftopt.value_and_grad_from_state`) and :class:`ZoomLinesearchInfo`."""

    learning_rate: torch.Tensor
    value: torch.Tensor
    grad: Any
    info: ZoomLinesearchInfo


def _div(a: float, b: float) -> float:
    """a / b with IEEE semantics (±inf, or NaN for 0/0), as jnp divides."""
    if b != 0.0:
        return a / b
    if a == 0.0 or math.isnan(a):
        return math.nan
    return math.inf if (a > 0) == (math.copysign(1.0, b) > 0) else -math.inf


def _sqrt(x: float) -> float:
    return math.sqrt(x) if x >= 0.0 else math.nan  # (NaN stays NaN)


def _max(a: float, b: float) -> float:  # jnp.maximum: NaN propagates
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _min(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else min(a, b)


def cubicmin(a, fa, fpa, b, fb, c, fc) -> float:
    """The critical point of the cubic through (a, fa), (b, fb), (c, fc) with slope fpa at
    a (scipy's and optax's ``_cubicmin``); NaN where there is none."""
    db, dc = b - a, c - a
    denom = (db * dc) * (db * dc) * (db - dc)
    rb, rc = fb - fa - fpa * db, fc - fa - fpa * dc
    big_a = _div(dc * dc * rb - db * db * rc, denom)
    big_b = _div(-(dc * dc * dc) * rb + db * db * db * rc, denom)
    radical = big_b * big_b - 3.0 * big_a * fpa
    return a + _div(-big_b + _sqrt(radical), 3.0 * big_a)


def quadmin(a, fa, fpa, b, fb) -> float:
    """The critical point of the quadratic through (a, fa), (b, fb) with slope fpa at a."""
    db = b - a
    big_b = _div(fb - fa - fpa * db, db * db)
    return a - _div(fpa, 2.0 * big_b)


@dataclass(frozen=True)
class _Search:
    """optax's ``ZoomLinesearchState`` over host floats (the grads are trees)."""

    count: int
    stepsize: float
    value: float
    grad: Any
    slope: float
    value_init: float
    slope_init: float
    decrease_error: float = math.inf
    curvature_error: float = math.inf
    interval_found: bool = False
    done: bool = False
    failed: bool = False
    low: float = 0.0
    value_low: float = 0.0
    slope_low: float = 0.0
    high: float = 0.0
    value_high: float = 0.0
    slope_high: float = 0.0
    cubic_ref: float = 0.0
    value_cubic_ref: float = 0.0
    safe_stepsize: float = 0.0
    safe_value: float = 0.0
    safe_grad: Any = None


class ZoomLinesearch:
    """The object behind :func:`scale_by_zoom_linesearch` (see there)."""

    unfused_reason = ("scale_by_zoom_linesearch runs eagerly: it evaluates value_fn passed "
                      "to update")
    name = "scale_by_zoom_linesearch"
    update_keywords = ("value", "grad", "value_fn")

    def __init__(self, max_steps, max_lr, tol, increase_factor, slope_rtol, curv_rtol,
                 approx_dec_rtol, stepsize_precision, initial_guess_strategy):
        n = self.name
        self.max_steps = check_int(n, "max_linesearch_steps", max_steps, minimum=0)
        self.max_lr = None if max_lr is None else check_finite(n, "max_learning_rate",
                                                               max_lr, NONNEG)
        self.tol = check_finite(n, "tol", tol, NONNEG)
        self.increase_factor = check_finite(n, "increase_factor", increase_factor, NONNEG)
        self.slope_rtol = check_finite(n, "slope_rtol", slope_rtol, NONNEG)
        self.curv_rtol = float(curv_rtol)  # math.inf: no curvature condition (optax's note)
        if math.isnan(self.curv_rtol) or self.curv_rtol < 0:
            raise ValueError(f"{n}: curv_rtol must be >= 0 (math.inf allowed), got {curv_rtol}")
        self.approx_dec_rtol = (None if approx_dec_rtol is None else
                                check_finite(n, "approx_dec_rtol", approx_dec_rtol, NONNEG))
        self.threshold = check_finite(n, "stepsize_precision", stepsize_precision, NONNEG)
        if initial_guess_strategy not in ("one", "keep"):
            raise ValueError(f"{n}: initial_guess_strategy must be 'one' or 'keep', got "
                             f"{initial_guess_strategy!r}")
        self.guess = initial_guess_strategy
        register_owner(self)

    def init(self, params) -> ScaleByZoomLinesearchState:
        paths, flat, _ = checked_params(params)
        dt, dev = value_dtype(flat), tree_lib.state_device(flat)
        inf = torch.full((), math.inf, dtype=dt, device=dev)
        return ScaleByZoomLinesearchState(
            learning_rate=torch.ones((), dtype=dt, device=dev), value=inf,
            grad=tree_lib.zeros_like(params),
            info=ZoomLinesearchInfo(torch.zeros((), dtype=torch.int32, device=dev),
                                    inf.clone(), inf.clone()))

    # ---- optax's criteria ------------------------------------------------------------
    def _decrease_error(self, stepsize, value, slope, value_init, slope_init) -> float:
        err = value - value_init - self.slope_rtol * stepsize * slope_init  # Armijo
        if self.approx_dec_rtol is not None:  # Hager-Zhang's, near a minimum
            approx = slope - (2 * self.slope_rtol - 1.0) * slope_init
            delta = value - value_init - self.approx_dec_rtol * abs(value_init)
            err = _min(_max(approx, delta), err)
        return nan_to_inf(_max(err, 0.0))

    def _curvature_error(self, slope, slope_init) -> float:
        return nan_to_inf(_max(abs(slope) - self.curv_rtol * abs(slope_init), 0.0))

    def _errors(self, stepsize, value, slope, s: _Search) -> tuple[float, float, float]:
        dec = self._decrease_error(stepsize, value, slope, s.value_init, s.slope_init)
        curv = self._curvature_error(slope, s.slope_init)
        return dec, curv, _max(dec, curv)

    # ---- Algorithm 3.5: an interval holding a good step --------------------------------
    def _search_interval(self, s: _Search, line: Line, guess: float) -> _Search:
        it = s.count
        new = guess if it == 0 else self.increase_factor * s.stepsize
        reached = False
        if self.max_lr is not None:
            reached = new >= self.max_lr
            new = min(new, self.max_lr)
        value, grad, slope = line.value_grad_slope(new)
        dec, curv, err = self._errors(new, value, slope, s)
        safe = (new, value, grad) if dec <= self.tol else (
            s.safe_stepsize, s.safe_value, s.safe_grad)
        set_high = dec > 0.0 or (value >= s.value and it > 0)
        set_low = slope >= 0.0 and not set_high
        if set_low:
            low, high = (new, value, slope), (s.stepsize, s.value, s.slope)
        else:
            low, high = (s.stepsize, s.value, s.slope), (new, value, slope)
        found = set_high or set_low or err <= self.tol
        done = err <= self.tol or (reached and not found)
        return replace(
            s, count=it + 1, stepsize=new, value=value, grad=grad, slope=slope,
            decrease_error=dec, curvature_error=curv, interval_found=found, done=done,
            failed=it + 1 >= self.max_steps and not done,
            low=low[0], value_low=low[1], slope_low=low[2],
            high=high[0], value_high=high[1], slope_high=high[2],
            cubic_ref=low[0], value_cubic_ref=low[1],
            safe_stepsize=safe[0], safe_value=safe[1], safe_grad=safe[2])

    # ---- Algorithm 3.6: zoom into the interval -----------------------------------------
    def _zoom(self, s: _Search, line: Line) -> _Search:
        delta = abs(s.high - s.low)
        left, right = min(s.high, s.low), max(s.high, s.low)
        too_small = delta <= self.threshold
        cubic = cubicmin(s.low, s.value_low, s.slope_low, s.high, s.value_high, s.cubic_ref,
                         s.value_cubic_ref)
        quad = quadmin(s.low, s.value_low, s.slope_low, s.high, s.value_high)
        if left + 0.2 * delta < cubic < right - 0.2 * delta:
            middle = cubic
        elif left + 0.1 * delta < quad < right - 0.1 * delta:
            middle = quad
        else:
            middle = (s.low + s.high) / 2.0
        value, grad, slope = line.value_grad_slope(middle)
        dec, curv, err = self._errors(middle, value, slope, s)
        if dec <= self.tol and value < s.safe_value:  # the lowest point with a decrease
            safe = (middle, value, grad)
        else:
            safe = (s.safe_stepsize, s.safe_value, s.safe_grad)
        done = err <= self.tol
        set_high_to_middle = dec > 0.0 or value >= s.value_low
        set_high_to_low = slope * (s.high - s.low) >= 0.0 and not set_high_to_middle
        mid, low, high = (middle, value, slope), (s.low, s.value_low, s.slope_low), (
            s.high, s.value_high, s.slope_high)
        new_high = low if set_high_to_low else mid if set_high_to_middle else high
        new_low = low if set_high_to_middle else mid
        ref = high if set_high_to_middle or set_high_to_low else low
        # Stop on a too small interval only once a step with sufficient decrease is known.
        failed = (s.count + 1 >= self.max_steps or (too_small and safe[0] > 0.0)) and not done
        return replace(
            s, count=s.count + 1, stepsize=middle, value=value, grad=grad, slope=slope,
            decrease_error=dec, curvature_error=curv, done=done, failed=failed,
            low=new_low[0], value_low=new_low[1], slope_low=new_low[2],
            high=new_high[0], value_high=new_high[1], slope_high=new_high[2],
            cubic_ref=ref[0], value_cubic_ref=ref[1],
            safe_stepsize=safe[0], safe_value=safe[1], safe_grad=safe[2])

    @staticmethod
    def _try_safe_step(s: _Search) -> _Search:
        """On failure: the step with sufficient decrease if one was found (or stay, if the
        last trial left the domain), else the last trial."""
        if s.safe_stepsize > 0.0 or math.isinf(s.decrease_error):
            return replace(s, stepsize=s.safe_stepsize, value=s.safe_value, grad=s.safe_grad)
        return s

    def search(self, line: Line, value: float, slope: float, guess: float) -> _Search:
        """optax's ``while_loop`` of ``step_fn`` from ``init_fn``'s state."""
        given = tree_lib.unflatten(line.spec, line.g)
        s = _Search(count=0, stepsize=0.0, value=value, grad=given, slope=slope,
                    value_init=value, slope_init=slope, value_low=value, slope_low=slope,
                    value_high=value, slope_high=slope, value_cubic_ref=value,
                    safe_value=value, safe_grad=given)
        while not (s.done or s.failed):
            s = self._zoom(s, line) if s.interval_found else self._search_interval(
                s, line, guess)
            if s.failed:
                s = self._try_safe_step(s)
        return s

    def update(self, updates, state, params=None, *, value: Any = None, grad: Any = None,
               value_fn: Callable | None = None, **extra):
        check_refuses_mask(self.name, extra, "its state holds the objective's gradient at "
                           "the new params, which moves where the raw gradient is zero")
        fn_kwargs = objective_args(self.name, value, grad, value_fn, extra)
        if not isinstance(state, ScaleByZoomLinesearchState):
            raise TypeError(f"{self.name}: expected a ScaleByZoomLinesearchState, got "
                            f"{type(state).__name__}")
        line = Line(self.name, updates, params, grad, value_fn, fn_kwargs)
        dt, dev = state.learning_rate.dtype, state.learning_rate.device
        round_ = lambda x: float(torch.tensor(x, dtype=dt))  # noqa: E731 (optax's dtype)
        value0 = round_(float(torch.as_tensor(value)))
        guess = 1.0 if self.guess == "one" else float(state.learning_rate)
        s = self.search(line, value0, line.slope(line.g), guess)
        step = round_(s.stepsize)
        full = lambda x: torch.full((), x, dtype=dt, device=dev)  # noqa: E731
        info = ZoomLinesearchInfo(torch.full((), s.count, dtype=torch.int32, device=dev),
                                  full(s.decrease_error), full(s.curvature_error))
        return line.scaled(step), ScaleByZoomLinesearchState(
            learning_rate=full(step), value=full(s.value), grad=line.kept_grad(s.grad),
            info=info)


def scale_by_zoom_linesearch(
    max_linesearch_steps: int,
    max_learning_rate: float | None = None,
    tol: float = 0.0,
    increase_factor: float = 2.0,
    slope_rtol: float = 1e-4,
    curv_rtol: float = 0.9,
    approx_dec_rtol: float | None = 1e-6,
    stepsize_precision: float = 1e-5,
    initial_guess_strategy: str = "keep",
) -> GradientTransformation:
    """Zoom line search, as optax: scales the update ``u`` by a step ``η`` that satisfies
    sufficient decrease and small curvature (the strong Wolfe conditions), with
    ``φ(η) = f(w + η·u)``, c₁ = ``slope_rtol``, c₂ = ``curv_rtol``, ε = ``tol``:

        φ(η) <= φ(0) + c₁·η·φ'(0) + ε   and   |φ'(η)| <= c₂·|φ'(0)| + ε.

    Near a minimum (φ(η) <= φ(0) + c₃·|φ(0)|, c₃ = ``approx_dec_rtol``; ``None``: off)
    Hager and Zhang's approximate decrease φ'(η) <= (2c₁ − 1)·φ'(0) may stand for the
    first. Phase 1 tries η = guess, then ×``increase_factor`` (capped at
    ``max_learning_rate``) until an interval holding a good step is found; phase 2 zooms
    into it by cubic, else quadratic, else bisection steps. At most
    ``max_linesearch_steps`` evaluations; on failure it takes the lowest step with
    sufficient decrease seen (or the last trial), and once the interval is narrower than
    ``stepsize_precision`` with such a step known it stops there. The guess is 1
    (``initial_guess_strategy="one"``, for quasi-Newton directions) or the last step found
    (``"keep"``). Call ``tx.update(grads, state, params, value=f(w), grad=∇f(w),
    value_fn=f, **data)``; the state keeps f and ∇f at the new params for
    :func:`ftopt.value_and_grad_from_state`.

    Differences from optax: no ``verbose``; the loop and its scalar decisions run on the
    host in float64 (:mod:`ftopt.linesearch`); it refuses ``skip_zeros``.

    Args:
        max_linesearch_steps: an int >= 0. max_learning_rate: >= 0 or ``None``.
        tol, increase_factor, slope_rtol, stepsize_precision: >= 0. curv_rtol: >= 0
        (``math.inf``: sufficient decrease only). approx_dec_rtol: >= 0 or ``None``.
        initial_guess_strategy: ``"one"`` or ``"keep"``.
    """
    obj = ZoomLinesearch(max_linesearch_steps, max_learning_rate, tol, increase_factor,
                         slope_rtol, curv_rtol, approx_dec_rtol, stepsize_precision,
                         initial_guess_strategy)
    return GradientTransformation(obj.init, obj.update)
