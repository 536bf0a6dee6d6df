"""Pytree path strings and structure diffs, shared by :mod:`ftopt.tree` and the tree
math modules (:mod:`ftopt.tree_math` and its siblings), which must not import
:mod:`ftopt.tree` (it re-exports them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optree

PyTree = Any

__all__ = ["path_str", "diff", "check_structures", "checked_map"]


def path_str(path: Sequence) -> str:
    """``('layer', 0, 'weight')`` -> ``"['layer'][0]['weight']"`` (``<root>`` if empty)."""
    if not path:
        return "<root>"
    return "".join(f"[{k!r}]" for k in path)


def diff(spec: optree.PyTreeSpec, tree: PyTree, path: tuple) -> str | None:
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
        found = diff(child_spec, children[got.index(entry)], (*path, entry))
        if found is not None:
            return found
    return None


def check_structures(
    trees: Sequence[tuple[str, PyTree]], *, none_is_leaf: bool = False
) -> optree.PyTreeSpec:
    """The structure of the first of the ``(argument name, tree)`` pairs ``trees``
    (namespace ``"ftopt"``); a later tree that does not have it (as a prefix: a subtree
    may stand where the first has a leaf) raises ``ValueError`` naming that argument and
    the first differing path."""
    (first_name, first), rest = trees[0], trees[1:]
    spec = optree.tree_structure(first, none_is_leaf=none_is_leaf, namespace="ftopt")
    for name, other in rest:
        try:
            spec.flatten_up_to(other)
        except (ValueError, TypeError) as err:
            detail = diff(spec, other, ()) or str(err)
            raise ValueError(
                f"{name} does not match the structure of {first_name}: {detail}") from None
    return spec


def checked_map(
    fn: Callable, trees: Sequence[tuple[str, PyTree]], *, none_is_leaf: bool = False
) -> PyTree:
    """``optree.tree_map(fn, *trees)`` in the ``"ftopt"`` namespace after
    :func:`check_structures` (``trees`` are ``(argument name, tree)`` pairs).

    With ``none_is_leaf=True`` a ``None`` is a leaf handed to ``fn`` (optax's
    ``is_leaf=lambda x: x is None``); otherwise it is an empty subtree.
    """
    check_structures(trees, none_is_leaf=none_is_leaf)
    return optree.tree_map(fn, *(t for _, t in trees), none_is_leaf=none_is_leaf,
                           namespace="ftopt")
