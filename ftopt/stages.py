"""The elementwise stages of a transform: the rules a chain runs, in order.

Both the one-pass eager step (:mod:`ftopt.eager_step`) and the fused backend
(:mod:`ftopt.lowering`) run a chain as one program over its stages; this module finds
them once per transform.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ftopt.combine import Chain, SkipZeros, owner
from ftopt.rule_transform import RuleTransform
from ftopt.validate import check_state_class

__all__ = ["Stages", "chain_stages", "state_at", "with_state_at", "check_state_tree"]


@dataclass(frozen=True)
class Stages:
    """The rules of a transform with where their states live, or why it has none.

    ``state_paths[i]`` indexes stage ``i``'s state in the transform's state (tuple indices
    and named_chain names); ``skips[i]`` says whether a ``skip_zeros`` mask applies to it.

    ``matrix``: the chain's matrix stages (:mod:`ftopt.matrix`) as ``(position, stage,
    skip, state_path)``, ``position`` the number of rules before it. A chain with matrix stages also
    has a ``reason`` (for a backend that runs a chain as one program); the fused backend
    splits it into elementwise segments there instead.
    """

    stages: tuple[RuleTransform, ...] = ()
    state_paths: tuple[tuple, ...] = ()
    skips: tuple[bool, ...] = ()
    reason: str | None = None
    matrix: tuple[tuple[int, Any, bool, tuple], ...] = ()
    segmented: bool = False  # the reason is only the matrix stages


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def chain_stages(tx) -> Stages:
    """The stages of ``tx`` (cached per transform object)."""
    obj = owner(tx)
    if obj is None:
        return Stages(reason=f"{_describe(tx)} is not an ftopt transform")
    found = _CACHE.get(obj)
    if found is None:
        stages, paths, skips, matrix = [], [], [], []
        reason = _walk(tx, (), False, True, stages, paths, skips, matrix)
        segmented = reason is None and bool(matrix)
        if segmented:
            reason = (f"{matrix[0][1].name} is a matrix stage (the fused backend runs the "
                      "chain in segments)")
        found = Stages(tuple(stages), tuple(paths), tuple(skips), reason, tuple(matrix),
                       segmented)
        _CACHE[obj] = found
    return found


def _describe(tx) -> str:
    fn = getattr(tx.update, "__qualname__", None) or repr(tx.update)
    return f"transform {fn!r}"


def _walk(tx, path: tuple, skip: bool, at_input: bool, stages: list, paths: list,
          skips: list, matrix: list) -> str | None:
    obj = owner(tx)
    if isinstance(obj, RuleTransform):
        stages.append(obj)
        paths.append(path)
        skips.append(skip)
        return None
    if getattr(obj, "matrix_stage", False):
        matrix.append((len(stages), obj, skip, path))
        return None
    if isinstance(obj, SkipZeros):
        return None
    if isinstance(obj, Chain):
        if obj.skip_zeros and not skip and not (at_input and not stages and not matrix):
            return "skip_zeros in a nested chain that does not receive the raw gradient"
        inner_skip = skip or obj.skip_zeros
        for i, child in enumerate(obj.transforms):
            key = obj.names[i] if obj.names is not None else i
            reason = _walk(child, (*path, key), inner_skip, at_input and i == 0, stages,
                           paths, skips, matrix)
            if reason:
                return reason
        return None
    reason = getattr(obj, "unfused_reason", None)  # a transform may say why itself
    if reason:
        return reason
    name = type(obj).__name__ if obj is not None else _describe(tx)
    return f"{name} has no elementwise rule"


def state_at(state: Any, path: tuple) -> Any:
    """The state at ``path`` (tuple indices and ``named_chain`` names) in ``state``."""
    for key in path:
        state = state[key]
    return state


def with_state_at(state: Any, path: tuple, value: Any) -> Any:
    """A copy of ``state`` (tuples, NamedTuples, OrderedDicts) with ``value`` at ``path``."""
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(state, OrderedDict):
        new = OrderedDict(state)
        new[key] = with_state_at(state[key], rest, value)
        return new
    items = list(state)
    items[key] = with_state_at(state[key], rest, value)
    return type(state)(*items) if hasattr(state, "_fields") else type(state)(items)


def check_state_tree(obj: Any, state: Any) -> None:
    """The containers of a chain's state, checked in the order its eager ``update`` does
    (so the fused path raises the same error): a tuple (or, named, a mapping) per chain,
    each rule's own state class at its place."""
    if isinstance(obj, RuleTransform):
        check_state_class(obj.rule, state)
    elif isinstance(obj, Chain):
        for t, s in zip(obj.transforms, obj._inner_states(state)):
            check_state_tree(owner(t), s)
