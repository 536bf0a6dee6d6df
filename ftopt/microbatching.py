"""Microbatching (optax's ``optax.microbatching``): run a function over a batch a slice at
a time and combine the results, so a batch whose activations do not fit at once still
gives its gradient.

``microbatch(fun, argnums, microbatch_size, accumulator)`` calls ``fun`` once per
microbatch and combines the outputs (sum, mean, running mean or concatenation, per leaf
of the output if asked); ``micro_vmap`` is ``torch.func.vmap`` done a microbatch at a
time; ``micro_grad`` gives per-example gradients (``torch.func.grad`` under ``vmap``),
transformed (clipped, squared, ...) and combined, with per-example values and metrics.

As optax, the batch axis is split column-major: microbatch ``i`` of ``n`` holds the rows
``i, i + n, i + 2n, ...`` (``reshape_batch_axis``), and concatenated outputs come back in
the batch's order. The loop is a Python loop: each microbatch's activations are freed
before the next is computed.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
from collections import namedtuple
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
import torch.func

__all__ = ["Accumulator", "AccumulationType", "IndividualOutputs", "microbatch",
           "micro_vmap", "micro_grad", "reshape_batch_axis"]

IndividualOutputs = namedtuple("IndividualOutputs", ["values", "metrics", "aux"])


@dataclasses.dataclass(frozen=True)
class Accumulator:
    """How the outputs of the microbatches combine: ``carry = init(first output)``, then
    ``carry = update(carry, output_i, i)`` for each microbatch ``i``, the result
    ``finalize(carry)``; ``aggregate`` reduces a stack of per-example outputs (axis 0) to
    one microbatch's (:func:`micro_vmap`). Each works on one tensor."""

    init: Callable[[torch.Tensor], torch.Tensor]
    update: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    finalize: Callable[[torch.Tensor], torch.Tensor]
    aggregate: Callable[[torch.Tensor], torch.Tensor]


class AccumulationType(enum.Enum):
    """The built-in accumulators (optax's names)."""

    MEAN = enum.auto()  # the mean of the microbatches' outputs
    SUM = enum.auto()  # their sum
    RUNNING_MEAN = enum.auto()  # the mean over the microbatches actually run
    CONCAT = enum.auto()  # concatenated along axis 0, in the batch's order


def _floating(x: torch.Tensor) -> torch.Tensor:
    if not x.is_floating_point():
        raise ValueError("MEAN and RUNNING_MEAN accumulators require floating-point "
                         f"values, got {x.dtype}")
    return torch.zeros_like(x)


def _running_update(carry: torch.Tensor, value: torch.Tensor, index: int) -> torch.Tensor:
    p = index / (index + 1)
    return carry * p + value * (1 - p)


def _concat(n: int) -> Accumulator:
    def init(x):
        return torch.zeros((n, *x.shape), dtype=x.dtype, device=x.device)

    def update(carry, value, index):
        carry = carry.clone()
        carry[index] = value
        return carry

    def finalize(carry):  # (n, m, ...) column-major back to (n·m, ...): the batch's order
        if carry.dim() < 2:  # (one value a microbatch)
            return carry
        return carry.transpose(0, 1).reshape(-1, *carry.shape[2:])

    return Accumulator(init, update, finalize, lambda x: x)


def _builtin(kind: AccumulationType, n: int) -> Accumulator:
    if kind is AccumulationType.SUM:
        return Accumulator(torch.zeros_like, lambda c, v, _: c + v, lambda c: c,
                           lambda x: x.sum(dim=0))
    if kind is AccumulationType.MEAN:
        return Accumulator(_floating, lambda c, v, _: c + v, lambda c: c / n,
                           lambda x: x.mean(dim=0))
    if kind is AccumulationType.RUNNING_MEAN:
        return Accumulator(_floating, _running_update, lambda c: c, lambda x: x.mean(dim=0))
    return _concat(n)


def _per_leaf(accumulator: Any, output: Any, n: int) -> list[Accumulator]:
    """One accumulator per leaf of ``output`` (``accumulator``: one, or a tree of them
    shaped like a prefix of the output)."""
    def is_leaf(x):
        return isinstance(x, (Accumulator, AccumulationType))

    try:
        full = optree.tree_broadcast_prefix(accumulator, output, is_leaf=is_leaf,
                                            namespace="ftopt")
    except (ValueError, TypeError) as err:
        raise ValueError(f"microbatch: the accumulator does not fit the function's output "
                         f"(one Accumulator or AccumulationType, or a tree of them shaped "
                         f"like a prefix of the output): {err}") from None
    out = []
    for acc in optree.tree_leaves(full, is_leaf=is_leaf, namespace="ftopt"):
        if isinstance(acc, AccumulationType):
            acc = _builtin(acc, n)
        if not isinstance(acc, Accumulator):
            raise TypeError(f"microbatch: unknown accumulator {acc!r}")
        out.append(acc)
    return out


