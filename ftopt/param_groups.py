"""The param groups of :class:`ftopt.Optimizer` stepped as one ``partition``.

Groups whose transforms are the same chain of rules, differing only in hyperparameter
values (AdamW with weight decay 0.1 and 0.0, per-group learning rates), are one
``partition({index: group transform}, labels)`` over the list of the groups' param
trees: the fused backend runs that as one launch per (dtype, state) group instead of one
per param group (:mod:`ftopt.stages`, ``chain_stages(branches=True)``).

Each group keeps its own state tree (over its own params, as torch's ``state_dict``
shows it); the partition's state is built once from the same tensor objects, the
group's per-leaf subtrees widened to the list of all groups with ``None`` where a leaf
is another group's (the layout ``partition``'s ``init`` gives). A donated step writes
in place, so the two views stay the same tensors; the partition, its params tree and
state are re-used while the groups' transforms, params trees and states are the same
objects (a group's params tree is rebuilt where its params change: :class:`ftopt.
group_run.GroupRun`), which a step tests by identity.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import optree
import torch

from ftopt import tree as tree_lib
from ftopt import update
from ftopt._counts import remember_value
from ftopt.base import GradientTransformation
from ftopt.combine import Masked, MaskedState, PartitionState, partition
from ftopt.stages import chain_stages

__all__ = ["GroupJoiner", "JoinedGroups", "fill_live", "join_groups", "live_tensor",
           "name_group", "split_state"]


@dataclass
class JoinedGroups:
    """The partition of some param groups, or why they step one by one (``reason``)."""

    held: tuple  # per group, the (transform, state, params tree) it was built from
    tx: GradientTransformation | None = None
    params: list | None = None  # the groups' param trees, in group order
    state: Any = None  # PartitionState over ``params``, sharing the groups' tensors
    reason: str | None = None

    def holds(self, runs: list) -> bool:
        """Whether the groups still step with the objects the partition was built from."""
        held = self.held
        return len(held) == len(runs) and all(
            tx is run.tx and state is run.state and tree is run.tree
            for (tx, state, tree), run in zip(held, runs))


class GroupJoiner:
    """Steps an optimizer's param groups as one partition, cached in :attr:`joined`."""

    def __init__(self) -> None:
        self.joined: JoinedGroups | None = None

    def step(self, runs: list, groups: list, grads_of: list, backend: str
             ) -> list[int] | None:
        """One donated step of all groups as one partition. Returns the indices of the
        groups whose state it created (to show to torch), or ``None``: the groups step
        one by one (one group, a group with no gradient, transforms that differ in their
        rules, a step that cannot fuse). Bad input raises naming the group, and changes
        nothing. ``runs``: the groups' :class:`ftopt.group_run.GroupRun`."""
        if len(groups) < 2 or backend == "eager":
            return None
        trees = []
        for run, group, grads in zip(runs, groups, grads_of):
            if not any(map(operator.is_not, grads, repeat(None))):
                return None
            trees.append(run.params_tree(group))
        fresh = [i for i, run in enumerate(runs) if run.state is None]
        for i in fresh:
            runs[i].state = runs[i].tx.init(trees[i])
        joined = self.joined
        if joined is None or not joined.holds(runs):
            joined = self.joined = _join(runs, groups, trees, backend)
        if joined.reason is not None:
            for i in fresh:
                runs[i].state = None
            return None
        grad_tree = [dict(zip(names, grads)) if (names := group.get("param_names")) is not None
                     else grads for group, grads in zip(groups, grads_of)]
        try:
            _, state = update.step(joined.tx, joined.params, grad_tree, joined.state,
                                   donate=True, backend=backend)
        except (TypeError, ValueError, RuntimeError) as err:
            for i in fresh:
                runs[i].state = None
            if isinstance(err, RuntimeError):  # cannot fuse: not retried while unchanged
                joined.reason = str(err)
                return None
            # Bad input, found before anything was written: named by group, as the
            # groups' own steps name it.
            raise type(err)(f"ftopt.Optimizer.step: {name_group(str(err))}") from err
        if state is not joined.state and any(
                a is not b for a, b in zip(optree.tree_leaves(state, namespace="ftopt"),
                                           optree.tree_leaves(joined.state,
                                                              namespace="ftopt"))):
            # New state tensors (a path that does not write in place): the groups' own.
            for run, own in zip(runs, split_state(joined, state)):
                run.state = own
            self.joined = None
            return list(range(len(groups)))
        return fresh


