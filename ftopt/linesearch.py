"""Line searches (optax's ``scale_by_backtracking_linesearch``, with the helpers the zoom
line search of :mod:`ftopt.zoom_linesearch` shares, and ``value_and_grad_from_state``).

A line search scales the incoming update ``u`` by a step ``η`` found by evaluating the
objective along ``w + η·u``: ``update`` takes ``value=`` (the objective at the params),
``grad=`` (its gradient) and ``value_fn=`` (the objective as a function of the params tree),
and hands every other keyword that ``value_fn`` names to it (optax's convention: data
batches travel as extra keywords of ``update``). Gradients along the line come from
``torch.autograd.grad`` (optax's ``jax.value_and_grad``).

These run as eager torch ops. optax decides its loops with ``jax.lax.while_loop``; here
the loop runs on the host: each trial reads the objective's value and slope (two scalars)
from the device, and the few scalar decisions of a trial are made in Python floats
(float64), where optax computes them in the params' dtype; the step found is stored in the
state's dtype and scales the updates in the updates' dtype.

``skip_zeros`` (SPEC §3): the backtracking search keeps only 0-d state unless
``store_grad=True``; it scales the incoming update, so an element whose update is zero
stays zero, and it honours ``skip_zeros`` (its step comes from the masked direction, as a
norm would). With ``store_grad=True`` (and always for the zoom search) the state holds the
objective's gradient at the new params, a per-element state that must change where the raw
gradient was zero: the update raises rather than break §3's promise.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from ftopt import tree as tree_lib
from ftopt.base import GradientTransformation, register_owner, register_state
from ftopt.domains import NONNEG, check_finite, check_int
from ftopt.rules import check_param, checked_params, compute_dtype
from ftopt.validate import check_leaf

__all__ = ["BacktrackingLinesearchInfo", "ScaleByBacktrackingLinesearchState",
           "scale_by_backtracking_linesearch", "value_and_grad_from_state"]

_OWN_EXTRA = ("zero_mask", "backend")  # ftopt's own keywords of update, not value_fn's


@register_state
class BacktrackingLinesearchInfo(NamedTuple):
    """optax's: the trials of the last search and its final decrease error (> 0: no step
    with sufficient decrease was found)."""

    num_linesearch_steps: torch.Tensor
    decrease_error: torch.Tensor


@register_state
class ScaleByBacktrackingLinesearchState(NamedTuple):
    """optax's layout: the step found, the objective there, its gradient there (``None``
    unless ``store_grad``) and :class:`BacktrackingLinesearchInfo`."""

    learning_rate: torch.Tensor
    value: torch.Tensor
    grad: Any
    info: BacktrackingLinesearchInfo


def value_dtype(flat: list) -> torch.dtype:
    """The dtype of a line search's 0-d state: the first param's, at least float32."""
    return torch.promote_types(flat[0].dtype, torch.float32) if flat else torch.float32


def dot(a: list, b: list) -> float:
    """Σ⟨a_i, b_i⟩ over pairs of tensors (each leaf's sum in its compute dtype), read as a
    host float."""
    total = None
    for x, y in zip(a, b):
        dt = torch.promote_types(compute_dtype(x), compute_dtype(y))
        s = (x.to(dt) * y.to(dt)).sum()
        total = s.to(torch.float64).cpu() if total is None else total + s.to(
            torch.float64).cpu()
    return 0.0 if total is None else float(total)


def check_refuses_mask(name: str, extra: Mapping, why: str) -> None:
    """Raise where a skip-aware chain hands this transform its zero mask (SPEC §3)."""
    if extra.get("zero_mask") is not None:
        raise ValueError(f"{name} cannot honour skip_zeros (SPEC §3): {why}; leave "
                         "skip_zeros out of a chain that holds it")


def objective_args(name: str, value: Any, grad: Any, value_fn: Any, extra: Mapping
                   ) -> dict:
    """Check that ``update`` got what a line search needs; the keywords for ``value_fn``
    (optax's ``_extract_fns_kwargs``: the extra keywords ``value_fn`` names)."""
    missing = [k for k, v in (("value", value), ("grad", grad), ("value_fn", value_fn))
               if v is None]
    if missing:
        raise TypeError(
            f"{name}: update needs value= (the objective at params), grad= (its gradient, "
            "a tree like params) and value_fn= (the objective as a function of params); "
            f"missing: {', '.join(missing)} (tx.update(grads, state, params, value=loss, "
            "grad=grads, value_fn=fn))")
    if not callable(value_fn):
        raise TypeError(f"{name}: value_fn must be a function of the params, got "
                        f"{type(value_fn).__name__}")
    names = set(inspect.signature(value_fn).parameters)
    given = {k: v for k, v in extra.items() if k not in _OWN_EXTRA}
    left = sorted(k for k in given if k not in names)
    if left:
        raise TypeError(f"Unexpected keyword arguments passed to `{name}.update`. These "
                        f"arguments were not consumed by `value_fn`: {left}. Ensure that "
                        "all extra keyword arguments are accepted by `value_fn`.")
    return {k: v for k, v in given.items() if k in names}


def _scalar(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        got = (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
               else type(value).__name__)
        raise TypeError(f"{name}: value_fn must return a scalar tensor (one element), got "
                        f"{got}")
    return value.reshape(())


def value_and_grad(value_fn: Callable, params: Any, *args: Any, **kwargs: Any
                   ) -> tuple[torch.Tensor, Any]:
    """``value_fn(params, *args, **kwargs)`` and its gradient in ``params`` (a tree like
    it; zeros where the value does not depend on a leaf), through ``torch.autograd``.
    The params are detached copies of no one's graph: the caller's tensors are not
    touched and nothing is kept for a later backward."""
    _, flat, spec = tree_lib.flatten_with_paths(params)
    leaves = [p.detach().requires_grad_(True) for p in flat]
    with torch.enable_grad():
        value = _scalar("value_and_grad", value_fn(tree_lib.unflatten(spec, leaves), *args,
                                                   **kwargs))
        grads = (torch.autograd.grad(value, leaves, allow_unused=True) if value.requires_grad
                 else [None] * len(leaves))
    grads = [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(flat, grads)]
    return value.detach(), tree_lib.unflatten(spec, grads)


def value_only(value_fn: Callable, params: Any, **kwargs: Any) -> torch.Tensor:
    with torch.no_grad():
        return _scalar("value_fn", value_fn(params, **kwargs)).detach()


class Line:
    """The objective along ``w + η·u`` for one ``update`` call: the leaves of the params,
    the update (``None`` where there is no gradient) and the given gradient."""

    def __init__(self, name: str, updates: Any, params: Any, grad: Any, value_fn: Callable,
                 fn_kwargs: dict):
        if params is None:
            raise ValueError(f"{name} needs params: call update(updates, state, params, "
                             "value=..., grad=..., value_fn=...)")
        paths, self.p, self.spec = tree_lib.flatten_with_paths(params)
        self.u = tree_lib.flatten_like(self.spec, updates, "updates", paths)
        self.g = tree_lib.flatten_like(self.spec, grad, "grad", paths)
        for path, u, p, g in zip(paths, self.u, self.p, self.g):
            check_param(path, p)
            if u is not None:
                check_leaf(path, u, p)
            if g is not None:
                check_leaf(path, g, p)
        self.on = [i for i, u in enumerate(self.u) if u is not None]
        self.value_fn, self.fn_kwargs = value_fn, fn_kwargs

    def params_at(self, eta: float) -> Any:
        """``w + η·u`` (``w`` where ``u`` is ``None``), in the params' dtypes."""
        return tree_lib.unflatten(self.spec, [
            p if u is None else (p + eta * u.to(p.dtype)) for p, u in zip(self.p, self.u)])

    def slope(self, grad_flat: list) -> float:
        """⟨g, u⟩ over the leaves with an update (a ``None`` gradient leaf counts 0)."""
        pairs = [(grad_flat[i], self.u[i]) for i in self.on if grad_flat[i] is not None]
        return dot([g for g, _ in pairs], [u for _, u in pairs])

    def value_grad_slope(self, eta: float) -> tuple[float, Any, float]:
        value, grad = value_and_grad(self.value_fn, self.params_at(eta), **self.fn_kwargs)
        return float(value), grad, self.slope(self.spec.flatten_up_to(grad))

    def value(self, eta: float) -> float:
        return float(value_only(self.value_fn, self.params_at(eta), **self.fn_kwargs))

    def scaled(self, eta: float) -> Any:
        """``η·u``, each leaf in its own dtype."""
        return tree_lib.unflatten(self.spec, [
            None if u is None else (u.to(compute_dtype(u)) * eta).to(u.dtype) for u in self.u])

    def kept_grad(self, grad: Any) -> Any:
        """A gradient to store: copies in the params' dtypes (the caller's ``.grad``
        tensors may be zeroed in place later); zeros for ``None`` leaves."""
        flat = self.spec.flatten_up_to(grad)
        return tree_lib.unflatten(self.spec, [
            torch.zeros_like(p) if g is None else g.to(p.dtype, copy=True)
            for p, g in zip(self.p, flat)])


def nan_to_inf(x: float) -> float:
    return math.inf if math.isnan(x) else x


class BacktrackingLinesearch:
    """The object behind :func:`scale_by_backtracking_linesearch` (see there)."""

    unfused_reason = ("scale_by_backtracking_linesearch runs eagerly: it evaluates value_fn "
                      "passed to update")
    name = "scale_by_backtracking_linesearch"
    update_keywords = ("value", "grad", "value_fn")

    def __init__(self, max_steps, slope_rtol, decrease_factor, increase_factor, max_lr, atol,
                 rtol, store_grad):
        n = self.name
        self.max_steps = check_int(n, "max_backtracking_steps", max_steps, minimum=0)
        self.slope_rtol = check_finite(n, "slope_rtol", slope_rtol, NONNEG)
        self.decrease_factor = check_finite(n, "decrease_factor", decrease_factor, NONNEG)
        self.increase_factor = float(increase_factor)  # math.inf: start at max_learning_rate
        if math.isnan(self.increase_factor) or self.increase_factor < 0:
            raise ValueError(f"{n}: increase_factor must be >= 0, got {increase_factor}")
        self.max_lr = check_finite(n, "max_learning_rate", max_lr, NONNEG)
        self.atol = check_finite(n, "atol", atol, NONNEG)
        self.rtol = check_finite(n, "rtol", rtol, NONNEG)
        self.store_grad = bool(store_grad)
        register_owner(self)

    def init(self, params) -> ScaleByBacktrackingLinesearchState:
        paths, flat, _ = checked_params(params)
        dt, dev = value_dtype(flat), tree_lib.state_device(flat)
        return ScaleByBacktrackingLinesearchState(
            learning_rate=torch.ones((), dtype=dt, device=dev),
            value=torch.full((), math.inf, dtype=dt, device=dev),
            grad=tree_lib.zeros_like(params) if self.store_grad else None,
            info=BacktrackingLinesearchInfo(
                num_linesearch_steps=torch.zeros((), dtype=torch.int32, device=dev),
                decrease_error=torch.full((), math.inf, dtype=dt, device=dev)))

    def _decrease_error(self, lr: float, slope: float, value: float, new: float) -> float:
        err = nan_to_inf(new - (1.0 + self.rtol) * value - lr * self.slope_rtol * slope)
        return max(err, 0.0)

    def update(self, updates, state, params=None, *, value: Any = None, grad: Any = None,
               value_fn: Callable | None = None, **extra):
        if self.store_grad:
            check_refuses_mask(self.name, extra, "with store_grad=True its state holds the "
                               "objective's gradient at the new params, which moves where "
                               "the raw gradient is zero")
        fn_kwargs = objective_args(self.name, value, grad, value_fn, extra)
        if not isinstance(state, ScaleByBacktrackingLinesearchState):
            raise TypeError(f"{self.name}: expected a ScaleByBacktrackingLinesearchState, "
                            f"got {type(state).__name__}")
        line = Line(self.name, updates, params, grad, value_fn, fn_kwargs)
        value0 = float(torch.as_tensor(value))
        slope = line.slope(line.g)
        lr = min(self.increase_factor * float(state.learning_rate), self.max_lr)
        new_value, new_grad, err, it = value0, None, math.inf, 0
        while not err <= self.atol and it <= self.max_steps:
            if it > 0:
                lr = self.decrease_factor * lr
            lr = float(torch.tensor(lr, dtype=state.learning_rate.dtype))  # optax's dtype
            last = it == self.max_steps
            if self.store_grad:
                v, g = value_and_grad(value_fn, line.params_at(lr), **fn_kwargs)
                new_value = float(v)
                err = self._decrease_error(lr, slope, value0, new_value)
                if err <= self.atol or last:
                    new_grad = g
            else:
                new_value = line.value(lr)
                err = self._decrease_error(lr, slope, value0, new_value)
            it += 1
        step = 0.0 if math.isinf(err) else lr  # no step into inf or NaN values
        dt, dev = state.learning_rate.dtype, state.learning_rate.device
        full = lambda x: torch.full((), x, dtype=dt, device=dev)  # noqa: E731
        if self.store_grad:
            kept = line.kept_grad(new_grad) if new_grad is not None else state.grad
        else:
            kept = None
        info = BacktrackingLinesearchInfo(
            num_linesearch_steps=torch.full((), it, dtype=torch.int32, device=dev),
            decrease_error=full(err))
        return line.scaled(step), ScaleByBacktrackingLinesearchState(
            learning_rate=full(step), value=full(new_value), grad=kept, info=info)


def scale_by_backtracking_linesearch(
    max_backtracking_steps: int,
    slope_rtol: float = 1e-4,
    decrease_factor: float = 0.8,
    increase_factor: float = 1.5,
    max_learning_rate: float = 1.0,
    atol: float = 0.0,
    rtol: float = 0.0,
    store_grad: bool = False,
) -> GradientTransformation:
    """Backtracking line search (Armijo), as optax: scales the update ``u`` by the first
    ``η`` of ``η₀, δ·η₀, δ²·η₀, …`` (δ = ``decrease_factor``, at most
    ``max_backtracking_steps`` decreases) with

        f(w + η·u) <= (1 + rtol)·f(w) + η·c·⟨u, ∇f(w)⟩ + atol,  c = ``slope_rtol``,

    where ``η₀ = min(increase_factor·η_prev, max_learning_rate)`` (η_prev the last step
    found, 1 at first). ``u`` must be a descent direction (⟨u, ∇f(w)⟩ < 0). If every trial
    gives an infinite or NaN error the step is 0. Call ``tx.update(grads, state, params,
    value=f(w), grad=∇f(w), value_fn=f, **data)``: keywords that ``value_fn`` names are
    passed to it (others raise ``TypeError``). ``store_grad`` keeps the gradient at the new
    params in the state for :func:`value_and_grad_from_state`.

    Differences from optax: no ``verbose``; the loop runs on the host (module docstring);
    with ``store_grad=True`` it refuses ``skip_zeros``.

    Args:
        max_backtracking_steps: an int >= 0. slope_rtol, decrease_factor,
        max_learning_rate, atol, rtol: floats >= 0. increase_factor: >= 0 (``math.inf``:
        start each search at ``max_learning_rate``). store_grad: keep the gradient.
    """
    obj = BacktrackingLinesearch(max_backtracking_steps, slope_rtol, decrease_factor,
                                 increase_factor, max_learning_rate, atol, rtol, store_grad)
    return GradientTransformation(obj.init, obj.update)


def _find(tree: Any, key: str) -> list:
    """The values of the NamedTuple fields and mapping entries named ``key`` in ``tree``."""
    found = []

    def walk(x):
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            for f, v in zip(x._fields, x):
                if f == key:
                    found.append(v)
                walk(v)
        elif isinstance(x, Mapping):
            for k, v in x.items():
                if k == key:
                    found.append(v)
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
    walk(tree)
    return found


def value_and_grad_from_state(value_fn: Callable[..., Any]) -> Callable[..., tuple[Any, Any]]:
    """As optax: a ``value_and_grad(params, *args, state=state, **kwargs)`` that returns the
    objective's value and gradient stored in ``state`` by a line search (the ``value`` and
    ``grad`` fields of :class:`ScaleByZoomLinesearchState`, or of
    :class:`ScaleByBacktrackingLinesearchState` with ``store_grad=True``), and computes
    them with ``torch.autograd`` (``value_fn(params, *args, **kwargs)``) where the stored
    value is infinite or NaN (the first step). Raises ``ValueError`` if the state holds no
    value or gradient (``KeyError`` if it holds several). The value is read on the host.
    """
    if not callable(value_fn):
        raise TypeError(f"value_and_grad_from_state: value_fn must be a function, got "
                        f"{type(value_fn).__name__}")

    def fetch(params: Any, *fn_args: Any, state: Any, **fn_kwargs: Any):
        values, grads = _find(state, "value"), _find(state, "grad")
        if len(values) > 1 or len(grads) > 1:
            raise KeyError(f"value_and_grad_from_state: found {len(values)} 'value' and "
                           f"{len(grads)} 'grad' entries in the state, expected one each")
        value = values[0] if values else None
        grad = grads[0] if grads else None
        if value is None or grad is None:
            raise ValueError("Value or gradient not found in the state. Make sure that "
                             "these values are stored in the state by the optimizer.")
        if math.isfinite(float(value)):
            return value, grad
        return value_and_grad(value_fn, params, *fn_args, **fn_kwargs)

    return fetch
