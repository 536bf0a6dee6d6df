"""Aggregators of per-element updates and gradient accumulation: the part of optax's
``optax.experimental.aggregating`` that the mean and variance tracking of
:mod:`ftopt.experimental.aggregating` builds on (that module re-exports all of it).

An :class:`Aggregator` is a ``GradientTransformation`` whose ``update`` takes a tree of
per-element updates, each leaf with one or more batch axes in front of the parameter's
shape (``torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))``), and returns
updates shaped like the params. :func:`process` runs a preprocessor on the per-element
updates, an aggregator, then an ordinary optimizer on the aggregate, which it skips
(giving zeros) while an accumulating aggregator's ``ready`` flag is off.

States keep one structure from ``init`` on: counts are int32 tensors, ``ready`` a bool
tensor, and the accumulators are reset by ``torch.where`` (no host read).
:func:`process` reads ``ready`` on the host to branch (optax's ``lax.cond``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from ftopt import tree as tree_lib
from ftopt.base import (
    GradientTransformation,
    TransformInitFn,
    check_transform,
    register_owner,
    register_state,
)
from ftopt.combine import chain
from ftopt.numerics import init_empty_state
from ftopt.transforms.scaling import identity

__all__ = [
    "PerElementUpdates", "AggregatedUpdates", "MaybeAxis", "AggregatorUpdateFn",
    "Aggregator", "process", "average_per_element_updates", "AccumulateAvgUpdatesState",
    "accumulate_avg_updates", "average_incrementally_updates",
    "get_batch_size_from_per_elt_updates",
]

PerElementUpdates = Any  # a tree of tensors, each with batch axes before the param's shape
AggregatedUpdates = Any  # a tree of tensors shaped like the params
MaybeAxis = int | Sequence[int] | None


class AggregatorUpdateFn(Protocol):
    """``update(per_elt_updates, state, params=None, **extra) -> (aggregated, state)``."""

    def __call__(self, per_elt_updates: PerElementUpdates, state: Any,
                 params: Any = None, **extra_args: Any) -> tuple[AggregatedUpdates, Any]: ...


class Aggregator(GradientTransformation):
    """A ``GradientTransformation`` whose ``update`` maps per-element updates (leaves of
    shape ``(*batch_shape, *param_shape)``) to one update per param (``param_shape``).

    Its fields and signatures are a ``GradientTransformation``'s (it is one: it chains,
    and ``check_transform`` accepts it); the class tells the caller to feed it
    per-example gradients, ``vmap(grad(loss))``, instead of the batch gradient.
    """

    __slots__ = ()
    init: TransformInitFn
    update: AggregatorUpdateFn


# ------------------------------------------------------------------ argument checks


def check_steps(fn: str, accumulation_steps: Any) -> int:
    """``accumulation_steps`` as an int >= 1, else ``ValueError`` naming ``fn``."""
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) \
            or accumulation_steps < 1:
        raise ValueError(f"{fn}: accumulation_steps must be an int >= 1, got "
                         f"{accumulation_steps!r}")
    return accumulation_steps


def check_axis(fn: str, per_elt_axis: Any) -> int | tuple[int, ...]:
    """``per_elt_axis`` (an int or a non-empty sequence of distinct ints), else
    ``TypeError``/``ValueError`` naming ``fn``."""
    if isinstance(per_elt_axis, int) and not isinstance(per_elt_axis, bool):
        return per_elt_axis
    if isinstance(per_elt_axis, Sequence) and not isinstance(per_elt_axis, str):
        axes = tuple(per_elt_axis)
        if axes and all(isinstance(a, int) and not isinstance(a, bool) for a in axes):
            return axes
        if not axes:
            raise ValueError(f"{fn}: per_elt_axis must name at least one axis, got "
                             f"{per_elt_axis!r}")
    raise TypeError(f"{fn}: per_elt_axis must be an int or a sequence of ints, got "
                    f"{per_elt_axis!r}")


def check_state(fn: str, state: Any, cls: type) -> None:
    """``TypeError`` naming ``fn`` unless ``state`` is an instance of ``cls``."""
    if not isinstance(state, cls):
        raise TypeError(f"{fn}: expected the state to be of type {cls.__name__}, got "
                        f"{type(state).__name__}")


def _leaf_axes(fn: str, path: str, x: Any, per_elt_axis: int | Sequence[int]
               ) -> tuple[int, ...]:
    """The batch axes of leaf ``x`` as non-negative ints, checked against its rank."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: per-element update at {path}: expected a tensor, got "
                        f"{type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{fn}: per-element update at {path}: expected a floating-point "
                        f"tensor, got {x.dtype}")
    axes = (per_elt_axis,) if isinstance(per_elt_axis, int) else tuple(per_elt_axis)
    if any(not -x.dim() <= a < x.dim() for a in axes):
        raise ValueError(f"{fn}: per-element update at {path} of shape {tuple(x.shape)} "
                         f"has no axis {per_elt_axis!r} (per_elt_axis)")
    out = tuple(a % x.dim() for a in axes)
    if len(set(out)) != len(out):
        raise ValueError(f"{fn}: per_elt_axis {per_elt_axis!r} names an axis twice for the "
                         f"update at {path} of shape {tuple(x.shape)}")
    return out