def reshape_batch_axis(tree: Any, microbatch_size: int, axis: int = 0) -> Any:
    """Each leaf's batch axis ``axis`` (size B) as two, ``(B // microbatch_size,
    microbatch_size)``, column-major: row ``b`` goes to ``(b % n, b // n)``."""
    def leaf(x):
        shape = x.shape[:axis] + (microbatch_size, -1) + x.shape[axis + 1:]
        return x.reshape(shape).transpose(axis, axis + 1)
    return optree.tree_map(leaf, tree, namespace="ftopt")


def _resolve(sig, argnums, argnames, in_axes):
    """Names of positional parameters become positions (optax's ``_resolve_batch_args``)."""
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = list(sig.parameters) if sig is not None else []
    nums, kws = list(argnums), []
    num_axes, kw_axes = list(in_axes[:len(argnums)]), []
    for i, name in enumerate(argnames):
        axis = in_axes[len(argnums) + i]
        param = sig.parameters.get(name) if sig is not None else None
        if param is not None and param.kind in positional:
            nums.append(names.index(name))
            num_axes.append(axis)
        else:
            kws.append(name)
            kw_axes.append(axis)
    return tuple(nums), tuple(kws), tuple(num_axes + kw_axes)


def _signature(fun: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fun)
    except (TypeError, ValueError):
        return None


def _normalize(sig, args, kwargs):
    if sig is None:
        return tuple(args), dict(kwargs)
    bound = sig.bind(*args, **kwargs)
    return bound.args, bound.kwargs


def microbatch(fun: Callable, argnums: int | Sequence[int], microbatch_size: int | None,
               accumulator: Any = AccumulationType.SUM, *,
               argnames: str | Sequence[str] = (), in_axes: int | Sequence[int] = 0,
               num_real_microbatches: int | None = None) -> Callable:
    """``fun`` evaluated one microbatch at a time, its outputs combined (optax's).

    Args:
        fun: any function of tensors (trees of them).
        argnums: the positions of the arguments with a batch axis.
        microbatch_size: the rows of each microbatch; it must divide the batch. ``None``
            returns ``fun`` itself.
        accumulator: an :class:`AccumulationType` or :class:`Accumulator`, or a tree of
            them shaped like a prefix of ``fun``'s output (default: SUM).
        argnames: the names of keyword arguments with a batch axis.
        in_axes: the batch axis of each of ``argnums + argnames`` (default: 0).
        num_real_microbatches: run only the first this many microbatches (MEAN still
            divides by all of them, RUNNING_MEAN by those run; CONCAT leaves zeros).
    """
    if microbatch_size is None:
        return fun
    if not isinstance(microbatch_size, int) or isinstance(microbatch_size, bool) or \
            microbatch_size < 1:
        raise ValueError(f"microbatch: microbatch_size must be an int >= 1 or None, got "
                         f"{microbatch_size!r}")
    sig = _signature(fun)
    argnums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    argnames = (argnames,) if isinstance(argnames, str) else tuple(argnames)
    if isinstance(in_axes, int):
        in_axes = (in_axes,) * (len(argnums) + len(argnames))
    argnums, argnames, in_axes = _resolve(sig, argnums, argnames, tuple(in_axes))

    def microbatched(*args, **kwargs):
        args, kwargs = _normalize(sig, args, kwargs)
        args = list(args)
        batched = [(args, i, ax) for i, ax in zip(argnums, in_axes)] + \
                  [(kwargs, k, ax) for k, ax in zip(argnames, in_axes[len(argnums):])]
        sizes = {int(x.shape[ax]) for holder, key, ax in batched
                 for x in optree.tree_leaves(holder[key], namespace="ftopt")}
        if len(sizes) != 1:
            raise ValueError(f"microbatch: the batch arguments must have one batch size, "
                             f"found {sorted(sizes)}")
        (size,) = sizes
        if size % microbatch_size or size == 0:
            raise ValueError(f"microbatch: the batch size {size} must be a positive "
                             f"multiple of microbatch_size={microbatch_size}")
        n = size // microbatch_size
        reshaped = [reshape_batch_axis(holder[key], microbatch_size, ax)
                    for holder, key, ax in batched]
        steps = n if num_real_microbatches is None else int(num_real_microbatches)
        if not 1 <= steps <= n:
            raise ValueError(f"microbatch: num_real_microbatches must be in [1, {n}], got "
                             f"{num_real_microbatches!r}")
        leaves = accs = spec = None
        for index in range(steps):
            call_args, call_kwargs = list(args), dict(kwargs)
            for (holder, key, ax), tree in zip(batched, reshaped):
                part = optree.tree_map(lambda x, ax=ax, i=index: x.select(ax, i), tree,
                                       namespace="ftopt")
                (call_args if holder is args else call_kwargs)[key] = part
            output = fun(*call_args, **call_kwargs)
            if accs is None:
                accs = _per_leaf(accumulator, output, n)
                values, spec = optree.tree_flatten(output, namespace="ftopt")
                leaves = [a.init(v) for a, v in zip(accs, values)]
            values = spec.flatten_up_to(output)
            leaves = [a.update(c, v, index) for a, c, v in zip(accs, leaves, values)]
        return optree.tree_unflatten(spec, [a.finalize(c) for a, c in zip(accs, leaves)])

    return microbatched


