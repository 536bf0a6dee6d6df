"""optax's numerical helpers (``optax.safe_norm`` and its kin) and its small transform
utilities (``stateless_with_tree_map``, ``with_extra_args_support``, ``init_empty_state``,
``scale_gradient``), in torch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ftopt import tree as tree_lib
from ftopt.base import EmptyState, GradientTransformation, check_transform, stateless

__all__ = ["abs_sq", "safe_norm", "safe_root_mean_squares", "safe_increment",
           "safe_int32_increment", "stateless_with_tree_map", "with_extra_args_support",
           "init_empty_state", "scale_gradient"]


def _tensor(where: str, x: Any) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where}: expected a tensor, got {type(x).__name__}")
    return x


def abs_sq(x: torch.Tensor) -> torch.Tensor:
    """|x|² of a real or complex tensor (``(conj(x)·x).real``; ``x·x`` for real ``x``)."""
    x = _tensor("abs_sq", x)
    return (x.conj() * x).real if x.is_complex() else x * x


def safe_norm(x: torch.Tensor, min_norm: float | torch.Tensor, ord: Any = None,
              axis: int | tuple[int, ...] | None = None, keepdims: bool = False
              ) -> torch.Tensor:
    """max(‖x‖, min_norm) whose gradient is 0 (not NaN) where ‖x‖ <= min_norm (optax's):
    the norm of ``torch.linalg.norm(x, ord, axis)`` (a vector norm of a 1-D ``x`` or over
    one axis, a matrix norm of a 2-D one or over two axes, the 2-norm of all elements
    when ``ord`` and ``axis`` are both ``None``)."""
    x = _tensor("safe_norm", x)

    def norm(t, keep):
        if ord is None and axis is None:
            out = torch.linalg.vector_norm(t)
            return out.reshape([1] * t.ndim) if keep else out
        return torch.linalg.norm(t, ord=ord, dim=axis, keepdim=keep)

    small = norm(x, True) <= min_norm
    masked = norm(torch.where(small, torch.ones_like(x), x), keepdims)
    if not keepdims:
        small = small.reshape(masked.shape)
    return torch.where(small, torch.as_tensor(min_norm, dtype=masked.dtype,
                                              device=masked.device), masked)


def safe_root_mean_squares(x: torch.Tensor, min_rms: float | torch.Tensor) -> torch.Tensor:
    """max(√mean(|x|²), min_rms) whose gradient is 0 (not NaN) where the RMS is below
    ``min_rms`` (optax's)."""
    x = _tensor("safe_root_mean_squares", x)
    small = abs_sq(x).mean().sqrt() <= min_rms
    rms = abs_sq(torch.where(small, torch.ones_like(x), x)).mean().sqrt()
    return torch.where(small, torch.as_tensor(min_rms, dtype=rms.dtype, device=rms.device),
                       rms)


def safe_increment(count: torch.Tensor) -> torch.Tensor:
    """count + 1, or count where it is its dtype's largest value (no wrap to the smallest:
    optax's). Integer and floating counts; a new tensor, on the device, with no host
    read."""
    count = _tensor("safe_increment", count)
    if count.dtype == torch.bool or count.is_complex():
        raise ValueError(f"safe_increment: cannot increment a count of dtype {count.dtype}; "
                         "expected an integer or floating dtype")
    info = torch.finfo if count.is_floating_point() else torch.iinfo
    top = info(count.dtype).max
    return torch.where(count < top, count + 1, torch.full_like(count, top))


safe_int32_increment = safe_increment


def stateless_with_tree_map(fn: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
                            ) -> GradientTransformation:
    """A stateless transform applying ``fn(update, param)`` to every leaf (``param`` is
    ``None`` where ``update`` is called without params), as optax's. Runs eagerly."""
    if not callable(fn):
        raise TypeError(f"stateless_with_tree_map: expected a function, got "
                        f"{type(fn).__name__}")

    def per_leaf(updates, params):
        if params is None:
            return tree_lib.map(lambda u: fn(u, None), updates)
        paths, flat_p, spec = tree_lib.flatten_with_paths(params)
        flat_u = tree_lib.flatten_like(spec, updates, "updates", paths)
        return tree_lib.unflatten(spec, [None if u is None else fn(u, p)
                                         for u, p in zip(flat_u, flat_p)])
    return stateless(per_leaf)


def with_extra_args_support(tx: GradientTransformation) -> GradientTransformation:
    """``tx`` itself: every ftopt transform's ``update`` accepts extra keyword arguments
    (and ignores those it does not use), as optax's ``GradientTransformationExtraArgs``."""
    check_transform(tx, "with_extra_args_support")
    return tx


def init_empty_state(params: Any) -> EmptyState:
    """The state of a stateless transform (optax's ``init_empty_state``)."""
    del params
    return EmptyState()


def scale_gradient(inputs: Any, scale: float | torch.Tensor) -> Any:
    """Every tensor of ``inputs`` as it is in the forward pass, with its gradient scaled
    by ``scale`` in the backward pass (optax's ``scale_gradient``): x.detach() + scale·(x −
    x.detach()), which autograd and ``torch.func`` differentiate alike. (A ``-0.0``
    comes out as ``+0.0``.)"""
    def one(x):
        if not isinstance(x, torch.Tensor):
            return x
        frozen = x.detach()
        return frozen + scale * (x - frozen)
    return tree_lib.map(one, inputs)


def keep_nan_bits(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``new`` (a 16-bit step of ``old``), with the bits of ``old`` where both are NaN:
    torch's conversions through fp32 do not keep a NaN's bits (CPU: fp16 0xFE00 ->
    0x7FFF, bf16 0xFFC1 -> 0xFFFF), and a skipped element keeps its bytes (SPEC §3), a
    NaN's too: the params of ``apply_updates`` and 16-bit states."""
    return torch.where(torch.isnan(old) & torch.isnan(new), old, new)