def batch_axes(fn: str, per_elt_updates: Any, per_elt_axis: int | Sequence[int]
               ) -> tuple[list, list[tuple[int, ...]], Any, int]:
    """(leaves, each leaf's batch axes, structure, batch size) of per-element updates
    whose leaves agree on the batch size (the product of the sizes of the batch axes)."""
    paths, flat, spec = tree_lib.flatten_with_paths(per_elt_updates)
    if not flat:
        raise ValueError(f"{fn}: the per-element updates hold no tensor")
    axes = [_leaf_axes(fn, p, x, per_elt_axis) for p, x in zip(paths, flat)]
    sizes = [math.prod(x.shape[a] for a in ax) for x, ax in zip(flat, axes)]
    for path, size in zip(paths, sizes):
        if size != sizes[0]:
            raise ValueError(
                f"{fn}: per-element updates must have the same batch size along "
                f"per_elt_axis={per_elt_axis!r}: {sizes[0]} at {paths[0]} but {size} at "
                f"{path}")
    return flat, axes, spec, sizes[0]


def like_state(fn: str, what: str, tree: Any, ref: Any) -> list[torch.Tensor]:
    """The leaves of ``tree``, checked to be floating tensors of the shapes of ``ref``'s
    (a state slot shaped like the params)."""
    paths, ref_flat, spec = tree_lib.flatten_with_paths(ref)
    flat = tree_lib.flatten_like(spec, tree, f"{fn}: {what}", paths, against="state")
    for path, x, r in zip(paths, flat, ref_flat):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"{fn}: {what} at {path}: expected a floating-point tensor, "
                            f"got {got}")
        if x.shape != r.shape:
            raise ValueError(f"{fn}: {what} at {path}: shape {tuple(x.shape)} does not "
                             f"match the params' shape {tuple(r.shape)}")
    return flat


# ------------------------------------------------------------------ batch size


def get_batch_size_from_per_elt_updates(per_elt_updates: Any,
                                        per_elt_axis: int | Sequence[int]) -> int:
    """The batch size of per-element updates: ``B = ∏_{a ∈ per_elt_axis} shape[a]``,
    the same for every leaf.

    Args:
        per_elt_updates: a tree of tensors with batch axes.
        per_elt_axis: the batch axis, or a sequence of them.

    Raises ``ValueError`` naming two paths whose leaves disagree on ``B``, or a leaf that
    lacks an axis of ``per_elt_axis``.
    """
    fn = "get_batch_size_from_per_elt_updates"
    return batch_axes(fn, per_elt_updates, check_axis(fn, per_elt_axis))[3]


# ------------------------------------------------------------------ process


