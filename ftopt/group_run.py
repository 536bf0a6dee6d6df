"""One param group of :class:`ftopt.Optimizer`: its transform, its live hyperparameters
and its params tree, with the per-step test of whether any of them changed.

A factory builds a group's transform once, with every float hyperparameter (``lr``,
``betas``, ``weight_decay``, ...) as a 0-d "live" tensor (:func:`ftopt.param_groups.
live_tensor`); a step copies the group's current numbers into those tensors, and a change
of any other hyperparameter rebuilds the transform. Checking and copying every value of
every group costs host time on each step, while most steps change nothing, or only the
``lr`` that a torch scheduler writes (as a new Python float). So a group remembers the
objects it last checked and copied in (:meth:`GroupRun.remember`); the next step compares
them by identity, in one C-level pass (:meth:`GroupRun.changed`), and checks and copies
only the keys whose objects differ. A value that can change in place (a tensor, a list
of betas) is checked and copied on every step. Fixed values are compared by identity as
before: a mask tree changed in place keeps the transform built from it.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from itertools import compress
from typing import Any

import torch

from ftopt import param_groups
from ftopt._counts import remember_value
from ftopt.base import GradientTransformation, check_transform
from ftopt.combine import update_keywords

__all__ = ["GroupRun", "Lane", "NUMERIC", "check_number", "is_live", "params_tree"]

# Hyperparameters that must be real numbers >= 0 when a group holds them (torch's and
# ftopt's names); checked before each step where they changed (schedulers write them).
_NONNEG = frozenset({"lr", "weight_decay", "eps", "eps_root", "momentum", "decay", "alpha",
                     "b3", "initial_scale", "initial_accumulator_value"})
NUMERIC = _NONNEG | {"betas"}
_is, _is_not = operator.is_, operator.is_not


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_live(key: str, v: Any) -> bool:
    """Held as a tensor that the transform reads: float hyperparameters (and numbers under
    a known float name, ``lr=1``), and ``betas`` of numbers."""
    if key == "betas":
        return isinstance(v, (tuple, list)) and len(v) in (2, 3) and all(map(_is_number, v))
    return isinstance(v, float) or (key in NUMERIC and _is_number(v))


def params_tree(group: dict) -> Any:
    """The group's params as its transform sees them: a dict by name, or a list."""
    names = group.get("param_names")
    return dict(zip(names, group["params"])) if names is not None else list(group["params"])


