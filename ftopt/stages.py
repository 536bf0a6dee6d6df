"""The elementwise stages of a transform: the rules a chain runs, in order.

Both the one-pass eager step (:mod:`ftopt.eager_step`) and the fused backend
(:mod:`ftopt.lowering`) run a chain as one program over its stages; this module finds
them once per transform.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import optree

from ftopt import tree as tree_lib
from ftopt.combine import Chain, Masked, Partition, SkipZeros, owner
from ftopt.rule_transform import RuleTransform
from ftopt.rules import step_scalars
from ftopt.validate import check_state_class

__all__ = ["Stages", "Select", "Barrier", "chain_stages", "state_at", "with_state_at",
           "check_state_tree", "leaf_selection"]


@dataclass(frozen=True)
class Select:
    """A condition on the leaves a stage applies to: the mask of a ``masked`` (``label``
    unused) or one label of a ``partition``."""

    owner: Any
    label: Any = None


@dataclass(frozen=True)
class Barrier:
    """A matrix stage met while walking ``masked``/``partition`` branches: the stage, its
    ``skip_zeros``, its state path, the conditions on the leaves it applies to and how
    many of them were entered before ``skip`` became true."""

    stage: Any
    skip: bool
    path: tuple
    selects: tuple
    depth: int


@dataclass(frozen=True)
class Stages:
    """The rules of a transform with where their states live, or why it has none.

    ``state_paths[i]`` indexes stage ``i``'s state in the transform's state (tuple indices
    and named_chain names); ``skips[i]`` says whether a ``skip_zeros`` mask applies to it.

    ``matrix``: the chain's matrix stages (:mod:`ftopt.matrix`) as ``(position, stage,
    skip, state_path)``, ``position`` the number of rules (with ``branches=True``: of
    positions) before it. A chain with matrix stages also has a ``reason`` (for a backend
    that runs a chain as one program); the fused backend splits it into elementwise
    segments there instead. Inside ``masked``/``partition`` branches, a matrix stage
    applies to its branch's leaves (``matrix_selects``) and the branches are aligned on
    their last matrix stage (see :func:`_merge_segmented`).
    """

    stages: tuple[RuleTransform, ...] = ()
    state_paths: tuple[tuple, ...] = ()
    skips: tuple[bool, ...] = ()
    reason: str | None = None
    matrix: tuple[tuple[int, Any, bool, tuple], ...] = ()
    segmented: bool = False  # the reason is only the matrix stages
    # With ``branches=True`` (``masked`` and ``partition`` walked into): ``positions[k]``
    # lists the stages (by index) that are alternatives at step ``k`` of the per-element
    # program (one per branch of a partition whose branches are the same chain of rules,
    # differing in hyperparameter values); each leaf runs the one its labels select.
    # ``selects[i]``: the conditions a leaf must meet for stage ``i`` to apply to it;
    # ``flagged[k]``: some leaves pass position ``k`` through (a mask leaves them out, or
    # the position is one of a partition's branches that differ in their rules: those
    # run one after the other, each on its own leaves). ``owner_skips[k]``: the position's
    # ``skip_zeros`` comes from inside the ``masked``/``partition`` branch, so the
    # leaves it passes through keep their update (else they get ``-0.0`` where the raw
    # gradient is zero, as :meth:`ftopt.combine.Masked.update` does).
    positions: tuple[tuple[int, ...], ...] = ()
    selects: tuple[tuple[Select, ...], ...] = ()
    flagged: tuple[bool, ...] = ()
    owner_skips: tuple[bool, ...] = ()
    # With ``branches=True`` and matrix stages inside branches: per entry of ``matrix``
    # (``position`` then counts positions), the conditions on the leaves it applies to.
    matrix_selects: tuple[tuple[Select, ...], ...] = ()
    # With ``injected=True``: the ``inject_hyperparams`` wrappers walked into, as
    # ``(wrapper, state path, inner transform)`` (see :func:`chain_stages`).
    injected: tuple = ()


# Per (branches, injected): transform object -> its Stages.
_CACHES: dict = {key: weakref.WeakKeyDictionary() for key in
                 ((False, False), (True, False), (False, True), (True, True))}


def chain_stages(tx, branches: bool = False, injected: bool = False) -> Stages:
    """The stages of ``tx`` (cached per transform object).

    ``branches=True``: ``masked`` and ``partition`` are walked into (see
    :attr:`Stages.positions`); otherwise they are transforms with no elementwise rule.
    ``injected=True``: an ``inject_hyperparams`` wrapper anywhere in ``tx`` is walked
    into (its inner transform, built with 0-d tensors as hyperparameters, at the state
    path of its ``inner_state``) and listed in :attr:`Stages.injected`: the caller loads
    each wrapper's hyperparameters before the step and advances its count after it (the
    fused backend does; ``ftopt.lowering.entry``).
    """
    obj = owner(tx)
    if obj is None:
        return Stages(reason=f"{_describe(tx)} is not an ftopt transform")
    cache = _CACHES[(branches, injected)]
    found = cache.get(obj)
    if found is not None:
        return found
    if branches:
        found = _branched_stages(tx, injected)
    else:
        stages, paths, skips, matrix = [], [], [], []
        hooks: list | None = [] if injected else None
        reason = _walk(tx, (), False, True, stages, paths, skips, matrix, hooks)
        segmented = reason is None and bool(matrix)
        if segmented:
            reason = (f"{matrix[0][1].name} is a matrix stage (the fused backend runs the "
                      "chain in segments)")
        found = Stages(tuple(stages), tuple(paths), tuple(skips), reason, tuple(matrix),
                       segmented, injected=tuple(hooks or ()))
    cache[obj] = found
    return found


def _injected_inner(obj, path: tuple, hooks: list | None):
    """The inner transform of an ``inject_hyperparams`` wrapper to walk into (recorded in
    ``hooks``), or ``None``: not such a wrapper, not asked for (``hooks`` is ``None``),
    or its inner transform not built for exactly one device (its ``unfused_reason``)."""
    fused_inner = getattr(obj, "fused_inner", None)
    if hooks is None or fused_inner is None:
        return None
    inner = fused_inner()
    if inner is not None:
        hooks.append((obj, path, inner))
    return inner


def _branched_stages(tx, injected: bool = False) -> Stages:
    plain = chain_stages(tx, injected=injected)
    if plain.reason is None or plain.segmented:
        n = len(plain.stages)
        return Stages(plain.stages, plain.state_paths, plain.skips, plain.reason,
                      plain.matrix, plain.segmented, tuple((i,) for i in range(n)),
                      ((),) * n, tuple(s.rule.leaf_mask is not None for s in plain.stages),
                      (False,) * n, injected=plain.injected)
    sources: list = []  # (stage, state path, skip, selects, selects before the skip)
    hooks: list | None = [] if injected else None
    items = _branch_walk(tx, (), False, True, (), sources, hooks=hooks)
    if isinstance(items, str):
        return Stages(reason=items)
    barriers = [x for x in items if isinstance(x, Barrier)]
    for name, skip, selects, depth in [
            *((s[0].rule.name, s[2], s[3], s[4]) for s in sources),
            *((b.stage.name, b.skip, b.selects, b.depth) for b in barriers)]:
        if skip and 0 < depth < len(selects):
            return Stages(reason=f"{name}: skip_zeros between nested masked or partition "
                          "runs eagerly")
    positions, matrix = [], []
    for x in items:
        if isinstance(x, Barrier):
            matrix.append((len(positions), x.stage, x.skip, x.path))
        else:
            positions.append(x)
    stages = tuple(s[0] for s in sources)
    flagged = tuple(_flagged(pos, sources) for pos in positions)
    owner_skips = tuple(any(sources[i][2] and sources[i][3] and sources[i][4] == len(
        sources[i][3]) for i in pos) for pos in positions)
    reason = (f"{barriers[0].stage.name} is a matrix stage (the fused backend runs the "
              "chain in segments)") if barriers else None
    return Stages(stages, tuple(s[1] for s in sources), tuple(s[2] for s in sources), reason,
                  tuple(matrix), bool(barriers), tuple(map(tuple, positions)),
                  tuple(s[3] for s in sources), flagged, owner_skips,
                  tuple(b.selects for b in barriers), tuple(hooks or ()))


def _flagged(pos: list, sources: list) -> bool:
    """Whether some leaves pass position ``pos`` through: a mask (``masked`` or a rule's
    own) leaves them out, or the position's alternatives cover only some labels of a
    partition (branches that differ in their rules, one after the other)."""
    covered: dict = {}
    for i in pos:
        stage, _, _, selects, _ = sources[i]
        if stage.rule.leaf_mask is not None:
            return True
        for cond in selects:
            if isinstance(cond.owner, Masked):
                return True
            covered.setdefault(id(cond.owner), (cond.owner, set()))[1].add(cond.label)
    return any(labels != set(obj.labels) for obj, labels in covered.values())


def _branch_walk(tx, path: tuple, skip: bool, at_input: bool, selects: tuple,
                 sources: list, depth: int = 0, hooks: list | None = None):
    """The positions of ``tx``'s program (lists of stage indices) with a :class:`Barrier`
    at each matrix stage, or why it has none. ``depth``: how many of ``selects`` were
    entered before ``skip`` became true; ``hooks``: see :func:`_injected_inner`."""
    obj = owner(tx)
    inner = _injected_inner(obj, path, hooks)
    if inner is not None:  # (its inner_state: field obj.inner_field of its state)
        return _branch_walk(inner, (*path, obj.inner_field), skip, at_input, selects,
                            sources, depth, hooks)
    if isinstance(obj, RuleTransform):
        sources.append((obj, path, skip, selects, depth))
        return [[len(sources) - 1]]
    if isinstance(obj, SkipZeros):
        return []
    if isinstance(obj, Chain):
        if obj.skip_zeros and not skip and not at_input:
            return "skip_zeros in a nested chain that does not receive the raw gradient"
        out = []
        if obj.skip_zeros and not skip:
            depth = len(selects)
        for i, child in enumerate(obj.transforms):
            key = obj.names[i] if obj.names is not None else i
            found = _branch_walk(child, (*path, key), skip or obj.skip_zeros,
                                 at_input and i == 0, selects, sources, depth, hooks)
            if isinstance(found, str):
                return found
            out += found
        return out
    if isinstance(obj, Masked):
        return _branch_walk(obj.inner, (*path, 0), skip, at_input, (*selects, Select(obj)),
                            sources, depth, hooks)
    if isinstance(obj, Partition):
        branches = []
        for label in obj.labels:
            found = _branch_walk(obj.user_transforms[label], (*path, 0, label, 0), skip,
                                 at_input, (*selects, Select(obj, label)), sources, depth,
                                 hooks)
            if isinstance(found, str):
                return found
            branches.append(found)
        if any(isinstance(x, Barrier) for b in branches for x in b):
            return _merge_segmented(branches, sources, obj.labels)
        return _merge(branches, sources, obj.labels)
    if getattr(obj, "matrix_stage", False):
        return [Barrier(obj, skip, path, selects, depth)]
    reason = getattr(obj, "unfused_reason", None)
    if reason:
        return reason
    name = type(obj).__name__ if obj is not None else _describe(tx)
    return f"{name} has no elementwise rule"


def _shape_of(source) -> tuple:
    """What must agree for stages to share a position (hyperparameter values need not)."""
    stage, _, skip, selects, depth = source
    rule = stage.rule
    return (rule.name, _body_key(rule.body), rule.slots, tuple(step_scalars(rule, 0, 1)),
            rule.uses_params, stage.quant, stage.store, skip, depth == len(selects))


def _body_key(body) -> tuple:
    """A body's code and the values it closes over (static options such as ``nesterov``):
    two bodies with equal keys trace to the same program."""
    cells = tuple(c.cell_contents for c in getattr(body, "__closure__", None) or ())
    return (getattr(body, "__code__", body), cells)


def _merge(branches: list, sources: list, labels: list):
    """A partition's positions: branches that are the same chain of rules (other
    hyperparameter values) share positions, a leaf picking its branch's scalars; such
    classes of branches that differ in their rules follow one another, each position
    flagged to pass the other classes' leaves through."""
    classes: dict = {}  # shape -> the branches (positions) of that chain of rules
    for b in branches:
        shape = tuple(tuple(_shape_of(sources[i]) for i in pos) for pos in b)
        classes.setdefault(shape, []).append(b)
    return [[i for b in members for i in b[k]] for members in classes.values()
            for k in range(len(members[0]))]


