"""Core types: ``GradientTransformation``, ``EmptyState`` and the trivial transforms."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

from ftopt import tree as tree_lib

PyTree = Any
Params = PyTree
Updates = PyTree
OptState = PyTree

__all__ = [
    "GradientTransformation",
    "EmptyState",
    "stateless",
    "register_state",
    "check_transform",
]


class TransformInitFn(Protocol):
    def __call__(self, params: Params) -> OptState: ...


class TransformUpdateFn(Protocol):
    def __call__(
        self, updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]: ...


class GradientTransformation(NamedTuple):
    """A pure ``(init, update)`` pair, as in optax.

    ``init(params) -> state``; ``update(updates, state, params=None, **extra) ->
    (updates, new_state)``. Neither mutates its inputs. Extra keyword arguments are
    accepted and ignored by transforms that do not use them.

    ftopt transforms are bound methods of small objects (``tx.update.__self__``); the
    lowering reads the elementwise rule off those objects to fuse a chain.
    """

    init: TransformInitFn
    update: TransformUpdateFn


def check_transform(tx: Any, what: str) -> None:
    """Raise a ``TypeError`` naming ``what`` unless ``tx`` is a ``GradientTransformation``.

    Checked where a transform is handed over (combinators, ``step``, ``explain``): a plain
    function or ``None`` would otherwise fail much later, as an ``AttributeError`` about
    ``update`` that does not say which argument was wrong.
    """
    if isinstance(tx, GradientTransformation) and callable(tx.init) and callable(tx.update):
        return
    if isinstance(tx, GradientTransformation):
        got = "a GradientTransformation whose init or update is not callable"
    else:
        name = getattr(tx, "__qualname__", None) if callable(tx) else None
        got = type(tx).__name__ + (f" {name!r}" if isinstance(name, str) else "")
    if callable(getattr(tx, "gradient_transformation", None)):  # (MultiSteps, as optax's)
        hint = "; pass tx.gradient_transformation()"
    elif callable(tx):
        hint = ("; call a factory (ftopt.adam(1e-3), not ftopt.adam), or wrap a function "
                "of (updates, params) with ftopt.stateless(fn)")
    else:
        hint = ""
    raise TypeError(f"{what}: expected a GradientTransformation, got {got}{hint}")


class EmptyState(NamedTuple):
    """The state of a stateless transform."""


def register_state(cls: type) -> type:
    """Allow ``torch.load(weights_only=True)`` to rebuild a state NamedTuple."""
    torch.serialization.add_safe_globals([cls])
    return cls


register_state(EmptyState)

_KEYS = itertools.count()
_OWNERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def register_owner(obj: Any) -> None:
    """Give a transform object a process-unique key (``obj.ftopt_key``).

    ``torch.compile`` reads the key as a constant to find the transform at run time (a
    string, since Dynamo may turn an int attribute into a symbolic size).
    """
    obj.ftopt_key = f"ftopt-transform-{next(_KEYS)}"
    _OWNERS[obj.ftopt_key] = obj


def owner_by_key(key: str) -> Any:
    return _OWNERS[key]


class _Stateless:
    def __init__(self, fn: Callable[[Updates, Params | None], Updates]):
        self.fn = fn
        register_owner(self)

    def init(self, params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update(self, updates, state, params=None, **extra):
        del extra
        # ``fn`` may compute anything from what it is given: only floating-point updates
        # are given (an int or bool gradient would come out of ``0.5 * u`` as floats).
        paths, leaves, _ = tree_lib.flatten_with_paths(updates)
        for path, u in zip(paths, leaves):
            if isinstance(u, torch.Tensor) and not (u.is_floating_point()
                                                    or u.layout != torch.strided):
                raise TypeError(f"update at {path}: expected a floating-point tensor, got "
                                f"{u.dtype}")
        return self.fn(updates, params), state


def stateless(fn: Callable[[Updates, Params | None], Updates]) -> GradientTransformation:
    """A transform from a function ``fn(updates, params) -> updates`` with no state.

    It runs eagerly (ftopt cannot see inside ``fn``), so a chain holding it is not fused.
    """
    obj = _Stateless(fn)
    return GradientTransformation(obj.init, obj.update)

