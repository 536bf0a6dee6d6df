"""Combinators: ``chain``, ``named_chain``, ``masked``, ``partition``, ``skip_zeros``.

Each combinator is a small object whose bound ``init``/``update`` form the
``GradientTransformation``; the lowering walks these objects (``tx.update.__self__``) to
find the rules of a chain.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from ftopt import dispatch
from ftopt import tree as tree_lib
from ftopt.base import (
    EmptyState,
    GradientTransformation,
    check_transform,
    register_owner,
    register_state,
)
from ftopt.program import skip_updates, zero_mask_of
from ftopt.rule_transform import RuleTransform

__all__ = [
    "chain",
    "named_chain",
    "masked",
    "partition",
    "skip_zeros",
    "MaskedState",
    "PartitionState",
    "owner",
    "update_keywords",
    "zero_mask_of",
]


def owner(tx: GradientTransformation) -> Any:
    """The object behind a transform (``None`` for a transform ftopt did not build)."""
    return getattr(tx.update, "__self__", None)


def update_keywords(tx: GradientTransformation) -> frozenset[str]:
    """The keyword arguments of ``update`` that ``tx`` needs: ``value`` (the loss, for
    ``polyak_sgd``, ``momo`` and ``reduce_on_plateau``), ``grad`` and ``value_fn`` (the
    line searches), ``obj_fn`` (Sophia's estimate), ``grad_fn`` (opaque SAM). Each object
    behind a transform names those its own update reads in ``update_keywords``; this
    collects them over the transforms it holds (a chain's, a wrapper's inner one)."""
    found: set[str] = set()
    seen: set[int] = set()
    todo: list = [tx]
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, GradientTransformation):
            obj = owner(x)
            if obj is not None and id(obj) not in seen:
                seen.add(id(obj))
                found.update(getattr(obj, "update_keywords", ()))
                todo.extend(getattr(obj, "__dict__", {}).values())
        elif isinstance(x, (tuple, list)):
            todo.extend(x)
        elif isinstance(x, Mapping):
            todo.extend(x.values())
    return frozenset(found)


def _mask_aware(tx: GradientTransformation) -> bool:
    """Whether ``tx`` applies the chain's ``skip_zeros`` mask itself (a transform may say
    so with a ``mask_aware`` attribute)."""
    obj = owner(tx)
    return isinstance(obj, (RuleTransform, Chain, SkipZeros, Masked)) or bool(
        getattr(obj, "mask_aware", False))


class SkipZeros:
    """Marker: the chain holding it leaves zero-gradient elements untouched (SPEC §3)."""

    def __init__(self):
        register_owner(self)

    def init(self, params) -> EmptyState:
        del params
        return EmptyState()

    def update(self, updates, state, params=None, **extra):
        del params, extra
        return updates, state


class Chain:
    """Applies transforms in sequence; the state is a tuple (or, named, an OrderedDict)."""

    def __init__(self, transforms: Sequence[GradientTransformation],
                 names: Sequence[str] | None = None):
        for i, t in enumerate(transforms):
            what = (f"chain element {i}" if names is None
                    else f"named_chain element {i} ({names[i]!r})")
            check_transform(t, what)
        self.transforms = tuple(transforms)
        self.names = tuple(names) if names is not None else None
        self.skip_zeros = any(isinstance(owner(t), SkipZeros) for t in self.transforms)
        register_owner(self)

    def rebuild(self, transforms: Sequence[GradientTransformation]) -> GradientTransformation:
        obj = Chain(transforms, self.names)
        return GradientTransformation(obj.init, obj.update)

    def init(self, params):
        states = [t.init(params) for t in self.transforms]
        if self.names is None:
            return tuple(states)
        return OrderedDict(zip(self.names, states))

    def _inner_states(self, state) -> list:
        if self.names is None:
            if not isinstance(state, tuple) or len(state) != len(self.transforms):
                raise ValueError(
                    f"chain of {len(self.transforms)} transforms expects a tuple of "
                    f"{len(self.transforms)} states, got {_describe(state)}")
            return list(state)
        if not isinstance(state, Mapping) or list(state.keys()) != list(self.names):
            raise ValueError(f"named_chain expects states named {list(self.names)}, got "
                             f"{_describe(state)}")
        return [state[n] for n in self.names]

    def update(self, updates, state, params=None, **extra):
        return dispatch.update_entry(self, updates, state, params, extra,
                                     lambda: self._update(updates, state, params, extra))

    def _update(self, updates, state, params, extra: dict):
        inner = self._inner_states(state)
        if self.skip_zeros and extra.get("zero_mask") is None:
            extra = {**extra, "zero_mask": zero_mask_of(updates)}
        zero_mask = extra.get("zero_mask")
        new_states = []
        for t, s in zip(self.transforms, inner):
            updates, s = t.update(updates, s, params, **extra)
            if zero_mask is not None and not _mask_aware(t):
                updates = skip_updates(updates, zero_mask)
            new_states.append(s)
        if self.names is None:
            return updates, tuple(new_states)
        return updates, OrderedDict(zip(self.names, new_states))


def _describe(state) -> str:
    if isinstance(state, tuple):
        return f"{type(state).__name__} of length {len(state)}"
    if isinstance(state, Mapping):
        return f"mapping with keys {list(state.keys())}"
    return type(state).__name__


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Applies ``transforms`` in order; the state is the tuple of their states."""
    obj = Chain(transforms)
    return GradientTransformation(obj.init, obj.update)


