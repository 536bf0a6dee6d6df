"""Aggregators of per-element gradients (optax's ``optax.experimental.aggregating``).

Per-element gradients come from ``torch.func.vmap(torch.func.grad(loss), in_dims=(None,
0, 0))(params, x, y)``: each leaf is ``(*batch_shape, *param_shape)``. An
:class:`Aggregator` maps such a tree to one update per param; :func:`process` chains a
per-element preprocessor (e.g. clipping each example), an aggregator and an optimizer::

    opt = aggregating.process(
        ftopt.stateless(lambda g, _: torch.func.vmap(clip)(g)),
        aggregating.average_per_element_updates(),   # a = (1/B) Σ_b g_b
        ftopt.adam(1e-1))
    updates, state = opt.update(per_example_grads, state)

:func:`accumulate_avg_updates` and :func:`average_incrementally_updates` average over
``k`` microbatches and let the optimizer step once per ``k`` calls (zeros in between,
``ready`` marking the step); these are defined in :mod:`ftopt.experimental.aggregators`.

:func:`add_mean_variance_to_opt` keeps EMAs of the mean and variance of the per-element
gradients in the state, beside an optimizer: the aggregator
:func:`get_per_element_mean_and_sum_sq_diff_grads` gives the batch mean and, as aux, the
sum of squared deviations from it, merged over microbatches with the pairwise update of
Chan et al.; :func:`track_per_element_mean_and_variance_with_ema` keeps EMAs of the mean
and of the unbiased variance ``S / (n − 1)``; :func:`get_unbiased_mean_and_variance_ema`
reads them off the state, bias-corrected.

Differences from optax: states are tensors (int32 counts, a bool ``ready``) of one
structure from ``init`` on; :func:`process` branches on ``ready`` in Python where optax
uses ``lax.cond``; every ``update`` takes and ignores extra keyword arguments; bad input
(leaves disagreeing on the batch size, a missing axis, shapes unlike the params') raises
``ValueError``/``TypeError`` naming the pytree path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ftopt import tree as tree_lib
from ftopt.base import (
    GradientTransformation,
    check_transform,
    register_owner,
    register_state,
    stateless,
)
from ftopt.combine import chain
from ftopt.experimental.aggregators import (
    AccumulateAvgUpdatesState,
    AggregatedUpdates,
    Aggregator,
    AggregatorUpdateFn,
    MaybeAxis,
    PerElementUpdates,
    accumulate_avg_updates,
    average_incrementally_updates,
    average_per_element_updates,
    batch_axes,
    check_axis,
    check_state,
    check_steps,
    get_batch_size_from_per_elt_updates,
    like_state,
    process,
)
from ftopt.numerics import init_empty_state, safe_int32_increment

__all__ = [
    "PerElementUpdates", "AggregatedUpdates", "MaybeAxis", "AggregatorUpdateFn",
    "Aggregator", "process", "average_per_element_updates", "AccumulateAvgUpdatesState",
    "accumulate_avg_updates", "average_incrementally_updates",
    "get_batch_size_from_per_elt_updates", "PerElementMeanAndSumSqDiffGradsState",
    "get_per_element_mean_and_sum_sq_diff_grads", "PerElementMeanAndVarianceEMAState",
    "track_per_element_mean_and_variance_with_ema", "get_unbiased_mean_and_variance_ema",
    "add_mean_variance_to_opt",
]


@register_state
class PerElementMeanAndSumSqDiffGradsState(NamedTuple):
    """``micro_step`` (int32) and ``ready`` (bool) as in ``AccumulateAvgUpdatesState``;
    ``mean_grads``: the mean of the elements seen since the last output;
    ``sum_sq_diff_grads``: their sum of squared deviations from it (both like the
    params)."""

    micro_step: torch.Tensor
    ready: torch.Tensor
    mean_grads: Any
    sum_sq_diff_grads: Any


def _batch_moments(fn: str, updates: Any, axis: int | tuple[int, ...]
                   ) -> tuple[list, list, Any, int]:
    """Per leaf, the batch mean ``m = (1/B) Σ_b u_b`` and ``S = Σ_b (u_b − m)²``."""
    flat, axes, spec, size = batch_axes(fn, updates, axis)
    if size == 0:
        raise ValueError(f"{fn}: the batch is empty (batch size 0), its mean is undefined")
    kept = [x.mean(dim=a, keepdim=True) for x, a in zip(flat, axes)]
    ssd = [torch.square(x - m).sum(dim=a) for x, m, a in zip(flat, kept, axes)]
    return [m.squeeze(a) for m, a in zip(kept, axes)], ssd, spec, size


class _Moments:
    def __init__(self, per_elt_axis: int | Sequence[int], steps: int):
        self.fn = "get_per_element_mean_and_sum_sq_diff_grads"
        self.axis = check_axis(self.fn, per_elt_axis)
        self.steps = check_steps(self.fn, steps)
        register_owner(self)

    def init(self, params: Any) -> PerElementMeanAndSumSqDiffGradsState:
        device = tree_lib.state_device(tree_lib.leaves(params))
        return PerElementMeanAndSumSqDiffGradsState(
            micro_step=torch.zeros((), dtype=torch.int32, device=device),
            ready=torch.zeros((), dtype=torch.bool, device=device),
            mean_grads=tree_lib.zeros_like(params),
            sum_sq_diff_grads=tree_lib.zeros_like(params))

    def update_once(self, updates, state, params=None, **extra):
        del params, extra
        means, ssd, spec, size = _batch_moments(self.fn, updates, self.axis)
        aux = {"sum_sq_diff_grads": tree_lib.unflatten(spec, ssd), "sample_size": size}
        return (tree_lib.unflatten(spec, means), aux), state

    def update(self, updates, state, params=None, **extra):
        del params, extra
        check_state(self.fn, state, PerElementMeanAndSumSqDiffGradsState)
        means, ssd, spec, size = _batch_moments(self.fn, updates, self.axis)
        what = "mean of the per-element updates"
        means = like_state(self.fn, what, tree_lib.unflatten(spec, means), state.mean_grads)
        ssd = like_state(self.fn, what, tree_lib.unflatten(spec, ssd), state.mean_grads)
        spec = tree_lib.structure(state.mean_grads)
        old_m = tree_lib.leaves(state.mean_grads)
        old_s = tree_lib.leaves(state.sum_sq_diff_grads)
        seen = state.micro_step
        step = seen + 1
        done = step == self.steps
        new_m, new_s = [], []
        for bm, bs, m, s in zip(means, ssd, old_m, old_s):
            # n_a = seen·B elements merged with n_b = B: S += S_b + δ²·n_a·n_b/(n_a+n_b)
            delta = bm - m
            factor = seen.to(bm.dtype) * size / step.to(bm.dtype)
            new_m.append((m + delta / step).to(m.dtype))
            new_s.append((s + bs + torch.square(delta) * factor).to(s.dtype))

        def pick(flat_if_done, flat_else):
            return tree_lib.unflatten(spec, [torch.where(done, a, b) for a, b in
                                             zip(flat_if_done, flat_else)])

        zeros = [torch.zeros_like(x) for x in new_m]
        out = (pick(new_m, zeros), {
            "sum_sq_diff_grads": pick(new_s, zeros),
            "sample_size": torch.where(done, step * size, torch.zeros_like(step))})
        new_state = PerElementMeanAndSumSqDiffGradsState(
            micro_step=torch.where(done, torch.zeros_like(step), step), ready=done,
            mean_grads=pick(zeros, new_m), sum_sq_diff_grads=pick(zeros, new_s))
        return out, new_state


def get_per_element_mean_and_sum_sq_diff_grads(per_elt_axis: int | Sequence[int] = 0,
                                               accumulation_steps: int = 1) -> Aggregator:
    """An aggregator giving the mean of per-element updates and, as aux, their sum of
    squared deviations: ``(m, {'sum_sq_diff_grads': S, 'sample_size': n})`` with
    ``m = (1/n) Σ_i u_i`` and ``S = Σ_i (u_i − m)²`` over the ``n`` elements.

    With ``accumulation_steps = k > 1`` the ``n = k·B`` elements of ``k`` microbatches of
    ``B`` are merged one microbatch at a time (Chan et al.): after ``j`` microbatches,
    with ``δ = m_batch − m``,
    ``m ← m + δ / (j+1)``, ``S ← S + S_batch + δ² · j·B / (j+1)``; the k-th call outputs
    them (``ready`` on, the state reset), the others zeros (``sample_size`` 0). Every
    microbatch must have the same ``B``. With ``k = 1`` it is stateless and
    ``sample_size`` is a Python ``int``. Use it through :func:`add_mean_variance_to_opt`.

    Args:
        per_elt_axis: the batch axis, or a sequence of them (default: 0).
        accumulation_steps: the microbatches per output, an int >= 1 (default: 1).
    """
    obj = _Moments(per_elt_axis, accumulation_steps)
    if obj.steps == 1:
        return Aggregator(init_empty_state, obj.update_once)
    return Aggregator(obj.init, obj.update)


@register_state
class PerElementMeanAndVarianceEMAState(NamedTuple):
    """``count``: the updates seen (int32); ``ema_decay``: the decay (0-d float);
    ``mean_grads_ema`` and ``variance_grads_ema``: the EMAs, like the params, biased
    towards their zero start (:func:`get_unbiased_mean_and_variance_ema` corrects it)."""

    count: torch.Tensor
    ema_decay: torch.Tensor
    mean_grads_ema: Any
    variance_grads_ema: Any


def _check_decay(ema_decay: Any) -> Any:
    fn = "track_per_element_mean_and_variance_with_ema"
    value = ema_decay
    if isinstance(ema_decay, torch.Tensor):
        if ema_decay.dim() != 0 or not ema_decay.is_floating_point():
            raise ValueError(f"{fn}: ema_decay must be a number or a 0-d floating tensor, "
                             f"got a tensor of shape {tuple(ema_decay.shape)} and dtype "
                             f"{ema_decay.dtype}")
        value = float(ema_decay)
    elif isinstance(ema_decay, bool) or not isinstance(ema_decay, (int, float)):
        raise TypeError(f"{fn}: ema_decay must be a number, got {type(ema_decay).__name__}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{fn}: ema_decay must be in [0, 1), got {ema_decay!r}")
    return ema_decay


class _TrackEma:
    def __init__(self, ema_decay: Any):
        self.fn = "track_per_element_mean_and_variance_with_ema"
        self.decay = _check_decay(ema_decay)
        register_owner(self)

    def init(self, params: Any) -> PerElementMeanAndVarianceEMAState:
        flat = tree_lib.leaves(params)
        device = tree_lib.state_device(flat)
        dtype = next((x.dtype for x in flat if isinstance(x, torch.Tensor)
                      and x.is_floating_point()), torch.get_default_dtype())
        return PerElementMeanAndVarianceEMAState(
            count=torch.zeros((), dtype=torch.int32, device=device),
            ema_decay=torch.as_tensor(self.decay, dtype=dtype, device=device),
            mean_grads_ema=tree_lib.zeros_like(params),
            variance_grads_ema=tree_lib.zeros_like(params))

    def update(self, updates, state, params=None, *, sum_sq_diff_grads=None,
               sample_size=None, **extra):
        del params, extra
        fn = self.fn
        check_state(fn, state, PerElementMeanAndVarianceEMAState)
        if sum_sq_diff_grads is None or sample_size is None:
            raise TypeError(f"{fn}: update needs the keyword arguments sum_sq_diff_grads "
                            "and sample_size (get_per_element_mean_and_sum_sq_diff_grads "
                            "gives them through process(..., aggregator_has_aux=True))")
        if int(sample_size) < 2:
            raise ValueError(f"{fn}: the variance needs sample_size >= 2 elements, got "
                             f"{int(sample_size)}")
        flat_u = like_state(fn, "update", updates, state.mean_grads_ema)
        flat_s = like_state(fn, "sum_sq_diff_grads", sum_sq_diff_grads,
                            state.mean_grads_ema)
        spec = tree_lib.structure(state.mean_grads_ema)
        d = self.decay
        mean = [((1 - d) * u + d * m).to(m.dtype) for u, m in
                zip(flat_u, tree_lib.leaves(state.mean_grads_ema))]
        var = [((1 - d) * (s / (sample_size - 1)) + d * v).to(v.dtype) for s, v in
               zip(flat_s, tree_lib.leaves(state.variance_grads_ema))]
        return updates, state._replace(
            count=safe_int32_increment(state.count),
            mean_grads_ema=tree_lib.unflatten(spec, mean),
            variance_grads_ema=tree_lib.unflatten(spec, var))


def track_per_element_mean_and_variance_with_ema(ema_decay: float | torch.Tensor = 0.9
                                                 ) -> GradientTransformation:
    """EMAs of the mean and variance of per-element gradients; the updates pass through.

    Its ``update`` takes the keyword arguments ``sum_sq_diff_grads`` (S) and
    ``sample_size`` (n) that :func:`get_per_element_mean_and_sum_sq_diff_grads` gives
    through ``process(..., aggregator_has_aux=True)``, the updates being the mean m:
    ``mean_ema ← (1−d)·m + d·mean_ema``, ``var_ema ← (1−d)·S/(n−1) + d·var_ema``.

    Args:
        ema_decay: the decay ``d``, in [0, 1) (default: 0.9).
    """
    obj = _TrackEma(ema_decay)
    return GradientTransformation(obj.init, obj.update)


def get_unbiased_mean_and_variance_ema(state: Any) -> tuple[Any, Any]:
    """The bias-corrected EMAs of the :class:`PerElementMeanAndVarianceEMAState` within
    ``state``: ``mean_ema / (1 − d^t)`` and ``var_ema / (1 − d^t)``, ``t`` its count
    (NaN before the first update, as ``t = 0``).

    Raises ``ValueError`` if ``state`` holds no such state, or several.
    """
    try:
        found = tree_lib.get(state, "PerElementMeanAndVarianceEMAState", None)
    except KeyError as err:
        raise ValueError(f"get_unbiased_mean_and_variance_ema: {err.args[0]}") from None
    if found is None:
        raise ValueError("get_unbiased_mean_and_variance_ema: the state holds no "
                         "PerElementMeanAndVarianceEMAState (see add_mean_variance_to_opt)")
    correction = 1 - found.ema_decay ** found.count

    def unbias(tree):
        return tree_lib.map(lambda x: (x / correction).to(x.dtype), tree)

    return unbias(found.mean_grads_ema), unbias(found.variance_grads_ema)


def add_mean_variance_to_opt(opt: GradientTransformation,
                             ema_decay: float | torch.Tensor = 0.9,
                             per_elt_axis: int | Sequence[int] = 0,
                             accumulation_steps: int = 1) -> Aggregator:
    """``opt`` stepping on the mean of per-element gradients, with EMAs of their mean and
    variance kept in its state: ``process(pass-through,
    get_per_element_mean_and_sum_sq_diff_grads(per_elt_axis, accumulation_steps),
    chain(track_per_element_mean_and_variance_with_ema(ema_decay), opt),
    aggregator_has_aux=True)``.

    ``opt`` sees ``m = (1/n) Σ_i g_i`` once per ``accumulation_steps`` calls (zeros out
    in between); :func:`get_unbiased_mean_and_variance_ema` reads the EMAs of ``m`` and
    of ``S/(n−1)`` off the state.

    Args:
        opt: the optimizer.
        ema_decay: the decay of the EMAs, in [0, 1) (default: 0.9).
        per_elt_axis: the batch axis, or a sequence of them (default: 0).
        accumulation_steps: the microbatches per step of ``opt``, an int >= 1.
    """
    check_transform(opt, "add_mean_variance_to_opt: opt")
    return process(
        stateless(lambda updates, params: updates),
        get_per_element_mean_and_sum_sq_diff_grads(per_elt_axis, accumulation_steps),
        chain(track_per_element_mean_and_variance_with_ema(ema_decay), opt),
        aggregator_has_aux=True)
