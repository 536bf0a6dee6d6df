"""Cached steps and updates over ``DTensor`` trees (FSDP2 and the like).

A full DTensor step (:mod:`ftopt.distributed`) flattens the trees with their paths,
checks every leaf's placements, unwraps each DTensor, builds the norm reducers and wraps
the results again: tens of microseconds a leaf, milliseconds a step for a model of a
hundred leaves, while the kernels take microseconds. A training loop gives the same
DTensors (params, states) and gradients laid out the same way at every step, so after a
donated fused step the distributed backend keeps, per transform, a :class:`StepCache`:

* the tree structures of params, grads and state, and each DTensor leaf's spec (mesh,
  placements, global shape, stride and dtype);
* the :class:`ftopt.shards.LocalShards` context of that call (its norm reducer, rank
  agreement and per-path splits depend on nothing else).

The next donated step checks the trees against it (one flatten each, the specs by
identity, else by equality), takes each leaf's local tensor (the ``_local_tensor``
attribute: no autograd, no view), and hands the local trees to the fused backend's own
cached step, which checks every local tensor's pointer, shape, strides and dtype against
its tables as it does for plain tensors (so a param whose storage FSDP2 swapped, or a
state leaf replaced by another tensor, sends the call to the full path). The step writes
the local tensors in place, so the given trees are returned: the same DTensor objects,
no rewrap. Anything that does not fit returns ``None`` and the full path runs (and
builds a new cache). The cache holds no tensor, so it keeps no memory alive.

A non-donated step and ``tx.update`` make new tensors, so they keep a
:class:`CallCache` (per transform and kind) after a full call: the same checks of the
trees and specs, then the inner call on the local tensors in the cached context (the
fused tables of the local trees, or eager, as the full path would run it), and each new
local tensor wrapped as a DTensor on the spec of the leaf it replaces (the given one's,
where the dtype and local shape are the same: a fp32 update of a bf16 gradient gets a
spec of its own), with no ``from_local``: about 2 us a leaf instead of 50.
"""

from __future__ import annotations

import operator
import weakref
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor

from ftopt import dispatch, shards
from ftopt.combine import owner
from ftopt.rules import QuantizedSlot

__all__ = ["StepCache", "CallCache", "cached_step", "remember", "cached_call",
           "remember_call", "as_dtensor", "dtensor_of_spec"]

_spec_of = operator.attrgetter("_spec")
_local_of = operator.attrgetter("_local_tensor")

# Transform object -> the cache of its last donated DTensor step.
_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# "step" (non-donated) or "update" -> transform object -> the cache of its last call.
_CALLS: dict[str, weakref.WeakKeyDictionary] = {
    "step": weakref.WeakKeyDictionary(), "update": weakref.WeakKeyDictionary()}


def _is_slot(x: Any) -> bool:
    return isinstance(x, QuantizedSlot)


def _flatten(tree: Any, is_leaf=None) -> tuple[list, Any]:
    return optree.tree_flatten(tree, is_leaf=is_leaf, none_is_leaf=False, namespace="ftopt")