def _merge_segmented(branches: list, sources: list, labels: list) -> list:
    """A partition whose branches hold matrix stages: each branch split at its matrix
    stages (consecutive ones kept together) into pieces, the pieces aligned on the last
    (a branch with fewer matrix stages starts later: a branch with none runs whole in the
    last segment, where the others finish) and merged piece by piece as :func:`_merge`
    does, the matrix stages of every branch at the same place between them (each applies
    to its own branch's leaves)."""
    split = [_pieces(b) for b in branches]
    n = max(len(groups) for _, groups in split)
    pieces: list = [[] for _ in range(n + 1)]
    groups: list = [[] for _ in range(n)]
    for own_pieces, own_groups in split:
        offset = n - len(own_groups)
        for j, piece in enumerate(own_pieces):
            if piece:
                pieces[offset + j].append(piece)
        for j, group in enumerate(own_groups):
            groups[offset + j] += group
    out: list = []
    for k in range(n + 1):
        out += _merge(pieces[k], sources, labels)
        if k < n:
            out += groups[k]
    return out


def _pieces(items: list) -> tuple[list, list]:
    """``items`` (positions and :class:`Barrier`) as pieces of positions and the groups
    of consecutive barriers between them (one piece more than groups)."""
    pieces: list = [[]]
    groups: list = []
    for x in items:
        if not isinstance(x, Barrier):
            pieces[-1].append(x)
        elif groups and not pieces[-1]:
            groups[-1].append(x)
        else:
            groups.append([x])
            pieces.append([])
    return pieces, groups