class GroupRun:
    """What a param group steps with: its transform, the live hyperparameter tensors it
    was built with, its state tree (``None`` before the first step), the non-live
    hyperparameters it was built from (a change rebuilds the transform) and its params
    tree (the same object while the group's params and names are)."""

    def __init__(self, keys: tuple[str, ...]):
        self.keys = keys  # the group's hyperparameters, handed to the factory
        self.tx: GradientTransformation | None = None
        self.reads: frozenset[str] = frozenset()  # the update keywords it needs (value=)
        self.live: dict[str, Any] = {}
        self.fixed: dict[str, Any] = {}
        self.copied: dict[tuple, Any] = {}  # the values last copied into ``live``
        self.state: Any = None
        # The group's values (by ``keys``) at the last check (``None``: check them all on
        # the next step), and the live keys checked on every step (see remember).
        self.seen: tuple | None = None
        self._always: tuple = ()
        self._values = (operator.itemgetter(*keys) if len(keys) > 1 else
                        (lambda group, key=keys[0]: (group[key],)) if keys else
                        (lambda group: ()))
        self.tree: Any = None
        self._tree_of: tuple = ((), None)  # the params and names ``tree`` was built from

    # -- hyperparameters ---------------------------------------------------------------

    def build(self, group: dict, factory: Callable | None, tx: Any, where: str) -> None:
        """(Re)build the transform from the group's hyperparameters (``tx``, as is, where
        there is no factory)."""
        self.seen = None
        if factory is None:
            self.tx, self.reads = tx, update_keywords(tx)
            return
        devices = {p.device for p in group["params"]}
        # Params on several devices: CPU scalars, which ops on any device accept.
        device = devices.pop() if len(devices) == 1 else torch.device("cpu")
        dtype = torch.float32 if device.type == "mps" else torch.float64
        live, fixed, kwargs, copied = {}, {}, {}, {}
        for key in self.keys:
            value = group[key]
            if is_live(key, value):
                check_number(where, key, value)
                copied.update({(key, i): v for i, v in
                               enumerate(value if key == "betas" else (value,))})
                live[key] = (tuple(param_groups.live_tensor(v, dtype, device)
                                   for v in value) if key == "betas"
                             else param_groups.live_tensor(value, dtype, device))
                value = live[key]
            else:
                fixed[key] = value
            if key == "lr":
                kwargs["learning_rate"] = value
            elif key == "betas":
                kwargs.update(zip(("b1", "b2", "b3"), value))
            else:
                kwargs[key] = value
        try:
            built = factory(**kwargs)
        except (TypeError, ValueError) as err:
            renamed = ", ".join(n for k, n in (("lr", "lr as learning_rate"),
                                               ("betas", "betas as b1, b2"))
                                if k in self.keys)
            raise type(err)(f"{where}: the factory {_name(factory)} rejected the "
                            f"group's hyperparameters {sorted(self.keys)} (passed as "
                            f"keywords{', ' + renamed if renamed else ''}): {err}") from err
        check_transform(built, f"{where}: the factory {_name(factory)} returned")
        self.tx, self.live, self.fixed, self.copied = built, live, fixed, copied
        self.reads = update_keywords(built)

    def changed(self, group: dict) -> tuple:
        """The keys whose values are not the very objects :meth:`remember` saw (one
        C-level pass where none changed; a scheduler's new ``lr`` is a new float object, a
        changed ``betas`` a new tuple), with those that can change in place; all keys
        before the first :meth:`remember`."""
        seen, values = self.seen, self._values(group)
        if seen is None:
            return self.keys
        if all(map(_is, values, seen)):
            return self._always
        found = tuple(compress(self.keys, map(_is_not, values, seen)))
        if self._always:
            found += tuple(k for k in self._always if k not in found)
        return found

    def refresh(self, group: dict, keys: tuple, factory: Callable | None,
                where: str) -> tuple | None:
        """Check the group's hyperparameters ``keys`` (:meth:`changed`); rebuild the
        transform if a fixed one (or the kind of a live one) changed. The live keys whose
        values must be copied in, or ``None`` where the transform was rebuilt from them."""
        if factory is None:
            return ()
        fixed, live = self.fixed, self.live
        copy = []
        for key in keys:
            value = group[key]
            if type(value) is float and key in live and key != "betas":
                # (a scheduler's new number: checked here, copied in by copy_live)
                if not math.isfinite(value) or (value < 0 and key in NUMERIC):
                    check_number(where, key, value)
                copy.append(key)
                continue
            if key in live:
                if not _fits(key, value, live[key]):
                    break
                copy.append(key)
            elif not _same(value, fixed[key]):
                break
        else:
            for key in copy:
                value = group[key]
                if type(value) is not float and (key == "betas"
                                                 or not isinstance(value, torch.Tensor)):
                    check_number(where, key, value)
            return tuple(copy)
        self.build(group, factory, None, where)
        return None

    def copy_live(self, group: dict, keys: tuple, deferred: dict | None = None) -> None:
        """The group's current values of the live ``keys`` into their tensors (skipped
        where unchanged). ``deferred``: a plain float (a scheduler's new number) is only
        recorded as the tensor's host value, and put in ``deferred`` as ``{id(tensor):
        (tensor, value)}``: the caller writes it (:func:`ftopt.param_groups.fill_live`)
        before anything reads the tensor on its device."""
        copied = self.copied
        for key in keys:
            held, value = self.live[key], group[key]
            if type(value) is float and key != "betas":  # (a scheduler's new number)
                if copied.get((key, 0)) != value:
                    if deferred is None:
                        param_groups.fill_live(held, value)
                    else:
                        remember_value(held, value)
                        deferred[id(held)] = (held, value)
                    copied[(key, 0)] = value
                continue
            pairs = zip(held, value) if key == "betas" else ((held, value),)
            for i, (t, v) in enumerate(pairs):
                if deferred:  # (written now: a number left for later is stale)
                    deferred.pop(id(t), None)
                if isinstance(v, torch.Tensor):
                    t.copy_(v)
                    self.copied.pop((key, i), None)
                elif self.copied.get((key, i)) != v:
                    param_groups.fill_live(t, v)
                    self.copied[(key, i)] = v

    def remember(self, group: dict, keys: tuple) -> None:
        """The group's values of ``keys`` (:meth:`changed`; the others are the objects
        seen before) are checked and in the live tensors: the next step skips both for
        the keys that hold the same objects (a live value that can change in place, a
        tensor or a list, is checked and copied on every step)."""
        if self.seen is None:  # (first, or rebuilt: every key)
            keys = self.keys
        self.seen = self._values(group)
        live = self.live
        self._always = tuple([key for key in keys if key in live and type(group[key]) is not float
                              and _in_place(key, group[key])])

    # -- params ------------------------------------------------------------------------

    def params_tree(self, group: dict) -> Any:
        """:func:`params_tree` of the group, the same object while the group holds the
        same params (by identity, one C-level pass) and names (strings: compared by value,
        in C)."""
        params, names = group["params"], group.get("param_names")
        seen_params, seen_names = self._tree_of
        if (self.tree is None or len(params) != len(seen_params)
                or not all(map(_is, params, seen_params)) or names != seen_names):
            self.tree = params_tree(group)
            self._tree_of = (tuple(params), None if names is None else list(names))
        return self.tree