class _TreesCache:
    """The trees of a DTensor call and each DTensor leaf's spec (see the module
    docstring): ``trees`` are trees of DTensor leaves of one structure (params and
    grads; updates and params, the params possibly ``None``), ``state`` any tree."""

    __slots__ = ("backend", "tree", "specs", "s_tree", "s_dtensors", "s_specs", "s_absmax",
                 "context", "keys")

    def _build(self, trees: tuple, state, backend: str,
               context: shards.LocalShards) -> bool:
        """Fill the cache from a call that has just run; False where one does not apply
        (a leaf of ``trees`` that is not a DTensor, a ``None`` gradient)."""
        first, self.tree = _flatten(trees[0])
        if not first:
            return False
        self.specs = []
        for t in trees:
            if t is None:
                self.specs.append(None)
                continue
            leaves, found = _flatten(t)
            if found != self.tree or not all(isinstance(x, DTensor) for x in leaves):
                return False
            self.specs.append(list(map(_spec_of, leaves)))
        s_leaves, self.s_tree = _flatten(state)
        self.backend = backend
        # State leaves (an 8-bit slot's codes and absmax count as two): the DTensors, and
        # which of them are an absmax (its kernels read a flat view).
        self.s_dtensors = [i for i, x in enumerate(s_leaves) if isinstance(x, DTensor)]
        self.s_specs = [s_leaves[i]._spec for i in self.s_dtensors]
        self.s_absmax = _absmax_positions(state)
        if self.s_absmax is None:
            return False
        # A flat {name: DTensor} dict (named_parameters) is read without a flatten.
        # (optree orders a dict's leaves by sorted key.)
        dicts = all(type(t) is dict for t in trees if t is not None)
        self.keys = ([path[0] for path in optree.tree_paths(trees[0], none_is_leaf=False,
                                                             namespace="ftopt")]
                     if dicts and len(trees[0]) == len(first) else None)
        self.context = shards.LocalShards(reduce=context.reduce, agree=context.agree,
                                          splits=context.splits, offset=context.offset,
                                          shapes=context.shapes, as_global=context.as_global)
        return True

    def _leaves(self, tree: Any) -> list | None:
        if self.keys is not None and type(tree) is dict and len(tree) == len(self.keys):
            try:
                return [tree[k] for k in self.keys]
            except KeyError:
                return None
        leaves, found = _flatten(tree)
        return leaves if found == self.tree else None

    def _unflatten(self, leaves: list) -> Any:
        return (dict(zip(self.keys, leaves)) if self.keys is not None
                else self.tree.unflatten(leaves))

    def _dtensor_leaves(self, trees: tuple) -> list | None:
        """The DTensor leaves of each of ``trees`` (``None`` for a ``None`` tree), or
        ``None`` where a tree or a spec differs from the cached call's."""
        out = []
        for tree, specs in zip(trees, self.specs):
            if (tree is None) != (specs is None):
                return None
            if tree is None:
                out.append(None)
                continue
            leaves = self._leaves(tree)
            if leaves is None:
                return None
            try:
                # (List equality compares by identity first: the same spec objects, the
                # common case, cost no DTensorSpec comparison.)
                if list(map(_spec_of, leaves)) != specs:
                    return None
            except AttributeError:  # a leaf is not a DTensor
                return None
            out.append(leaves)
        return out

    def _state_leaves(self, state: Any) -> list | None:
        """The leaves of ``state`` with its DTensors replaced by their local tensors (an
        absmax by a flat view), or ``None``."""
        leaves, found = _flatten(state)
        if found != self.s_tree:
            return None
        pick = [leaves[i] for i in self.s_dtensors]
        try:
            if list(map(_spec_of, pick)) != self.s_specs:  # (see _dtensor_leaves)
                return None
        except AttributeError:  # a leaf is no longer a DTensor
            return None
        for i, local in zip(self.s_dtensors, map(_local_of, pick)):
            leaves[i] = local
        for i in self.s_absmax:
            leaves[i] = leaves[i].view(-1)
        return leaves


class StepCache(_TreesCache):
    """What a donated DTensor step over the same trees may skip (see the module
    docstring). Built by :meth:`build` from a call that has just run."""

    __slots__ = ()

    @classmethod
    def build(cls, params, grads, state, backend: str,
              context: shards.LocalShards) -> StepCache | None:
        """The cache of a donated step over these trees, or ``None`` where one does not
        apply (a param or gradient leaf that is not a DTensor, a ``None`` gradient)."""
        self = cls()
        return self if self._build((params, grads), state, backend, context) else None

    def run(self, tx, params, grads, state, backend: str):
        """``(params, state)`` after the step, written in place, or ``None``."""
        if backend != self.backend:
            return None
        found = self._dtensor_leaves((params, grads))
        if found is None:
            return None
        s_leaves = self._state_leaves(state)
        if s_leaves is None:
            return None
        local_params, local_grads = (self._unflatten(list(map(_local_of, leaves)))
                                     for leaves in found)
        fused = dispatch.backend("fused")
        with shards.local_shards(self.context):
            done = fused.cached_step(tx, local_params, local_grads,
                                     self.s_tree.unflatten(s_leaves), True, backend)
        return None if done is None else (params, state)


class CallCache(_TreesCache):
    """A non-donated step or an update over the DTensor trees of the last one: the
    inner call runs on the local tensors in the cached context (fused tables or eager,
    as it would), and its new tensors are wrapped on the given leaves' specs."""

    __slots__ = ("extra",)

    @classmethod
    def build(cls, trees: tuple, state, backend: str, context: shards.LocalShards,
              extra: dict | None = None) -> CallCache | None:
        """``trees``: ``(params, grads)`` of a step, ``(updates, params)`` of an update."""
        self = cls()
        self.extra = dict(extra or {})
        return self if self._build(trees, state, backend, context) else None

    def run(self, trees: tuple, state, backend: str, inner, extra: dict | None = None):
        """``inner(local trees..., local state) -> (new first tree, new state)`` on the
        local tensors, wrapped again; or ``None`` (then nothing ran)."""
        if backend != self.backend or (extra or {}) != self.extra:
            return None
        found = self._dtensor_leaves(trees)
        if found is None:
            return None
        s_leaves = self._state_leaves(state)
        if s_leaves is None:
            return None
        locals_ = [None if leaves is None else list(map(_local_of, leaves))
                   for leaves in found]
        with shards.local_shards(self.context):
            new, new_state = inner(*[None if x is None else self._unflatten(x)
                                     for x in locals_], self.s_tree.unflatten(s_leaves))
        out = self._leaves(new)
        new_leaves, found_tree = _flatten(new_state)
        if out is None or found_tree != self.s_tree:
            return None  # (a state that changed shape: the full path wraps it; pure)
        wrapped = [given if x is local else as_dtensor(x, given)
                   for x, local, given in zip(out, locals_[0], found[0])]
        state_leaves = _flatten(state)[0]
        for i in self.s_dtensors:
            x, given = new_leaves[i], state_leaves[i]
            if x is s_leaves[i]:
                new_leaves[i] = given
                continue
            if i in self.s_absmax:
                x = x.view(given._local_tensor.shape)
            new_leaves[i] = as_dtensor(x, given)
        return self._unflatten(wrapped), self.s_tree.unflatten(new_leaves)


