"""optax's ``optax.tree`` reductions over pytrees of torch tensors (re-exported by
:mod:`ftopt.tree`): ``sum``, ``vdot``, ``norm``, ``max``, ``min``, ``size``,
``allclose``.

Each returns a 0-d tensor on the device of the tree's first tensor leaf, built without
reading anything on the host (no ``.item()``, no synchronisation), where optax returns
a JAX array; ``size`` returns a Python ``int`` as optax. A tree with no leaf gives
optax's identity on the CPU: ``0`` for ``sum``/``vdot``, ``-inf``/``inf`` for
``max``/``min``, ``True`` for ``allclose``. Python-number leaves are taken as 0-d
tensors. Leaves of different dtypes combine by torch's promotion of 0-d tensors (the
same as JAX's for float and complex dtypes: float32 and float64 give float64,
bfloat16 and float16 give float32).

Differences from optax (JAX without x64):

* integer sums (``sum``, ``vdot``, ``norm(ord=1)`` of integer trees) accumulate in
  int64, torch's rule, where JAX gives int32;
* ``vdot`` multiplies in the two leaves' promoted dtype and sums in it, where optax
  asks XLA for its highest precision: float32 trees give float32-accurate results;
* ``sum``'s ``associative_reduction`` only changes the order of the additions (a
  pairwise tree instead of left to right), as optax's.
"""

from __future__ import annotations

import builtins
import functools
import operator
from collections.abc import Callable
from typing import Any

import optree
import torch

from ftopt.tree_paths import check_structures, checked_map, path_str

PyTree = Any

__all__ = ["allclose", "max", "min", "norm", "size", "sum", "vdot"]