def live_tensor(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A group's live hyperparameter tensor holding ``value``, its value mirrored on the
    host (:func:`ftopt._counts.remember_value`): a fused step passes it to the kernel as
    an argument, with no device work, until the tensor is changed in place."""
    t = torch.tensor(float(value), dtype=dtype, device=device)
    remember_value(t, float(value))
    return t


def fill_live(t: torch.Tensor, value: float) -> None:
    """Write a group's new number into its live tensor ``t`` (and the host mirror)."""
    t.fill_(value)
    remember_value(t, float(value))


def _join(runs: list, groups: list, trees: list, backend: str) -> JoinedGroups:
    if backend == "auto" and any(p.device.type == "cpu" for group in groups
                                 for p in group["params"]):
        return JoinedGroups(_held(runs, trees), reason="params on the CPU step eagerly, "
                            "group by group")
    return join_groups(runs, trees)


def _held(runs: list, trees: list) -> tuple:
    return tuple((run.tx, run.state, tree) for run, tree in zip(runs, trees))


def join_groups(runs: list, trees: list) -> JoinedGroups:
    """The partition of the groups ``runs`` (with their states) over ``trees``, the
    groups' params as their transforms see them."""
    held = _held(runs, trees)
    for index, run in enumerate(runs):
        reason = _masks_of(run.tx)
        if reason is not None:
            return JoinedGroups(held, reason=f"param group {index}: {reason}")
    labels = [tree_lib.map(lambda _, i=i: i, tree) for i, tree in enumerate(trees)]
    tx = partition({i: run.tx for i, run in enumerate(runs)}, labels)
    found = chain_stages(tx, branches=True)
    if found.reason is not None:
        return JoinedGroups(held, reason=found.reason)
    holes = [tree_lib.map(lambda _: None, tree) for tree in trees]
    states = {}
    for i, run in enumerate(runs):
        widen = lambda node, i=i: [node if j == i else h for j, h in enumerate(holes)]  # noqa: E731
        states[i] = MaskedState(_map_per_leaf(run.state, trees[i], widen))
    return JoinedGroups(held, tx, list(trees), PartitionState(states))


def split_state(joined: JoinedGroups, state: Any) -> list:
    """The groups' own state trees inside the partition's ``state`` (the inverse of the
    widening in :func:`join_groups`)."""
    return [_map_per_leaf(state.inner_states[i].inner_state, joined.params,
                          lambda node, i=i: node[i]) for i in range(len(joined.params))]


def name_group(message: str) -> str:
    """An error of the joined step, its pytree path (``grad at [1]['0.bias']``: the
    groups' list first) said as the group and the path in it, as a group's own step
    says it."""
    found = re.match(r"(.*? at )\[(\d+)\](.*)", message, re.DOTALL)
    if found is None:
        return f"param groups: {message}"
    head, index, rest = found.groups()
    return f"param group {index}: {head}{rest or '<root>'}"


def _masks_of(tx) -> str | None:
    """Why a group's transform cannot be a branch as it is: a mask sees the params tree,
    which the partition widens to every group's."""
    found = chain_stages(tx, branches=True)
    if found.reason is not None:
        return found.reason
    for stage, selects in zip(found.stages, found.selects):
        if stage.rule.leaf_mask is not None or any(isinstance(s.owner, Masked)
                                                   for s in selects):
            return (f"{stage.rule.name} has a mask (judged on the group's own params "
                    "tree): the group steps on its own")
    return None


def _map_per_leaf(node: Any, params: Any, fn) -> Any:
    """``node`` with every subtree shaped like ``params`` (a per-leaf slot) replaced by
    ``fn(subtree)``; the tensors and containers elsewhere kept."""
    if node is None or isinstance(node, torch.Tensor):
        return node
    if _shaped_like(node, params):
        return fn(node)
    if hasattr(node, "_fields"):
        return type(node)(*(_map_per_leaf(getattr(node, f), params, fn)
                            for f in node._fields))
    if isinstance(node, (tuple, list)):
        return type(node)(_map_per_leaf(x, params, fn) for x in node)
    if isinstance(node, Mapping):
        return type(node)((k, _map_per_leaf(x, params, fn)) for k, x in node.items())
    return node


def _shaped_like(node: Any, params: Any) -> bool:
    if type(node) is not type(params) or len(node) != len(params):
        return False
    return not isinstance(params, dict) or node.keys() == params.keys()