def as_dtensor(local: torch.Tensor, like: DTensor) -> DTensor:
    """``local`` as a shard of a DTensor laid out as ``like`` (no collective)."""
    if (local.dtype == like.dtype and not local.requires_grad
            and local.shape == like._local_tensor.shape):
        # The same spec (mesh, placements, global shape, stride and dtype): what
        # ``from_local`` would build, without its autograd function and spec checks
        # (~50 us a leaf; this, ~2 us: the constructor's ``__init__`` adds nothing).
        return DTensor.__new__(DTensor, local, like._spec, requires_grad=False)
    return dtensor_of_spec(local, like._spec)


def dtensor_of_spec(local: torch.Tensor, spec: Any) -> DTensor:
    """``local`` as a shard of a DTensor laid out as ``spec`` (a ``DTensorSpec``: mesh,
    placements, global shape and stride; no collective), in ``local``'s dtype."""
    return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False,
                              shape=spec.shape, stride=spec.stride)


def _absmax_positions(state: Any) -> list[int] | None:
    """Where the absmax of each 8-bit DTensor slot sits among the leaves of ``state``
    (``None`` if a slot mixes DTensors and plain tensors: the full path refuses it)."""
    out, position = [], 0
    for leaf in _flatten(state, _is_slot)[0]:
        if _is_slot(leaf):
            kinds = {isinstance(t, DTensor) for t in leaf}
            if len(kinds) > 1:
                return None
            if kinds == {True}:
                out.append(position + 1)
            position += 2
        else:
            position += 1
    return out


def remember(tx, params, grads, state, backend: str, context: shards.LocalShards) -> None:
    """After a donated DTensor step that ran fused: cache it for the next one (or forget
    an older cache where this call's trees do not fit one)."""
    obj = owner(tx)
    if obj is None:
        return
    fused = dispatch.backend("fused")
    cache = None
    if fused is not None and fused.has_prepared_step(tx, backend):
        cache = StepCache.build(params, grads, state, backend, context)
    if cache is None:
        _CACHES.pop(obj, None)
    else:
        _CACHES[obj] = cache


def cached_step(tx, params, grads, state, backend: str):
    """The donated step over the DTensors of the last one (see the module docstring):
    ``(params, state)``, written in place, or ``None``."""
    obj = owner(tx)
    cache = _CACHES.get(obj) if obj is not None else None
    if cache is not None and shards.on_local_shards():
        return None  # (the full path's step over the local tensors)
    return None if cache is None else cache.run(tx, params, grads, state, backend)


def remember_call(kind: str, obj, trees: tuple, state, backend: str,
                  context: shards.LocalShards, extra: dict | None = None) -> None:
    """After a non-donated DTensor step (``kind="step"``, ``trees=(params, grads)``) or
    an update (``"update"``, ``(updates, params)``) of the transform object ``obj``:
    cache its trees for the next one (or forget an older cache)."""
    if obj is None:
        return
    caches = _CALLS[kind]
    if extra and set(extra) - {"backend"}:
        cache = None  # (other keywords: values the cache would have to compare)
    else:
        cache = CallCache.build(trees, state, backend, context, extra)
    if cache is None:
        caches.pop(obj, None)
    else:
        caches[obj] = cache


def cached_call(kind: str, obj, trees: tuple, state, backend: str, inner,
                extra: dict | None = None):
    """The non-donated step or the update over DTensor trees laid out as the last one's
    (see :class:`CallCache`): its result, or ``None`` (nothing ran)."""
    cache = _CALLS[kind].get(obj) if obj is not None else None
    if cache is None or shards.on_local_shards():
        return None
    return cache.run(trees, state, backend, inner, extra)
