"""Leaves of a flat ``{name: tensor}`` dict without a full tree flatten (the cached
steps' fast way to the leaves of the trees they were built for)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from itertools import compress, repeat

import optree
import torch

__all__ = ["dict_list_getter", "flat_dict_getter", "flat_dict_leaves"]

_is_not = operator.is_not
_TENSORS = "tensors"


def _held(d: dict):
    """What a dict of the tree held: ``_TENSORS``, as many ``None`` as it has keys (holes,
    a tuple), or ``None`` (both)."""
    if not any(v is None for v in d.values()):
        return _TENSORS
    if all(v is None for v in d.values()):
        return (None,) * len(d)
    return None


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


def dict_list_getter(tree) -> Callable | None:
    """For a list (or tuple) of dicts whose values are tensors or ``None`` (the joined
    param groups of :class:`ftopt.Optimizer`: the params, and each state slot widened to
    every group with ``None`` holes): a function giving such a tree's non-``None`` leaves
    (all leaves with ``drop_none=False``, for gradients) in optree order (sorted keys),
    or ``None`` for a tree of other keys or containers.
    A single such dict (a partition's state slot) is read the same way. ``None`` here
    for any other kind of tree.

    A dict that held only tensors when the getter was made is taken as it is, as
    :func:`flat_dict_leaves` takes a dict: a ``None`` put there later reaches the
    caller's tensor check (:class:`ftopt.lowering.checks.TensorCheck`), which refuses
    anything but the tensors it recorded, so the step takes the full path.

    ``proven`` (a set the caller keeps for one read of several trees, such as a state's
    slots, which share another group's holes): the ids of the hole dicts proven holes in
    that read, which are not looked at again."""
    if type(tree) is dict:
        inner = dict_list_getter([tree])
        return None if inner is None else (
            lambda other, drop_none=True, proven=None: inner([other], drop_none, proven)
            if type(other) is dict else None)
    if type(tree) not in (list, tuple) or not tree or not all(type(d) is dict for d in tree):
        return None
    if not all(v is None or type(v) in (torch.Tensor, torch.nn.Parameter)
               for d in tree for v in d.values()):
        return None  # (8-bit slots, nested trees: flattened instead)
    try:
        orders = [sorted(d) for d in tree]
    except TypeError:  # keys optree keeps in insertion order
        return None
    kind, n = type(tree), len(tree)
    # Per dict: its size, a getter of its values in key order, and what it held: all
    # tensors (taken as they are, see above), all ``None`` (another group's holes: as
    # many ``None``, which a tuple compare of its values, by identity in C, proves still
    # holes; a tensor put in one compares unequal) or both (scanned for ``None``).
    getters = [(len(keys), operator.itemgetter(*keys) if keys else None, _held(d))
               for keys, d in zip(orders, tree)]

    def leaves(other, drop_none: bool = True, proven: set | None = None) -> list | None:
        if type(other) is not kind or len(other) != n:
            return None
        out: list = []
        for d, (size, get, held) in zip(other, getters):
            if type(d) is not dict or len(d) != size:
                return None
            if not size:
                continue
            if drop_none and held is not _TENSORS and held is not None:
                if proven is not None and id(d) in proven:
                    continue  # (proven holes earlier in the caller's read)
                if tuple(d.values()) == held:
                    if proven is not None:
                        proven.add(id(d))
                    continue  # (still holes: no leaves, in any key order)
            try:
                got = get(d)
            except KeyError:
                return None
            if size == 1:
                got = (got,)
            if not drop_none or held is _TENSORS:
                out += got  # (gradients: a None is a leaf with no gradient)
            else:
                # By identity, in C (``None in got`` would call ``Tensor.__eq__``).
                out += compress(got, map(_is_not, got, repeat(None)))
        return out

    return leaves
