"""Pytree helpers over optree, with errors that name the offending leaf by its path.

ftopt trees follow optree with ``none_is_leaf=False``: ``None`` is an empty subtree. A
gradient tree may hold ``None`` where the params hold a tensor ("no gradient"); helpers
here flatten such trees against the params' structure so that the ``None`` shows up as a
leaf position.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import optree
import torch

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


def path_str(path: Sequence) -> str:
    """``('layer', 0, 'weight')`` -> ``"['layer'][0]['weight']"`` (``<root>`` if empty)."""
    if not path:
        return "<root>"
    return "".join(f"[{k!r}]" for k in path)


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


def _diff(spec: optree.PyTreeSpec, tree: PyTree, path: tuple) -> str | None:
    """The first place where ``tree`` does not fit ``spec`` (``None`` if it fits)."""
    try:
        spec.flatten_up_to(tree)
        return None
    except (ValueError, TypeError):
        pass
    if spec.is_leaf():  # pragma: no cover - anything fits a leaf
        return None
    where = path_str(path)
    try:
        children, _, entries, _ = optree.tree_flatten_one_level(
            tree, none_is_leaf=spec.none_is_leaf, namespace=spec.namespace)
    except (ValueError, TypeError):
        return (f"expected a {spec.type.__name__} at {where}, got a leaf of type "
                f"{type(tree).__name__}")
    want, got = list(spec.entries()), list(entries)
    if type(tree) is not spec.type and not (
        isinstance(tree, dict) and issubclass(spec.type, dict)
    ):
        return f"expected a {spec.type.__name__} at {where}, got a {type(tree).__name__}"
    sequence = all(isinstance(e, int) for e in want + got)
    if sequence and len(want) != len(got):
        return (f"expected a {spec.type.__name__} of length {len(want)} at {where}, got "
                f"a {type(tree).__name__} of length {len(got)}")
    if not sequence or want != got:
        missing = [e for e in want if e not in got]
        extra = [e for e in got if e not in want]
        if missing:
            return (f"missing {path_str((*path, missing[0]))} (expected keys {want} at "
                    f"{where}, got {got})")
        if extra:
            return (f"unexpected {path_str((*path, extra[0]))} (expected keys {want} at "
                    f"{where}, got {got})")
    for entry, child_spec in zip(want, spec.children()):
        found = _diff(child_spec, children[got.index(entry)], (*path, entry))
        if found is not None:
            return found
    return None


def _first_difference(
    spec: optree.PyTreeSpec, tree: PyTree, paths: Sequence[str], err: Exception
) -> str:
    other_paths, _, _ = flatten_with_paths(tree)
    present = set(other_paths)
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