def leaf_selection(selects: tuple, params: Any, n: int) -> list[bool]:
    """Whether a stage with these conditions applies to each of the ``n`` leaves of
    ``params`` (each condition judged on the tree its transform's eager ``update`` sees:
    the params, less the leaves the conditions before it left out). Where ``params`` is
    an update's tree with ``None`` leaves counted in ``n`` (an update without params: the
    conditions see the updates, as eager's do), those leaves are not selected."""
    every = optree.tree_leaves(params, none_is_leaf=True, namespace="ftopt")
    missing = sum(x is None for x in every)
    if missing and len(every) == n:
        held = iter(leaf_selection(selects, params, n - missing))
        return [x is not None and next(held) for x in every]
    keep = [True] * n
    for cond in selects:
        spec = tree_lib.structure(params)
        paths, _, _ = tree_lib.flatten_with_paths(params)
        tree = tree_lib.unflatten(spec, [p if k else None for p, k in zip(
            spec.flatten_up_to(params), keep)]) if not all(keep) else params
        if isinstance(cond.owner, Partition):
            cond.owner._check(tree)
            labels = cond.owner._labels_of(tree)
            mask = tree_lib.map(lambda lab, label=cond.label: lab == label, labels)
        else:
            mask = cond.owner._mask_for(tree)
        flat = tree_lib.flatten_like(spec, mask, "mask", paths)
        keep = [k and bool(m) for k, m in zip(keep, flat)]
    return keep


def _describe(tx) -> str:
    fn = getattr(tx.update, "__qualname__", None) or repr(tx.update)
    return f"transform {fn!r}"


def _walk(tx, path: tuple, skip: bool, at_input: bool, stages: list, paths: list,
          skips: list, matrix: list, hooks: list | None = None) -> str | None:
    obj = owner(tx)
    inner = _injected_inner(obj, path, hooks)
    if inner is not None:
        return _walk(inner, (*path, obj.inner_field), skip, at_input, stages, paths, skips,
                     matrix, hooks)
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
                           paths, skips, matrix, hooks)
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
    if isinstance(state, dict):  # OrderedDict (named_chain) or dict (partition)
        new = type(state)(state)
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
    elif isinstance(obj, Masked):
        obj.check_state(state)
        check_state_tree(owner(obj.inner), state.inner_state)
    elif isinstance(obj, Partition):
        obj.check_state(state)
        for label, t in obj.inner.items():
            check_state_tree(owner(t), state.inner_states[label])