def named_chain(*named: tuple[str, GradientTransformation]) -> GradientTransformation:
    """Like :func:`chain`; the state is an ``OrderedDict`` keyed by the given names."""
    for i, entry in enumerate(named):
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)):
            got = ("a GradientTransformation with no name" if isinstance(
                entry, GradientTransformation) else f"a tuple of length {len(entry)}"
                if isinstance(entry, tuple) else type(entry).__name__)
            raise TypeError(f"named_chain element {i}: expected a (name, transform) pair "
                            f"with a str name, got {got}")
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        raise ValueError(f"named_chain names must be unique, got {names}")
    obj = Chain([t for _, t in named], names)
    return GradientTransformation(obj.init, obj.update)


def skip_zeros(inner: GradientTransformation | None = None) -> GradientTransformation:
    """Leaves every element whose raw gradient is exactly zero bit-for-bit untouched.

    ``skip_zeros()`` inside a chain makes the whole chain skip-aware; ``skip_zeros(inner)``
    wraps one transform. For an element with g == 0 (+0.0 or −0.0; NaN is not zero) the
    update is zero, so the parameter stays bit-identical, and every per-element state of
    the chain keeps its pre-step value; step counts advance. Every other element is
    bit-identical to the result without ``skip_zeros``. Norms see the skipped elements as 0.
    """
    if inner is not None:
        check_transform(inner, "skip_zeros: argument inner")
    obj = SkipZeros()
    marker = GradientTransformation(obj.init, obj.update)
    if inner is None:
        return marker
    return chain(inner, marker)


@register_state
class MaskedState(NamedTuple):
    """The inner state of :func:`masked`, over the selected leaves only."""

    inner_state: Any


def _select(tree, mask_tree, what: str = "updates"):
    # Walk the mask (shaped like the params): ``tree`` may hold ``None`` where the params
    # hold a tensor (a leaf with no gradient), which then stays ``None``.
    paths, flat_mask, spec = tree_lib.flatten_with_paths(mask_tree)
    flat = tree_lib.flatten_like(spec, tree, what, paths)
    return tree_lib.unflatten(spec, [x if m else None for x, m in zip(flat, flat_mask)])


class Masked:
    """Applies ``inner`` to the leaves where ``mask`` is True; others pass through."""

    def __init__(self, inner: GradientTransformation, mask: Any):
        check_transform(inner, "masked: argument inner")
        self.inner = inner
        self.mask = mask
        register_owner(self)

    def rebuild(self, transforms: Sequence[GradientTransformation]) -> GradientTransformation:
        obj = Masked(transforms[0], self.mask)
        return GradientTransformation(obj.init, obj.update)

    @property
    def transforms(self) -> tuple[GradientTransformation, ...]:
        return (self.inner,)

    def _mask_for(self, tree):
        mask = self.mask(tree) if callable(self.mask) else self.mask
        spec = tree_lib.structure(tree)
        paths, _, _ = tree_lib.flatten_with_paths(tree)
        flat = tree_lib.flatten_like(spec, mask, "mask", paths)
        return tree_lib.unflatten(spec, [bool(m) for m in flat])

    def init(self, params):
        # (A mask that selects no leaf: the inner counts still go to the params' device.)
        with tree_lib.enclosing_device(params):
            return MaskedState(self.inner.init(_select(params, self._mask_for(params))))

    def check_state(self, state) -> None:
        """Raises unless ``state`` is this transform's kind of state (its containers)."""
        if not isinstance(state, MaskedState):
            raise ValueError(f"masked expects a MaskedState, got {type(state).__name__}")

    def update(self, updates, state, params=None, **extra):
        self.check_state(state)
        mask = self._mask_for(params if params is not None else updates)
        sub = _select(updates, mask)
        sub_params = _select(params, mask, "params") if params is not None else None
        full_mask = extra.get("zero_mask")
        if full_mask is not None:
            extra = {**extra, "zero_mask": _select(full_mask, mask, "zero_mask")}
        new_sub, inner_state = self.inner.update(sub, state.inner_state, sub_params, **extra)
        new = _fill(new_sub, updates)
        if full_mask is not None:
            # Leaves passed through unchanged: -0.0 where the raw gradient is zero (so
            # p + u keeps p, a -0.0 param too); the inner transform masked its own.
            new = skip_updates(new, full_mask)
        return new, MaskedState(inner_state)


