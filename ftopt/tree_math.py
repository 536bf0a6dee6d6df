"""optax's ``optax.tree`` arithmetic over pytrees of torch tensors (re-exported by
:mod:`ftopt.tree`): ``add``, ``sub``, ``mul``, ``div``, ``scale``, ``add_scale``,
``where``, ``clip``, ``conj``, ``real``, ``batch_shape``, ``ones_like``, ``full_like``
and the moment updates ``update_moment``, ``update_infinity_moment``,
``update_moment_per_elem_norm``, ``bias_correction``.

Trees follow ftopt's conventions (optree, ``none_is_leaf=False``, namespace
``"ftopt"``): ``None`` is an empty subtree, except in the first tree of ``add_scale`` and
the moment updates, where, as in optax, a ``None`` leaf gives a ``None`` result. Two
trees of different structures raise ``ValueError`` naming the argument and the first
differing path. Leaves may be tensors or Python numbers (as optax takes arrays or
scalars); the element-wise operations follow torch's type promotion, in which a Python
number does not widen a tensor (as JAX's weak types). ``zeros_like`` is
:func:`ftopt.tree.zeros_like` (tensor leaves, optional ``dtype``: optax's
``tree_zeros_like``). The reductions are in :mod:`ftopt.tree_reduce`.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch

from ftopt.tree_paths import checked_map

PyTree = Any
Scalar = float | int | torch.Tensor

__all__ = [
    "add", "add_scale", "batch_shape", "bias_correction", "clip", "conj", "div",
    "full_like", "mul", "ones_like", "real", "scale", "sub", "update_infinity_moment",
    "update_moment", "update_moment_per_elem_norm", "where",
]


def _tensor(x: Any) -> torch.Tensor:
    """``x`` as a tensor (a Python number becomes a 0-d CPU tensor of torch's default
    dtype for its kind)."""
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def add(tree_x: PyTree, tree_y: PyTree, *other_trees: PyTree) -> PyTree:
    """Leaf-wise sum ``x + y (+ others...)`` of two or more trees of one structure."""
    named = [("tree_x", tree_x), ("tree_y", tree_y)]
    named += [(f"other_trees[{i}]", t) for i, t in enumerate(other_trees)]
    return checked_map(lambda *xs: functools.reduce(operator.add, xs), named)


def sub(tree_x: PyTree, tree_y: PyTree) -> PyTree:
    """Leaf-wise difference ``x - y``."""
    return checked_map(operator.sub, [("tree_x", tree_x), ("tree_y", tree_y)])


def mul(tree_x: PyTree, tree_y: PyTree) -> PyTree:
    """Leaf-wise product ``x * y``."""
    return checked_map(operator.mul, [("tree_x", tree_x), ("tree_y", tree_y)])


def div(tree_x: PyTree, tree_y: PyTree) -> PyTree:
    """Leaf-wise true division ``x / y``."""
    return checked_map(operator.truediv, [("tree_x", tree_x), ("tree_y", tree_y)])


def scale(scalar: Scalar, tree: PyTree) -> PyTree:
    """``scalar * x`` for every leaf ``x``."""
    return checked_map(lambda x: scalar * x, [("tree", tree)])


def add_scale(tree_x: PyTree, scalar: Scalar, tree_y: PyTree) -> PyTree:
    """``x + scalar * y`` leaf-wise; a ``None`` leaf of ``tree_x`` stays ``None``.

    optax turns ``scalar`` into an array first (a float32 one for a Python float); here a
    Python number stays a number, so it never widens nor narrows the leaves' dtype, and
    Python-number leaves give a Python number.
    """
    return checked_map(lambda x, y: None if x is None else x + scalar * y,
                       [("tree_x", tree_x), ("tree_y", tree_y)], none_is_leaf=True)


def where(condition: bool | torch.Tensor, tree_x: PyTree, tree_y: PyTree) -> PyTree:
    """``torch.where(condition, x, y)`` leaf-wise: ``tree_x``'s values where the
    (broadcast) ``condition`` holds, ``tree_y``'s elsewhere. A Python ``bool`` condition
    becomes a tensor on each leaf's device."""

    def pick(x: Any, y: Any) -> torch.Tensor:
        device = next((t.device for t in (x, y) if isinstance(t, torch.Tensor)), None)
        cond = condition if isinstance(condition, torch.Tensor) else torch.as_tensor(
            condition, device=device)
        if not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor):
            x = _tensor(x)
        return torch.where(cond, x, y)

    return checked_map(pick, [("tree_x", tree_x), ("tree_y", tree_y)])


def clip(tree: PyTree, min_value: Scalar | None = None,
         max_value: Scalar | None = None) -> PyTree:
    """Every leaf clipped to ``[min_value, max_value]`` (``torch.clamp``); a bound that is
    ``None`` is not applied, and with both ``None`` the leaves are returned as they are."""
    if min_value is None and max_value is None:
        return checked_map(lambda x: x, [("tree", tree)])
    return checked_map(lambda x: torch.clamp(_tensor(x), min_value, max_value),
                       [("tree", tree)])


