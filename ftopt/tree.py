"""Pytree helpers over optree, with errors that name the offending leaf by its path.

ftopt trees follow optree with ``none_is_leaf=False``: ``None`` is an empty subtree. A
gradient tree may hold ``None`` where the params hold a tensor ("no gradient"); helpers
here flatten such trees against the params' structure so that the ``None`` shows up as a
leaf position.

It also carries optax's ``optax.tree`` namespace over torch tensors, with optax's
semantics (differences in each function's docstring): ``add``, ``add_scale``,
``allclose``, ``batch_shape``, ``bias_correction``, ``clip``, ``conj``, ``div``,
``full_like``, ``max``, ``min``, ``mul``, ``norm``, ``ones_like``, ``real``, ``scale``,
``size``, ``sub``, ``sum``, ``update_infinity_moment``, ``update_moment``,
``update_moment_per_elem_norm``, ``vdot``, ``where``, ``zeros_like`` (the function
below), ``cast``, ``cast_like``, ``dtype``, ``random_like`` (a ``torch.Generator`` or
an ``int`` seed instead of a JAX key; the draws differ from JAX's), ``get``,
``get_all_with_path``, ``set``, ``map_params`` (defined in :mod:`ftopt.tree_math`,
:mod:`ftopt.tree_reduce`, :mod:`ftopt.tree_dtypes`, :mod:`ftopt.tree_state`). optax's
``split_key_like`` and ``unwrap_random_key_data`` handle JAX PRNG keys, which torch
does not have, and are left out.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import optree
import torch

from ftopt.tree_paths import diff as _diff
from ftopt.tree_paths import path_str

PyTree = Any

__all__ = [
    "PyTree",
    "leaves",
    "map",
    "map_with_path",
    "structure",
    "flatten_with_paths",
    "flatten_like",
    "unflatten",
    "path_str",
    "zeros_like",
    "state_device",
    "enclosing_device",
    # optax.tree's functions (ftopt.tree_math, tree_reduce, tree_dtypes, tree_state);
    # zeros_like above is optax's tree_zeros_like.
    "add", "add_scale", "allclose", "batch_shape", "bias_correction", "clip", "conj",
    "div", "full_like", "max", "min", "mul", "norm", "ones_like", "real", "scale",
    "size", "sub", "sum", "update_infinity_moment", "update_moment",
    "update_moment_per_elem_norm", "vdot", "where", "cast", "cast_like", "dtype",
    "random_like", "get", "get_all_with_path", "set", "map_params", "NamedTupleKey",
]

# The device of the params around a subtree being initialised (see enclosing_device).
_ENCLOSING_DEVICE: contextvars.ContextVar[torch.device | None] = contextvars.ContextVar(
    "ftopt_enclosing_device", default=None)


def structure(tree: PyTree) -> optree.PyTreeSpec:
    """The optree structure of ``tree`` (``None`` is an empty subtree)."""
    return optree.tree_structure(tree, none_is_leaf=False, namespace="ftopt")


def leaves(tree: PyTree) -> list:
    """The leaves of ``tree`` in optree order."""
    return optree.tree_leaves(tree, none_is_leaf=False, namespace="ftopt")


def map(fn: Callable, tree: PyTree, *rest: PyTree) -> PyTree:  # noqa: A001
    """``optree.tree_map`` with ftopt's conventions."""
    return optree.tree_map(fn, tree, *rest, none_is_leaf=False, namespace="ftopt")


def map_with_path(fn: Callable, tree: PyTree, *rest: PyTree) -> PyTree:
    """Like :func:`map`, ``fn`` also receives the leaf's path string first."""
    return optree.tree_map_with_path(
        lambda path, *xs: fn(path_str(path), *xs), tree, *rest, none_is_leaf=False,
        namespace="ftopt",
    )


def flatten_with_paths(tree: PyTree) -> tuple[list[str], list, optree.PyTreeSpec]:
    """Paths, leaves and structure of ``tree``."""
    paths, flat, spec = optree.tree_flatten_with_path(
        tree, none_is_leaf=False, namespace="ftopt"
    )
    return [path_str(p) for p in paths], flat, spec