def _fill(sub, full):
    """``sub`` with ``None`` holes filled from ``full`` (same structure as ``full``)."""
    spec = tree_lib.structure(full)
    paths, flat_full, _ = tree_lib.flatten_with_paths(full)
    flat_sub = tree_lib.flatten_like(spec, sub, "updates", paths)
    return tree_lib.unflatten(spec, [s if s is not None else f
                                     for s, f in zip(flat_sub, flat_full)])


def masked(inner: GradientTransformation, mask: Any) -> GradientTransformation:
    """Applies ``inner`` only where ``mask`` (a pytree of bools, or a function of the
    params returning one) is True; other updates pass through and get no inner state."""
    obj = Masked(inner, mask)
    return GradientTransformation(obj.init, obj.update)


@register_state
class PartitionState(NamedTuple):
    """The inner states of :func:`partition`, keyed by label."""

    inner_states: Any


class Partition:
    """Applies ``transforms[label]`` to the leaves carrying ``label`` (see :func:`partition`).

    An object (like :class:`Masked`) so that :func:`ftopt.quantize_states` can rebuild the
    inner transforms.
    """

    def __init__(self, transforms: Mapping[Any, GradientTransformation],
                 param_labels: Any | Callable[[Any], Any]):
        if not isinstance(transforms, Mapping):
            raise TypeError("partition: argument transforms must be a mapping of label to "
                            f"transform, got {type(transforms).__name__}")
        for label, tx in transforms.items():
            check_transform(tx, f"partition: transforms[{label!r}]")
        self.labels = list(transforms)
        self.user_transforms = dict(transforms)
        self.param_labels = param_labels
        self.inner = {label: masked(tx, self._mask_for(label))
                      for label, tx in transforms.items()}
        register_owner(self)

    @property
    def transforms(self) -> tuple[GradientTransformation, ...]:
        return tuple(self.user_transforms[label] for label in self.labels)

    def rebuild(self, transforms: Sequence[GradientTransformation]) -> GradientTransformation:
        obj = Partition(dict(zip(self.labels, transforms)), self.param_labels)
        return GradientTransformation(obj.init, obj.update)

    def _labels_of(self, tree):
        return self.param_labels(tree) if callable(self.param_labels) else self.param_labels

    def _mask_for(self, label):
        return lambda tree: tree_lib.map(lambda lab: lab == label, self._labels_of(tree))

    def _check(self, tree):
        missing = set(tree_lib.leaves(self._labels_of(tree))) - set(self.user_transforms)
        if missing:
            raise ValueError(f"partition: labels {sorted(map(str, missing))} have no "
                             "transform")

    def init(self, params):
        self._check(params)
        return PartitionState({k: t.init(params) for k, t in self.inner.items()})

    def check_state(self, state) -> None:
        """Raises unless ``state`` is this transform's kind of state (its containers)."""
        if not isinstance(state, PartitionState) or not isinstance(state.inner_states, Mapping) \
                or set(state.inner_states) != set(self.labels):
            got = (f"PartitionState with {_describe(state.inner_states)}"
                   if isinstance(state, PartitionState) else _describe(state))
            raise ValueError(f"partition expects a PartitionState with labels {self.labels}, "
                             f"got {got}")

    def update(self, updates, state, params=None, **extra):
        self.check_state(state)
        self._check(params if params is not None else updates)
        new_states = {}
        for label, tx in self.inner.items():
            updates, new_states[label] = tx.update(updates, state.inner_states[label], params,
                                                   **extra)
        return updates, PartitionState(new_states)


def partition(
    transforms: Mapping[Any, GradientTransformation],
    param_labels: Any | Callable[[Any], Any],
) -> GradientTransformation:
    """Applies ``transforms[label]`` to the leaves carrying ``label``.

    ``param_labels`` is a pytree of labels like the params, or a function of the params
    returning one. Every leaf must carry a label present in ``transforms``.
    """
    obj = Partition(transforms, param_labels)
    return GradientTransformation(obj.init, obj.update)
