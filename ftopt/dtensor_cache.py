"""The cached donated step over ``DTensor`` trees (FSDP2 and the like).

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
"""

from __future__ import annotations

import operator
import weakref
from typing import Any

import optree
from torch.distributed.tensor import DTensor

from ftopt import dispatch, shards
from ftopt.combine import owner
from ftopt.rules import QuantizedSlot

__all__ = ["StepCache", "cached_step", "remember"]

_spec_of = operator.attrgetter("_spec")
_local_of = operator.attrgetter("_local_tensor")

# Transform object -> the cache of its last donated DTensor step.
_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _is_slot(x: Any) -> bool:
    return isinstance(x, QuantizedSlot)


def _flatten(tree: Any, is_leaf=None) -> tuple[list, Any]:
    return optree.tree_flatten(tree, is_leaf=is_leaf, none_is_leaf=False, namespace="ftopt")


class StepCache:
    """What a donated DTensor step over the same trees may skip (see the module
    docstring). Built by :meth:`build` from a call that has just run."""

    __slots__ = ("backend", "p_tree", "g_tree", "s_tree", "p_specs", "g_specs",
                 "s_dtensors", "s_specs", "s_absmax", "context", "keys")

    @classmethod
    def build(cls, params, grads, state, backend: str,
              context: shards.LocalShards) -> StepCache | None:
        """The cache of a donated step over these trees, or ``None`` where one does not
        apply (a param or gradient leaf that is not a DTensor, a ``None`` gradient)."""
        self = cls()
        p_leaves, self.p_tree = _flatten(params)
        g_leaves, self.g_tree = _flatten(grads)
        s_leaves, self.s_tree = _flatten(state)
        if not p_leaves or self.g_tree != self.p_tree or not all(
                isinstance(x, DTensor) for x in (*p_leaves, *g_leaves)):
            return None
        self.backend = backend
        self.p_specs = list(map(_spec_of, p_leaves))
        self.g_specs = list(map(_spec_of, g_leaves))
        # State leaves (an 8-bit slot's codes and absmax count as two): the DTensors, and
        # which of them are an absmax (its kernels read a flat view).
        self.s_dtensors = [i for i, x in enumerate(s_leaves) if isinstance(x, DTensor)]
        self.s_specs = [s_leaves[i]._spec for i in self.s_dtensors]
        self.s_absmax = _absmax_positions(state)
        if self.s_absmax is None:
            return None
        # A flat {name: DTensor} dict (named_parameters) is read without a flatten.
        # (optree orders a dict's leaves by sorted key.)
        self.keys = ([path[0] for path in optree.tree_paths(params, none_is_leaf=False,
                                                             namespace="ftopt")]
                     if type(params) is dict and type(grads) is dict
                     and len(params) == len(p_leaves) else None)
        self.context = shards.LocalShards(reduce=context.reduce, agree=context.agree,
                                          splits=context.splits, offset=context.offset)
        return self

    def _leaves(self, tree: Any, spec) -> list | None:
        if self.keys is not None and type(tree) is dict and len(tree) == len(self.keys):
            try:
                return [tree[k] for k in self.keys]
            except KeyError:
                return None
        leaves, found = _flatten(tree)
        return leaves if found == spec else None

    def _local_state(self, state: Any) -> Any:
        """``state`` with its DTensors replaced by their local tensors, or ``None``."""
        leaves, found = _flatten(state)
        if found != self.s_tree:
            return None
        pick = [leaves[i] for i in self.s_dtensors]
        try:
            # (List equality compares by identity first: the same spec objects, the
            # common case, cost no DTensorSpec comparison.)
            if list(map(_spec_of, pick)) != self.s_specs:
                return None
        except AttributeError:  # a leaf is no longer a DTensor
            return None
        for i, local in zip(self.s_dtensors, map(_local_of, pick)):
            leaves[i] = local
        for i in self.s_absmax:
            leaves[i] = leaves[i].view(-1)
        return self.s_tree.unflatten(leaves)

    def run(self, tx, params, grads, state, backend: str):
        """``(params, state)`` after the step, written in place, or ``None``."""
        if backend != self.backend:
            return None
        p_leaves = self._leaves(params, self.p_tree)
        g_leaves = self._leaves(grads, self.g_tree)
        if p_leaves is None or g_leaves is None:
            return None
        try:
            # (List equality compares by identity first: see _local_state.)
            if (list(map(_spec_of, p_leaves)) != self.p_specs
                    or list(map(_spec_of, g_leaves)) != self.g_specs):
                return None
        except AttributeError:  # a leaf is not a DTensor
            return None
        local_state = self._local_state(state)
        if local_state is None:
            return None
        p_local = list(map(_local_of, p_leaves))
        g_local = list(map(_local_of, g_leaves))
        if self.keys is not None:
            local_params, local_grads = dict(zip(self.keys, p_local)), dict(zip(self.keys,
                                                                              g_local))
        else:
            local_params, local_grads = (self.p_tree.unflatten(p_local),
                                         self.g_tree.unflatten(g_local))
        fused = dispatch.backend("fused")
        with shards.local_shards(self.context):
            done = fused.cached_step(tx, local_params, local_grads, local_state, True,
                                     backend)
        return None if done is None else (params, state)


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