def micro_vmap(fun: Callable, in_axes: int | Sequence[int | None] = 0, out_axes: int = 0, *,
               microbatch_size: int | None = None, vmap_fn: Callable = torch.func.vmap,
               accumulator: Any = AccumulationType.CONCAT,
               num_real_microbatches: int | None = None) -> Callable:
    """``torch.func.vmap(fun, in_axes)`` a microbatch at a time (optax's). Arguments
    passed by keyword are mapped along their axis 0 too; the outputs are concatenated
    (default, as vmap) or reduced over the batch (``accumulator``, per output leaf if a
    tree). ``out_axes`` must be 0."""
    if out_axes != 0:
        raise NotImplementedError("micro_vmap: out_axes other than 0 is not supported")
    in_axes = (in_axes,) if isinstance(in_axes, int) else tuple(in_axes)

    def vmap_reduce(*args, kwargs):
        dims = tuple(in_axes) + (None,) * (len(args) - len(in_axes))
        found: dict = {}

        def call(*a):  # (the keyword arguments, mapped, come last; vmap returns no None)
            out = fun(*a[:-1], **a[-1])
            leaves, found["spec"] = optree.tree_flatten(out, none_is_leaf=True,
                                                        namespace="ftopt")
            found["none"] = [x is None for x in leaves]
            return tuple(x for x in leaves if x is not None)

        tensors = iter(vmap_fn(call, in_dims=(*dims, 0))(*args, kwargs))
        output = optree.tree_unflatten(found["spec"], [
            None if none else next(tensors) for none in found["none"]])
        values, spec = optree.tree_flatten(output, namespace="ftopt")
        size = next((int(v.shape[0]) for v in values), 0)
        accs = _per_leaf(accumulator, output, size)
        return optree.tree_unflatten(spec, [a.aggregate(v) for a, v in zip(accs, values)])

    mapped = tuple(i for i, ax in enumerate(in_axes) if ax is not None)
    batched = microbatch(vmap_reduce, argnums=mapped, microbatch_size=microbatch_size,
                         accumulator=accumulator, argnames="kwargs",
                         in_axes=tuple(ax for ax in in_axes if ax is not None) + (0,),
                         num_real_microbatches=num_real_microbatches)
    def wrapped(*args, **kwargs):  # (arguments passed by keyword are mapped)
        return batched(*args, kwargs=kwargs)

    return wrapped


def micro_grad(fun: Callable, has_aux: bool = False, argnums: int | Sequence[int] = 0, *,
               batch_argnums: int | Sequence[int] = 1, keep_batch_dim: bool = True,
               microbatch_size: int | None = None, accumulator: Any = AccumulationType.SUM,
               transform_fn: Callable[[Any], Any] = lambda g: g,
               metrics_fn: Callable[[Any], Any] = lambda g: None,
               num_real_microbatches: int | None = None) -> Callable:
    """Per-example gradients of ``fun``, transformed and combined (optax's).

    Each example of the batch arguments (``batch_argnums``, axis 0) gets
    ``g = grad(fun, argnums)``; the result is ``accumulator`` over the examples of
    ``transform_fn(g)`` (default: the sum of the gradients), computed
    ``microbatch_size`` examples at a time. Returns ``(result, IndividualOutputs(values,
    metrics, aux))``, each of those per example: ``fun``'s value, ``metrics_fn(g)`` and
    ``fun``'s aux (``has_aux``). With ``keep_batch_dim`` (default) ``fun`` sees each
    example as a batch of one.
    """
    batch_argnums = (batch_argnums,) if isinstance(batch_argnums, int) else \
        tuple(batch_argnums)
    sig = _signature(fun)

    def grad_fn(*args, **kwargs):
        def value(*a):
            out = fun(*a, **kwargs)
            return (out[0], out) if has_aux else (out, (out,))

        grad, kept = torch.func.grad(value, argnums, has_aux=True)(*args)
        return transform_fn(grad), IndividualOutputs(
            kept[0], metrics_fn(grad), kept[1] if has_aux else None)

    axes = [None] * (max(batch_argnums) + 1)
    for i in batch_argnums:
        axes[i] = 0
    run = micro_vmap(grad_fn, in_axes=axes, microbatch_size=microbatch_size,
                     accumulator=(accumulator, AccumulationType.CONCAT),
                     num_real_microbatches=num_real_microbatches)

    def final(*args, **kwargs):
        args, kwargs = _normalize(sig, args, kwargs)
        if keep_batch_dim:
            args = list(args)
            for i in batch_argnums:
                args[i] = optree.tree_map(lambda x: x.unsqueeze(1), args[i],
                                          namespace="ftopt")
        return run(*args, **kwargs)

    return final