class _Process:
    """The transform behind :func:`process`."""

    def __init__(self, pre: GradientTransformation, agg: GradientTransformation,
                 post: GradientTransformation, has_aux: bool):
        check_transform(pre, "process: preprocessor")
        check_transform(agg, "process: aggregator")
        check_transform(post, "process: postprocessor")
        if not isinstance(has_aux, bool):
            raise TypeError(f"process: aggregator_has_aux must be a bool, got {has_aux!r}")
        self.pre, self.agg, self.post, self.has_aux = pre, agg, post, has_aux
        register_owner(self)

    def init(self, params: Any) -> tuple:
        return self.pre.init(params), self.agg.init(params), self.post.init(params)

    def update(self, updates, state, params=None, **extra):
        if not isinstance(state, tuple) or len(state) != 3:
            raise ValueError("process: expected the state (preprocessor, aggregator, "
                             f"postprocessor) of 3 entries, got {type(state).__name__}")
        pre_state, agg_state, post_state = state
        updates, pre_state = self.pre.update(updates, pre_state, params, **extra)
        aggregated, agg_state = self.agg.update(updates, agg_state, params, **extra)
        if self.has_aux:
            if not (isinstance(aggregated, tuple) and len(aggregated) == 2
                    and isinstance(aggregated[1], Mapping)):
                raise TypeError("process: with aggregator_has_aux=True the aggregator must "
                                "return ((updates, aux dict), state), got "
                                f"{type(aggregated).__name__}")
            aggregated, aux = aggregated
            extra = {**extra, **aux}
        ready = tree_lib.get(agg_state, "ready", True)
        if bool(ready):
            out, post_state = self.post.update(aggregated, post_state, params, **extra)
        else:
            out = tree_lib.zeros_like(aggregated)
        return out, (pre_state, agg_state, post_state)


def process(preprocessor: GradientTransformation,
            aggregator: GradientTransformation | Aggregator,
            postprocessor: GradientTransformation,
            aggregator_has_aux: bool = False) -> GradientTransformation | Aggregator:
    """Per-element updates through a preprocessor, an aggregator and a postprocessor.

    With per-element gradients ``g`` (or plain gradients, for an aggregator that is an
    ordinary transform such as :func:`accumulate_avg_updates`)::

        u = preprocessor(g)              # per element, e.g. clipping each example
        a[, aux] = aggregator(u)         # e.g. the mean over the batch axis
        out = postprocessor(a, **aux)    # if the aggregator's state is ready,
        out = 0 (postprocessor state kept)   otherwise

    ``ready`` is the aggregator state's ``ready`` field (``True`` if it has none); the
    state is ``(preprocessor, aggregator, postprocessor)`` states. Extra keyword
    arguments of ``update`` go to all three, and with ``aggregator_has_aux`` the dict the
    aggregator returns beside its updates, ``((a, aux), state)``, is added to those the
    postprocessor gets. ftopt's elementwise transforms check the updates' shapes against
    the params, so a preprocessor of per-element updates called with params is a
    function of them (``ftopt.stateless``), not, say, ``ftopt.identity()``.

    Args:
        preprocessor: maps per-element gradients to per-element updates.
        aggregator: reduces them to one update per param.
        postprocessor: maps the aggregate to the final updates (an optimizer).
        aggregator_has_aux: whether the aggregator also returns an aux dict.

    Returns:
        An :class:`Aggregator` if ``aggregator`` is one, else a ``GradientTransformation``.
    """
    obj = _Process(preprocessor, aggregator, postprocessor, aggregator_has_aux)
    kind = Aggregator if isinstance(aggregator, Aggregator) else GradientTransformation
    return kind(obj.init, obj.update)


# ------------------------------------------------------------------ averaging


class _Average:
    def __init__(self, per_elt_axis: int | Sequence[int]):
        self.axis = check_axis("average_per_element_updates", per_elt_axis)
        register_owner(self)

    def update(self, updates, state, params=None, **extra):
        del params, extra
        flat, axes, spec, size = batch_axes("average_per_element_updates", updates,
                                            self.axis)
        if size == 0:
            raise ValueError("average_per_element_updates: the batch is empty (batch "
                             "size 0), its mean is undefined")
        return tree_lib.unflatten(spec, [x.mean(dim=a) for x, a in zip(flat, axes)]), state