def conj(tree: PyTree) -> PyTree:
    """The complex conjugate of every leaf (materialised, not torch's lazy conjugate
    view); real leaves are returned as they are."""
    return checked_map(lambda x: _tensor(x).conj().resolve_conj(), [("tree", tree)])


def real(tree: PyTree) -> PyTree:
    """The real part of every leaf (a copy for complex leaves; real leaves are returned
    as they are)."""
    def part(x: Any) -> torch.Tensor:
        x = _tensor(x)
        return x.real.clone() if x.is_complex() else x

    return checked_map(part, [("tree", tree)])


def batch_shape(tree: PyTree, shape: tuple[int, ...] = ()) -> PyTree:
    """Every leaf broadcast to ``(*shape, *leaf.shape)``: leading batch dimensions.

    As ``jnp.broadcast_to`` it copies nothing: the result is an expanded view of the
    leaf (read it, or ``.clone()`` it before writing in place).
    """
    return checked_map(lambda x: torch.broadcast_to(_tensor(x), (*shape, *_tensor(x).shape)),
                       [("tree", tree)])


def ones_like(tree: PyTree, dtype: torch.dtype | None = None) -> PyTree:
    """A tree of ones shaped (and placed) like ``tree``, in ``dtype`` if given."""
    return checked_map(lambda x: torch.ones_like(_tensor(x), dtype=dtype), [("tree", tree)])


def full_like(tree: PyTree, fill_value: Scalar, dtype: torch.dtype | None = None) -> PyTree:
    """A tree shaped (and placed) like ``tree`` with every element ``fill_value``, in
    ``dtype`` if given (a 0-d tensor ``fill_value`` is read once per leaf)."""
    if isinstance(fill_value, torch.Tensor):
        return checked_map(
            lambda x: torch.empty_like(_tensor(x), dtype=dtype).copy_(fill_value),
            [("tree", tree)])
    return checked_map(lambda x: torch.full_like(_tensor(x), fill_value, dtype=dtype),
                       [("tree", tree)])


def update_moment(updates: PyTree, moments: PyTree, decay: Scalar, order: int) -> PyTree:
    """The EMA of the ``order``-th power: ``t <- (1 - decay) * g**order + decay * t``.

    A ``None`` update leaf gives ``None`` (whatever its moment)."""
    return checked_map(
        lambda g, t: None if g is None else (1 - decay) * (g ** order) + decay * t,
        [("updates", updates), ("moments", moments)], none_is_leaf=True)


def update_infinity_moment(updates: PyTree, moments: PyTree, decay: Scalar,
                           eps: Scalar) -> PyTree:
    """The EMA of the infinity norm: ``t <- max(|g| + eps, decay * t)``.

    A ``None`` update leaf gives ``None``."""
    return checked_map(
        lambda g, t: None if g is None else torch.maximum(
            _tensor(abs(g) + eps), _tensor(decay * t)),
        [("updates", updates), ("moments", moments)], none_is_leaf=True)


def _orderth_norm(g: Any, order: int | float) -> Any:
    if not (isinstance(g, torch.Tensor) and g.is_complex()):
        return g ** order
    half = order / 2
    if float(half).is_integer():
        half = int(half)
    return (g.real.square() + g.imag.square()) ** half


def update_moment_per_elem_norm(updates: PyTree, moments: PyTree, decay: Scalar,
                                order: int | float) -> PyTree:
    """The EMA of the ``order``-th power of each element's modulus:
    ``t <- (1 - decay) * |g|**order + decay * t``, where ``|g|**order`` is ``g**order``
    for a real ``g`` (as optax: no absolute value) and ``(re² + im²)**(order/2)`` for a
    complex one. A ``None`` update leaf gives ``None``."""
    return checked_map(
        lambda g, t: None if g is None else (1 - decay) * _orderth_norm(g, order) + decay * t,
        [("updates", updates), ("moments", moments)], none_is_leaf=True)


def bias_correction(moment: PyTree, decay: Scalar, count: int | torch.Tensor) -> PyTree:
    """``t / (1 - decay**count)`` for every leaf ``t``: Adam's bias correction, a no-op
    as ``count`` grows.

    ``1 - decay**count`` is computed in float32 (or in ``count``'s or ``decay``'s wider
    float dtype), then cast to each leaf's dtype for the division, so a bfloat16 moment
    stays bfloat16 without ``decay**count`` rounding to 1 (optax's rule). A tensor
    ``count`` (ftopt's int32 step counts) is never read on the host.
    """
    count_t = _tensor(count)
    if not (count_t.is_floating_point() or count_t.is_complex()):
        count_t = count_t.to(torch.float32)
    if isinstance(decay, torch.Tensor):
        power = decay.to(torch.promote_types(decay.dtype, count_t.dtype)) ** count_t
    else:
        power = torch.pow(decay, count_t)
    correction = 1 - power

    def fix(t: Any) -> torch.Tensor:
        t = _tensor(t)
        return t / correction.to(device=t.device, dtype=t.dtype)

    return checked_map(fix, [("moment", moment)])
