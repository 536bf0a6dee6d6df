"""Measurements of the updates kept in the state (optax's ``snapshot``, ``monitor`` and
``measure_with_ema``): a chain's intermediate values, read back with
``ftopt.tree.get(state, name)``.

``snapshot(name, measure)`` and ``monitor({name: measure, ...})`` pass the updates through
and store each measure of them in their state; a measure is a function of the updates
tree (``ftopt.tree.norm``) or, in ``monitor``, a transform whose update gives the
measurement from the updates (``measure_with_ema(fn, decay)``: an exponential moving
average of ``fn``'s value). Both are matrix stages (:mod:`ftopt.matrix`): in a chain that
otherwise fuses, the fused backend runs the stages before them as one fused segment, the
measures on its output with torch ops, and the stages after them as another, so
monitoring a chain does not send it to the eager path.

On DTensor leaves (FSDP2 and the like, :mod:`ftopt.distributed`) a step runs on each
rank's shards; a measure still sees whole leaves, as DTensors (torch's DTensor ops
communicate where the math reads across shards), and its value is kept in full on every
rank.

What a measure sees is what the stage passes on: the incoming updates in their compute
dtype (fp32 for fp16 and bf16 leaves), and in a ``skip_zeros`` chain ``-0.0`` where the raw
gradient is zero (SPEC §3: a reduction sees the masked update), on both backends.

The state has one structure from ``init`` on: a function's measurement starts as its
value on the params (as optax's ``snapshot``), a transform's as zeros of its value's
shape (optax's ``monitor`` starts with no measurements; a fixed structure lets a state
be checkpointed, loaded and donated at any step). A measure must keep the structure
and shapes of its measurement from step to step; its values are stored in the dtypes of
the first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from ftopt import shards
from ftopt import tree as tree_lib
from ftopt.base import GradientTransformation, check_transform, register_owner, register_state
from ftopt.matrix import check_shards, checked_call
from ftopt.program import skip_update
from ftopt.rules import check_param, compute_dtype
from ftopt.transforms.momentum import ema

__all__ = ["SnapshotState", "MonitorState", "snapshot", "monitor", "measure_with_ema"]

Measure = Callable[[Any], Any]


@register_state
class SnapshotState(NamedTuple):
    """``measurement``: ``{name: the measure of the last updates}``."""

    measurement: dict[str, Any]


@register_state
class MonitorState(NamedTuple):
    """``measurements``: ``{name: measurement}``; ``measure_states``: the states of the
    measures that are transforms, in the order of their names (functions keep none)."""

    measurements: dict[str, Any]
    measure_states: tuple


def _always(leaf: Any) -> bool:
    return True


def _as_tensors(value: Any, device: torch.device | None) -> Any:
    """``value`` with each Python number a 0-d tensor (on ``device``) and each DTensor
    its full value (a measure of sharded leaves: the same on every rank)."""
    return tree_lib.map(lambda x: shards.full_value(x) if isinstance(x, torch.Tensor)
                        else torch.as_tensor(x, device=device), value)


def _zeros_like(value: Any) -> Any:
    return tree_lib.map(torch.zeros_like, value)


def _in_form_of(name: str, key: str, value: Any, old: Any) -> Any:
    """``value`` in the dtypes and on the devices of ``old``, the measurement it replaces
    (a sum over no element is an int 0 on the default device, a bool measure's average
    follows its hyperparameters' dtype); another structure or shape is refused, naming
    the measure."""
    shapes = [tuple(t.shape) for t in tree_lib.leaves(value)]
    wanted = [tuple(t.shape) for t in tree_lib.leaves(old)]
    if tree_lib.structure(value) != tree_lib.structure(old) or shapes != wanted:
        raise ValueError(f"{name}: measure {key!r} gave a value of another structure or "
                         f"shape than before: shapes {shapes}, expected {wanted} (a "
                         "measurement keeps the form it has from init on)")
    return tree_lib.map(lambda x, o: x.to(o.device, o.dtype), value, old)


class Measuring:
    """The stage behind :func:`snapshot` (``snapshot=True``: one function, a
    :class:`SnapshotState`) and :func:`monitor`."""

    matrix_stage = True
    mask_aware = True
    uses_params = False
    how = "torch, the measures on the updates tree"  # (for explain)

    def __init__(self, name: str, measures: Mapping[str, Any], snapshot: bool):
        if not isinstance(measures, Mapping) or not measures:
            raise TypeError(f"{name}: expected a non-empty dict of measure names to "
                            f"measures, got {measures!r}")
        self.measures: dict[str, Any] = {}
        for key, measure in measures.items():
            if not isinstance(key, str):
                raise TypeError(f"{name}: measure names must be strings, got {key!r}")
            if isinstance(measure, GradientTransformation) and not snapshot:
                check_transform(measure, f"{name}: measure {key!r}")
            elif not callable(measure):
                raise TypeError(f"{name}: measure {key!r} must be a function of the updates"
                                + ("" if snapshot else " or a GradientTransformation")
                                + f", got {type(measure).__name__}")
            self.measures[key] = measure
        self.name, self.snapshot = name, snapshot
        register_owner(self)

    def _measured(self, tree: Any, device: torch.device | None) -> Any:
        return {k: _as_tensors(m(tree), device) for k, m in self.measures.items()
                if not isinstance(m, GradientTransformation)}

    # -- init --------------------------------------------------------------------------
    def init(self, params: Any) -> SnapshotState | MonitorState:
        paths, flat, spec = tree_lib.flatten_with_paths(params)
        for path, p in zip(paths, flat):
            check_param(path, p)
        device = tree_lib.state_device(flat)
        tree = tree_lib.unflatten(spec, [p.detach().to(compute_dtype(p)) for p in flat])
        values = self._measured(tree, device)
        if self.snapshot:
            return SnapshotState(values)
        states = []
        for key, m in self.measures.items():
            if isinstance(m, GradientTransformation):
                s = m.init(params)
                values[key] = _zeros_like(_as_tensors(m.update(tree, s, params)[0], device))
                states.append(s)
        return MonitorState({k: values[k] for k in self.measures}, tuple(states))

    # -- checks ------------------------------------------------------------------------
    def check_shards(self, paths: Sequence[str], u_flat: Sequence[Any]) -> None:
        """A measure reads whole leaves: on local shards it sees them as DTensors
        (:func:`ftopt.shards.global_view`); where a call cannot give those, refuse leaves
        split across ranks (the measure would see each rank's part)."""
        if not shards.can_view_globally():
            check_shards(self.name, "leaf", _always, paths, u_flat)

    def check_state(self, state: Any, u_flat: Sequence[Any] = (), p_flat: Sequence[Any] = (),
                    spec: Any = None, paths: Sequence[str] = ()) -> None:
        cls = SnapshotState if self.snapshot else MonitorState
        if not isinstance(state, cls):
            raise TypeError(f"{self.name}: expected a {cls.__name__}, got "
                            f"{type(state).__name__}")
        got = state[0]
        if not isinstance(got, dict) or list(got) != list(self.measures):
            raise ValueError(f"{self.name}: the state's measurements are "
                             f"{list(got) if isinstance(got, dict) else got!r}, expected "
                             f"{list(self.measures)}")
        if not self.snapshot:
            wanted = sum(isinstance(m, GradientTransformation) for m in self.measures.values())
            if not isinstance(state.measure_states, tuple) or \
                    len(state.measure_states) != wanted:
                raise ValueError(f"{self.name}: expected measure_states, a tuple of {wanted} "
                                 f"states, got {state.measure_states!r}")

    # -- update ------------------------------------------------------------------------
    def update(self, updates, state, params=None, **extra):
        spec, paths, u_flat, p_flat, zero_flat = checked_call(self, updates, params, extra)
        self.check_state(state)
        out, new = self.run_flat(u_flat, zero_flat, state, p_flat, spec, paths)
        return tree_lib.unflatten(spec, out), new

    def run_flat(self, u_flat, zero_flat, state, p_flat, spec, paths):
        """The updates passed on (masked, in their compute dtype) and the new
        measurements (see :mod:`ftopt.matrix`)."""
        out = [None if u is None else u.to(compute_dtype(u)) for u in u_flat]
        if zero_flat is not None:
            out = [u if u is None or z is None else skip_update(u, z)
                   for u, z in zip(out, zero_flat)]
        tree = tree_lib.unflatten(spec, [None if u is None else shards.global_view(path, u)
                                         for path, u in zip(paths, out)])
        params = (None if any(p is None for p, u in zip(p_flat, out) if u is not None)
                  else tree_lib.unflatten(spec, p_flat))
        device = tree_lib.state_device([u for u in out if u is not None])
        values = self._measured(tree, device)
        states, old_states = [], iter(() if self.snapshot else state.measure_states)
        for key, m in self.measures.items():
            if isinstance(m, GradientTransformation):
                value, s = m.update(tree, next(old_states), params)
                values[key] = _as_tensors(value, device)
                states.append(s)
        old = state[0]
        values = {k: _in_form_of(self.name, k, values[k], old[k]) for k in self.measures}
        new = SnapshotState(values) if self.snapshot else MonitorState(values, tuple(states))
        return out, new


def snapshot(measure_name: str, measure: Measure) -> GradientTransformation:
    """Stores ``measure(updates)`` in the state under ``measure_name`` and passes the
    updates on (optax's ``snapshot``), to read a chain's intermediate values:
    ``chain(sgd(0.1, momentum=0.9), snapshot("norm", ftopt.tree.norm),
    clip_by_global_norm(1.0))``, then ``ftopt.tree.get(state, "norm")``.

    At ``init`` the measurement is ``measure(params)``. The fused backend runs the stages
    around it fused (see :mod:`ftopt.monitoring`).
    """
    if not isinstance(measure_name, str):
        raise TypeError(f"snapshot: measure_name must be a string, got {measure_name!r}")
    obj = Measuring("snapshot", {measure_name: measure}, snapshot=True)
    return GradientTransformation(obj.init, obj.update)


def monitor(measures: Mapping[str, GradientTransformation | Measure]) -> GradientTransformation:
    """Stores several measurements of the updates, some of them stateful, and passes the
    updates on (optax's ``monitor``): ``monitor({"norm": ftopt.tree.norm, "clipped":
    measure_with_ema(lambda u: ftopt.tree.norm(u) > 1.0, decay=0.9)})``.

    A measure is a function of the updates, or a transform whose ``update(updates, state,
    params)`` gives ``(measurement, state)``. At ``init`` a function's measurement is its
    value on the params, a transform's zeros of its value's shape. The fused backend runs
    the stages around it fused (see :mod:`ftopt.monitoring`).
    """
    obj = Measuring("monitor", measures, snapshot=False)
    return GradientTransformation(obj.init, obj.update)


class MeasureWithEma:
    """The transform behind :func:`measure_with_ema`: its update gives the average."""

    def __init__(self, measure: Measure, decay: float | torch.Tensor, debias: bool,
                 accumulator_dtype: torch.dtype | None):
        if not callable(measure):
            raise TypeError(f"measure_with_ema: measure must be a function of the updates, "
                            f"got {type(measure).__name__}")
        if accumulator_dtype is not None and not (
                isinstance(accumulator_dtype, torch.dtype) and accumulator_dtype.is_floating_point):
            raise TypeError(f"measure_with_ema: accumulator_dtype must be a floating-point "
                            f"torch.dtype or None, got {accumulator_dtype!r}")
        self.measure, self.dtype = measure, accumulator_dtype
        self.average = ema(decay, debias)
        register_owner(self)

    def _value(self, tree: Any) -> Any:
        value = _as_tensors(self.measure(tree), None)

        def cast(x: torch.Tensor) -> torch.Tensor:
            if self.dtype is not None:
                return x.to(self.dtype)
            return x if x.is_floating_point() else x.to(torch.float32)
        return tree_lib.map(cast, value)

    def init(self, params: Any) -> Any:
        return self.average.init(self._value(params))

    def update(self, updates, state, params=None, **extra):
        del params, extra
        value = self._value(updates)
        average = getattr(state, "ema", None)
        if tree_lib.structure(average) == tree_lib.structure(value):
            # (a measure of no element, all updates None, is on the default device)
            value = tree_lib.map(lambda x, e: x.to(e.device), value, average)
        return self.average.update(value, state, backend="eager")


def measure_with_ema(measure: Measure, decay: float | torch.Tensor, debias: bool = True,
                     accumulator_dtype: torch.dtype | None = None) -> GradientTransformation:
    """An exponential moving average of ``measure(updates)`` (optax's
    ``measure_with_ema``), for :func:`monitor`: its update gives the average (debiased by
    ``1 − decayᵗ`` with ``debias``), not updates, and its state is :func:`ftopt.ema`'s
    over the measurement. A measurement that is not floating point (``norm > 1.0``) is
    averaged in fp32, or in ``accumulator_dtype`` if given.
    """
    obj = MeasureWithEma(measure, decay, debias, accumulator_dtype)
    return GradientTransformation(obj.init, obj.update)
