"""optax's ``optax.tree`` state utilities over ftopt optimizer states (re-exported by
:mod:`ftopt.tree`): ``get_all_with_path``, ``get``, ``set``, ``map_params``, and the
path entry ``NamedTupleKey``.

A state is searched by key: a dict key, a NamedTuple field name, or a NamedTuple class
name (``"ScaleByAdamState"``). Paths are tuples of entries as optree spells them (a
dict key itself, an ``int`` index into a list or tuple), except that a NamedTuple
field is a :class:`NamedTupleKey` carrying the tuple's class name, so a ``filtering``
function can tell ``ScaleByAdamState.count`` from ``AddNoiseState.count``. optax uses
JAX's ``DictKey``/``SequenceKey`` objects for the other entries; ftopt uses the bare
key or index.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import optree

PyTree = Any
KeyPath = tuple
Filtering = Callable[[KeyPath, Any], bool]

__all__ = ["NamedTupleKey", "get", "get_all_with_path", "map_params", "set"]


@dataclasses.dataclass(frozen=True)
class NamedTupleKey:
    """The path entry of field ``name`` of a NamedTuple of class ``tuple_name``."""

    tuple_name: str
    name: str

    def __str__(self) -> str:
        return f"{self.tuple_name}.{self.name}"


def _is_named_tuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _leaves_with_path(tree: PyTree, is_leaf: Callable[[Any], bool]) -> list:
    """``(path, node)`` for the leaves of ``tree`` and its nodes where ``is_leaf`` holds,
    in optree order, NamedTuple fields spelled as :class:`NamedTupleKey`."""
    paths, nodes, _ = optree.tree_flatten_with_path(
        tree, is_leaf=lambda x: is_leaf(x) or _is_named_tuple(x), none_is_leaf=False,
        namespace="ftopt")
    out = []
    for path, node in zip(paths, nodes):
        if is_leaf(node) or not _is_named_tuple(node):
            out.append((tuple(path), node))
            continue
        for field in node._fields:
            entry = NamedTupleKey(type(node).__name__, field)
            out += [((*path, entry, *sub), value)
                    for sub, value in _leaves_with_path(getattr(node, field), is_leaf)]
    return out


def _has_keys(node: Any, keys: tuple) -> bool:
    """Whether ``node`` is a NamedTuple with one of ``keys`` as field or class name, or
    a dict with one of ``keys``."""
    if _is_named_tuple(node):
        return any(k in node._fields or k == type(node).__name__ for k in keys)
    return isinstance(node, dict) and any(k in node for k in keys)


def _children(path: KeyPath, node: Any) -> list:
    if _is_named_tuple(node):
        return [((*path, NamedTupleKey(type(node).__name__, f)), getattr(node, f))
                for f in node._fields]
    return [((*path, k), v) for k, v in node.items()]


def _key(entry: Any) -> Any:
    return entry.name if isinstance(entry, NamedTupleKey) else entry


def _all_with_path(tree: PyTree, key: Any) -> list:
    def has_key(node: Any) -> bool:
        return _has_keys(node, (key,))

    subtrees = [(p, n) for p, n in _leaves_with_path(tree, has_key) if has_key(n)]
    found = []
    for path, node in subtrees:
        if _is_named_tuple(node) and key == type(node).__name__:
            found.append((path, node))
        elif _is_named_tuple(node):
            found.append(((*path, NamedTupleKey(type(node).__name__, key)),
                          getattr(node, key)))
        else:
            found.append(((*path, key), node[key]))
    for path, node in subtrees:
        for child_path, child in _children(path, node):
            found += [((*child_path, *sub), value)
                      for sub, value in _all_with_path(child, key)]
    return found


def get_all_with_path(tree: PyTree, key: Any, filtering: Filtering | None = None
                      ) -> list[tuple[KeyPath, Any]]:
    """Every ``(path, value)`` of ``tree`` whose key is ``key`` (a dict key, a NamedTuple
    field, or a NamedTuple class name, whose value is then the NamedTuple itself), and
    for which ``filtering(path, value)`` holds if given.

    Order (optax's): the outermost matches first, in leaf order, then the matches nested
    inside them, e.g. ``{'a': {'a': 1.0}}`` gives ``[(('a',), {'a': 1.0}), (('a', 'a'),
    1.0)]``. A NamedTuple field's path entry is a :class:`NamedTupleKey`:
    ``get_all_with_path(ftopt.adam(1e-3).init(p), 'count')`` gives
    ``[((0, NamedTupleKey('ScaleByAdamState', 'count')), tensor(0, dtype=int32))]``.
    """
    found = _all_with_path(tree, key)
    if filtering is not None:
        found = [(p, v) for p, v in found if filtering(p, v)]
    return found


def get(tree: PyTree, key: Any, default: Any = None,
        filtering: Filtering | None = None) -> Any:
    """The one value of ``tree`` at ``key`` (see :func:`get_all_with_path`), ``default``
    if there is none; ``KeyError`` listing the paths if there are several.

    ``ftopt.tree.get(ftopt.adam(1e-3).init(params), 'mu')`` is Adam's first moment;
    ``filtering`` picks one of several matches, e.g. ``lambda path, _:
    path[-1].tuple_name == 'ScaleByAdamState'``.
    """
    found = get_all_with_path(tree, key, filtering)
    if len(found) > 1:
        raise KeyError(f"found {len(found)} values for {key!r}, at paths "
                       f"{[p for p, _ in found]}; pass a filtering function to pick one")
    return found[0][1] if found else default


def set(tree: PyTree, filtering: Filtering | None = None, /,  # noqa: A001
        **kwargs: Any) -> PyTree:
    """A copy of ``tree`` where every value at one of the keys of ``kwargs`` (and for
    which ``filtering(path, value)`` holds, if given) is replaced by ``kwargs[key]``;
    a NamedTuple whose class name is a key is replaced whole. Nothing is modified in
    place; untouched leaves are the same objects.

    ``KeyError`` if some key matches nothing. For example
    ``ftopt.tree.set(state, learning_rate=torch.tensor(0.1))`` on an
    :func:`ftopt.inject_hyperparams` state sets the learning rate of the next steps.
    A replacement keeps whatever it is given: set a 0-d tensor of the old one's dtype and
    device where the state holds one, to keep the state's layout (optax likewise stores
    the value as given).
    """
    for key in kwargs:
        if not get_all_with_path(tree, key, filtering):
            extra = " given the filtering function" if filtering is not None else ""
            raise KeyError(f"found no value for {key!r}{extra}")
    keys = tuple(kwargs)

    def has_any(node: Any) -> bool:
        return _has_keys(node, keys)

    def replace(path: KeyPath, node: Any) -> Any:
        if not has_any(node):
            return node
        if (_is_named_tuple(node) and type(node).__name__ in kwargs
                and (filtering is None or filtering(path, node))):
            return kwargs[type(node).__name__]
        new = {}
        for child_path, child in _children(path, node):
            key = _key(child_path[-1])
            if key in kwargs and (filtering is None or filtering(child_path, child)):
                new[key] = kwargs[key]
            elif isinstance(child, (dict, list, tuple)):
                new[key] = replace(child_path, child)
            else:
                new[key] = child
        if _is_named_tuple(node):
            return node._replace(**new)
        return new if type(node) is dict else type(node)(new)

    spec = optree.tree_structure(tree, is_leaf=has_any, none_is_leaf=False,
                                 namespace="ftopt")
    return optree.tree_unflatten(spec, [replace(p, n) for p, n in
                                        _leaves_with_path(tree, has_any)])


class _ParamsPlaceholder:
    """A node with no leaves standing for the params in :func:`map_params`."""


optree.register_pytree_node(_ParamsPlaceholder, lambda _: ((), None),
                            lambda _aux, _children: _ParamsPlaceholder(), namespace="ftopt")


@runtime_checkable
class Initable(Protocol):
    """An object with an ``init(params) -> state``."""

    def init(self, params: PyTree) -> PyTree: ...  # pragma: no cover


def map_params(
    initable: Callable[[PyTree], PyTree] | Initable,
    f: Callable[..., Any],
    state: PyTree,
    /,
    *rest: PyTree,
    transform_non_params: Callable[[Any], Any] | None = None,
    is_leaf: Callable[[Any], bool] | None = None,
) -> PyTree:
    """``state`` with ``f`` mapped over every subtree that is a copy of the params tree
    (Adam's ``mu`` and ``nu``, a momentum's ``trace``, ...), with ``rest`` (trees of the
    params' structure) as further arguments: ``f(leaf, *rest_leaves)``; every other
    leaf ``x`` (step counts, hyperparameters) becomes ``transform_non_params(x)`` if
    given, else stays.

    The params-shaped subtrees are found as optax does: ``initable`` (a
    ``GradientTransformation`` or an ``init`` function) is initialised on a placeholder
    with no leaves, and whatever holds the placeholder in that state is a params tree.
    ``is_leaf`` is passed to the map over each params tree (optree's ``is_leaf``).
    """
    placeholder = _ParamsPlaceholder()
    init = initable.init if isinstance(initable, Initable) else initable
    skeleton = init(placeholder)

    def visit(marker: Any, value: Any) -> Any:
        if isinstance(marker, _ParamsPlaceholder):
            return optree.tree_map(f, value, *rest, is_leaf=is_leaf, none_is_leaf=False,
                                   namespace="ftopt")
        return value if transform_non_params is None else transform_non_params(value)

    return optree.tree_map(visit, skeleton, state,
                           is_leaf=lambda x: isinstance(x, _ParamsPlaceholder),
                           none_is_leaf=False, namespace="ftopt")