def flatten_like(
    spec: optree.PyTreeSpec, tree: PyTree, what: str, paths: Sequence[str],
    against: str = "params",
) -> list:
    """Flatten ``tree`` up to the leaves of ``spec``; a subtree may stand for a leaf.

    Used for gradient trees (a ``None`` stands where the params hold a tensor) and for
    state slots (an 8-bit slot holds a ``(codes, absmax)`` pair where the params hold a
    tensor). Raises ``ValueError`` naming the first path where the trees differ and what
    was expected there (``against`` names the tree ``spec`` comes from).
    """
    try:
        return spec.flatten_up_to(tree)
    except (ValueError, TypeError) as err:
        found = _diff(spec, tree, ())
        detail = found if found is not None else _first_difference(spec, tree, paths, err)
        raise ValueError(f"{what} does not match the {against} tree: {detail}") from None


def _first_difference(
    spec: optree.PyTreeSpec, tree: PyTree, paths: Sequence[str], err: Exception
) -> str:
    other_paths, _, _ = flatten_with_paths(tree)
    present = {*other_paths}  # (the name set is ftopt.tree.set here)
    missing = [p for p in paths if p not in present]
    extra = [p for p in other_paths if not any(p.startswith(q) for q in paths)]
    if extra:
        return f"unexpected leaf at {extra[0]}"
    if missing and len(other_paths) >= len(paths):
        return f"expected a leaf at {missing[0]}"
    return f"expected structure {spec} ({err})"


def unflatten(spec: optree.PyTreeSpec, flat: Sequence) -> PyTree:
    """Inverse of flattening against ``spec`` (entries may be subtrees or ``None``)."""
    return optree.tree_unflatten(spec, list(flat))


def zeros_like(tree: PyTree, dtype: torch.dtype | None = None) -> PyTree:
    """A tree of zero tensors shaped like ``tree``."""
    return map(lambda x: torch.zeros_like(x, dtype=dtype), tree)


def state_device(flat: Sequence) -> torch.device:
    """Where an ``init`` over the leaves ``flat`` puts its step counts and other scalars:
    the first tensor leaf's device; with none (a :func:`ftopt.masked` or
    :func:`ftopt.partition` branch that selects no leaf) the device of the params around
    it (:func:`enclosing_device`), so every count of a state lives with the params and a
    fused step increments it in its kernel; the CPU for params with no tensor at all."""
    for leaf in flat:
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return _ENCLOSING_DEVICE.get() or torch.device("cpu")


@contextlib.contextmanager
def enclosing_device(tree: PyTree) -> Iterator[None]:
    """Within it, :func:`state_device` of no leaves is ``tree``'s first tensor's device
    (unchanged if ``tree`` holds no tensor: an empty branch inside an empty branch keeps
    the outer params' device)."""
    device = next((t.device for t in leaves(tree) if isinstance(t, torch.Tensor)), None)
    if device is None:
        yield
        return
    token = _ENCLOSING_DEVICE.set(device)
    try:
        yield
    finally:
        _ENCLOSING_DEVICE.reset(token)


# optax's optax.tree namespace, over torch tensors (the modules use optree directly and
# never import this one). Imported last: sum, max, min, set and dtype shadow builtins
# (and torch names) only for code that reads them from ftopt.tree.
from ftopt.tree_dtypes import cast, cast_like, dtype, random_like  # noqa: E402
from ftopt.tree_math import (  # noqa: E402
    add,
    add_scale,
    batch_shape,
    bias_correction,
    clip,
    conj,
    div,
    full_like,
    mul,
    ones_like,
    real,
    scale,
    sub,
    update_infinity_moment,
    update_moment,
    update_moment_per_elem_norm,
    where,
)
from ftopt.tree_reduce import allclose, max, min, norm, size, sum, vdot  # noqa: E402
from ftopt.tree_state import NamedTupleKey, get, get_all_with_path, map_params, set  # noqa: E402