class Lane:
    """All of an optimizer's groups stepped as donated fused steps (their partition, or
    each group's own), bound to their param and state tensors (``bounds``: the fused
    backend's ``bind_step``), and the objects they were bound over: while every group
    steps with the same transform, state tree and params tree (the params by identity,
    see :meth:`GroupRun.params_tree`), and the groups' partition is the same
    (``source``), a step only reads the gradients and hands them to ``bounds``, which
    check every tensor before any launches."""

    __slots__ = ("held", "source", "bounds")

    def __init__(self, runs: list, source: Any, bounds: tuple):
        self.held = tuple((run.tx, run.state, run.tree) for run in runs)
        self.source, self.bounds = source, bounds

    def holds(self, runs: list, groups: list, source: Any) -> bool:
        """Whether the groups still step with the objects the lane was bound over."""
        if source is not self.source or len(runs) != len(self.held):
            return False
        for run, group, (tx, state, tree) in zip(runs, groups, self.held):
            if run.tx is not tx or run.state is not state or run.params_tree(group) is not tree:
                return False
        return True


def _in_place(key: str, value: Any) -> bool:
    """A live value that can change without a new object in the group: a tensor, a list
    (of betas), betas holding a tensor."""
    return isinstance(value, (torch.Tensor, list)) or (
        key == "betas" and any(isinstance(b, torch.Tensor) for b in value))


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # a value without a plain equality (a mask tree of tensors)
        return False


def _is_scalar_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point()


def _fits(key: str, value: Any, held: Any) -> bool:
    """``value`` can be copied into the live tensor(s) ``held``."""
    if key == "betas":
        return (isinstance(value, (tuple, list)) and len(value) == len(held)
                and all(_is_number(v) or _is_scalar_tensor(v) for v in value))
    return _is_number(value) or _is_scalar_tensor(value)


def check_number(where: str, key: str, value: Any) -> None:
    """A live hyperparameter's value: finite, >= 0 under a known name, betas below 1
    (a tensor is the caller's: not read, so no device synchronisation)."""
    values = value if key == "betas" else (value,)
    for v in values:
        if isinstance(v, torch.Tensor):
            continue
        if not _is_number(v) or not math.isfinite(v):
            raise ValueError(f"{where}: {key} must be a finite number, got {value!r}")
        if key in NUMERIC and v < 0:
            raise ValueError(f"{where}: {key} must be >= 0, got {value!r}")
    if key == "betas" and any(_is_number(b) and b >= 1 for b in values[:2]):
        raise ValueError(f"{where}: betas[0] and betas[1] must be < 1, got {value!r}")


def _name(factory: Callable) -> str:
    return getattr(factory, "__qualname__", None) or repr(factory)