def _tensor(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def _leaves(tree: PyTree) -> list:
    return optree.tree_leaves(tree, none_is_leaf=False, namespace="ftopt")


def _device(leaves: list) -> torch.device:
    return next((x.device for x in leaves if isinstance(x, torch.Tensor)),
                torch.device("cpu"))


def _fold(fn: Callable, values: list, identity: torch.Tensor) -> torch.Tensor:
    """``fn`` folded left to right over ``values`` (``identity`` when empty)."""
    if not values:
        return identity
    return functools.reduce(fn, values)


def _pairwise(fn: Callable, values: list) -> Any:
    while len(values) > 1:
        values = [fn(values[i], values[i + 1]) if i + 1 < len(values) else values[i]
                  for i in range(0, len(values), 2)]
    return values[0]


def sum(tree: PyTree, associative_reduction: bool = False) -> torch.Tensor:  # noqa: A001
    """The sum of every element of every leaf, a 0-d tensor (``0`` for no leaf).

    ``associative_reduction=True`` adds the per-leaf sums pairwise (a balanced tree)
    instead of left to right, which may change the last bits, as optax's.
    """
    leaves = _leaves(tree)
    sums = [_tensor(x).sum() for x in leaves]
    if not sums:
        return torch.zeros((), dtype=torch.int64, device=_device(leaves))
    if associative_reduction:
        return _pairwise(operator.add, sums)
    return functools.reduce(operator.add, sums)


def _vdot_leaf(path: tuple, a: Any, b: Any) -> torch.Tensor:
    a, b = _tensor(a), _tensor(b)
    if a.shape != b.shape:
        raise ValueError(f"vdot: tree_x and tree_y have leaves of different shapes at "
                         f"{path_str(path)}: {tuple(a.shape)} and {tuple(b.shape)}")
    dtype = torch.promote_types(a.dtype, b.dtype)
    a, b = a.to(dtype).reshape(-1), b.to(dtype).reshape(-1)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.vdot(a, b)
    return (a * b).sum()


def vdot(tree_x: PyTree, tree_y: PyTree) -> torch.Tensor:
    """The inner product ``sum_leaves sum_i conj(x_i) * y_i`` (``x`` conjugated, as
    ``jnp.vdot``), a 0-d tensor. The two trees must have one structure and each pair of
    leaves one shape (``ValueError`` naming the path otherwise)."""
    check_structures([("tree_x", tree_x), ("tree_y", tree_y)])
    dots = optree.tree_map_with_path(_vdot_leaf, tree_x, tree_y, none_is_leaf=False,
                                     namespace="ftopt")
    leaves = _leaves(dots)
    if not leaves:
        return torch.zeros((), dtype=torch.int64, device=_device(_leaves(tree_x)))
    return functools.reduce(operator.add, leaves)


def _square(x: torch.Tensor) -> torch.Tensor:
    """``|x|²`` element-wise (``re² + im²`` for complex ``x``), in ``x``'s real dtype."""
    return x.real.square() + x.imag.square() if x.is_complex() else x.square()


def _extreme(tree: PyTree, pick: Callable, combine: Callable, identity: float
             ) -> torch.Tensor:
    leaves = _leaves(tree)
    device = _device(leaves)
    values = [pick(t) for t in (_tensor(x) for x in leaves) if t.numel()]
    out = _fold(combine, values, torch.tensor(identity, device=device))
    if not (out.is_floating_point() or out.is_complex()):
        # optax folds from a Python ±inf, which turns an integer or boolean max into
        # JAX's default float dtype; the same here.
        out = out.to(torch.get_default_dtype())
    return out


def max(tree: PyTree) -> torch.Tensor:  # noqa: A001
    """The largest element of the tree, a 0-d tensor; empty leaves are skipped and a tree
    with no element gives ``-inf``. Integer and boolean trees give a float (of torch's
    default dtype) as optax's, which folds the leaves' maxima from ``-inf``."""
    return _extreme(tree, torch.amax, torch.maximum, -float("inf"))


def min(tree: PyTree) -> torch.Tensor:  # noqa: A001
    """The smallest element of the tree, a 0-d tensor; empty leaves are skipped and a
    tree with no element gives ``inf`` (a float for integer trees, as :func:`max`)."""
    return _extreme(tree, torch.amin, torch.minimum, float("inf"))


def size(tree: PyTree) -> int:
    """The number of elements of all the leaves together (a Python ``int``, read from
    the shapes: no device work)."""
    return builtins.sum(_tensor(x).numel() for x in _leaves(tree))


def norm(tree: PyTree, ord: int | float | str | None = None,  # noqa: A002
         squared: bool = False) -> torch.Tensor:
    """The vector norm of all the tree's elements together, a 0-d tensor.

    ``ord=None`` or ``2``: ``sqrt(sum |x_i|²)`` (``|x|² = re² + im²`` for complex
    leaves), or the sum itself with ``squared=True``. ``ord=1``: ``sum |x_i|``.
    ``ord=inf`` (``float('inf')``, ``math.inf``, ``'inf'`` or ``'infinity'``):
    ``max |x_i|`` (``-inf`` for a tree with no element, as optax). With ``squared=True``
    the ``1`` and ``inf`` norms are squared. Any other ``ord`` raises ``ValueError``.
    """
    if ord is None or ord == 2:
        total = sum(checked_map(lambda x: _square(_tensor(x)), [("tree", tree)]))
        return total if squared else torch.sqrt(total)
    if ord == 1:
        out = sum(checked_map(lambda x: _tensor(x).abs(), [("tree", tree)]))
    elif ord in (float("inf"), "inf", "infinity"):
        out = max(checked_map(lambda x: _tensor(x).abs(), [("tree", tree)]))
    else:
        raise ValueError(f"norm: unsupported ord {ord!r}; expected None, 1, 2 or inf")
    return _square(out) if squared else out


def allclose(a: PyTree, b: PyTree, rtol: float = 1e-5, atol: float = 1e-8,
             equal_nan: bool = False) -> torch.Tensor:
    """Whether every pair of leaves satisfies ``|a - b| <= atol + rtol * |b|``
    element-wise (``torch.isclose`` after promoting the pair to one dtype; shapes
    broadcast), a 0-d boolean tensor (``True`` for trees with no leaf). ``bool()`` of it
    reads it on the host; optax also returns an array."""

    def close(x: Any, y: Any) -> torch.Tensor:
        x, y = _tensor(x), _tensor(y)
        dtype = torch.promote_types(x.dtype, y.dtype)
        return torch.isclose(x.to(dtype), y.to(dtype), rtol=rtol, atol=atol,
                             equal_nan=equal_nan).all()

    flags = _leaves(checked_map(close, [("a", a), ("b", b)]))
    return _fold(operator.and_, flags, torch.tensor(True, device=_device(_leaves(a))))
