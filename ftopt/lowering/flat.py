"""Leaves of a flat ``{name: tensor}`` dict without a full tree flatten (the cached
steps' fast way to the leaves of the trees they were built for)."""

from __future__ import annotations

import operator

import optree
import torch

__all__ = ["flat_dict_getter", "flat_dict_leaves"]


def flat_dict_getter(params) -> operator.itemgetter | None:
    """An ``itemgetter`` of a flat ``{name: tensor}`` dict's keys in optree order (sorted),
    or ``None`` for any other tree: it picks the leaves without a full flatten."""
    if type(params) is not dict or not params or not all(
            isinstance(v, torch.Tensor) for v in params.values()):
        return None
    return operator.itemgetter(*[path[0] for path in optree.tree_paths(
        params, none_is_leaf=False, namespace="ftopt")])


def flat_dict_leaves(getter, n: int, tree) -> tuple | None:
    """The ``n`` leaves of ``tree`` through ``getter`` (see :func:`flat_dict_getter`);
    ``None`` if ``tree`` is not a dict of exactly those keys."""
    if getter is None or type(tree) is not dict or len(tree) != n:
        return None
    try:
        leaves = getter(tree)
    except KeyError:
        return None
    return leaves if n != 1 else (leaves,)