def average_per_element_updates(per_elt_axis: int | Sequence[int] = 0) -> Aggregator:
    """The mean of per-element updates over their batch axes:
    ``a = (1/B) Σ_b u_b`` (stateless).

    Args:
        per_elt_axis: the batch axis, or a sequence of them (default: 0).
    """
    obj = _Average(per_elt_axis)
    return Aggregator(init_empty_state, obj.update)


@register_state
class AccumulateAvgUpdatesState(NamedTuple):
    """``micro_step``: microbatches accumulated since the last output (int32);
    ``ready``: whether the last update output the average (bool); ``avg_grad``: the
    running average, shaped like the params."""

    micro_step: torch.Tensor
    ready: torch.Tensor
    avg_grad: Any


class _Accumulate:
    def __init__(self, steps: int):
        self.steps = steps
        register_owner(self)

    def init(self, params: Any) -> AccumulateAvgUpdatesState:
        device = tree_lib.state_device(tree_lib.leaves(params))
        return AccumulateAvgUpdatesState(
            micro_step=torch.zeros((), dtype=torch.int32, device=device),
            ready=torch.zeros((), dtype=torch.bool, device=device),
            avg_grad=tree_lib.zeros_like(params))

    def update(self, updates, state, params=None, **extra):
        del params, extra
        fn = "accumulate_avg_updates"
        check_state(fn, state, AccumulateAvgUpdatesState)
        flat = like_state(fn, "update", updates, state.avg_grad)
        spec = tree_lib.structure(state.avg_grad)
        avg_flat = tree_lib.leaves(state.avg_grad)
        step = state.micro_step + 1
        done = step == self.steps
        new = [(a + (u - a) / step).to(a.dtype) for u, a in zip(flat, avg_flat)]
        out = [torch.where(done, m, torch.zeros_like(m)) for m in new]
        kept = [torch.where(done, torch.zeros_like(m), m) for m in new]
        new_state = AccumulateAvgUpdatesState(
            micro_step=torch.where(done, torch.zeros_like(step), step), ready=done,
            avg_grad=tree_lib.unflatten(spec, kept))
        return tree_lib.unflatten(spec, out), new_state


def accumulate_avg_updates(accumulation_steps: int) -> GradientTransformation:
    """The average of the updates of ``accumulation_steps`` (k) microbatches, output
    once every k calls: with ``n`` the microbatches seen so far,
    ``avg_n = avg_{n-1} + (u_n − avg_{n-1}) / n``; at ``n = k`` the output is ``avg_k``
    (``ready`` on, the state reset to zeros), before it zeros (``ready`` off).

    Used as the aggregator of :func:`process`, the optimizer after it steps once per k
    microbatches, as on their concatenated batch. ``accumulation_steps=1`` gives
    ``ftopt.identity()`` (nothing to accumulate).

    Args:
        accumulation_steps: the microbatches per output, an int >= 1.
    """
    steps = check_steps("accumulate_avg_updates", accumulation_steps)
    if steps == 1:
        return identity()
    obj = _Accumulate(steps)
    return GradientTransformation(obj.init, obj.update)


def average_incrementally_updates(per_elt_axis: MaybeAxis, accumulation_steps: int
                                  ) -> Aggregator | GradientTransformation:
    """The mean over the batch axes, accumulated over microbatches: with
    ``per_elt_axis=None`` it is :func:`accumulate_avg_updates` (on updates already
    averaged), else the :class:`Aggregator` ``chain(average_per_element_updates(axis),
    accumulate_avg_updates(k))``, ``out = (1/k) Σ_i (1/B) Σ_b u_{i,b}`` every k-th call.

    Args:
        per_elt_axis: the batch axis (or axes), or ``None`` for no averaging.
        accumulation_steps: the microbatches per output, an int >= 1.
    """
    if per_elt_axis is None:
        return accumulate_avg_updates(accumulation_steps)
    both = chain(average_per_element_updates(per_elt_axis),
                 accumulate_avg_updates(accumulation_steps))
    return Aggregator(both.init, both.update)
