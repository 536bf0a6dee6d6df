"""optax's namespaces ``optax.transforms`` and ``optax.schedules`` hold, beside its
transforms and schedules, its combinators and wrappers (``optax.transforms.masked``,
``optax.schedules.inject_hyperparams``); :mod:`ftopt.transforms` and
:mod:`ftopt.schedules` hold them too. They are added here, to the subpackages' namespaces
and ``__all__``, because the modules that define them import those subpackages (an
import the other way would be a circle)."""

from __future__ import annotations

from ftopt import schedules, transforms
from ftopt.base import EmptyState
from ftopt.combine import MaskedState, PartitionState, chain, masked, named_chain, partition
from ftopt.conditional import (
    ConditionallyMaskState,
    ConditionallyTransformState,
    ConditionFn,
    conditionally_mask,
    conditionally_transform,
)
from ftopt.finite import ApplyIfFiniteState, apply_if_finite
from ftopt.freezing import freeze, selective_transform
from ftopt.inject import (
    InjectHyperparamsState,
    InjectStatefulHyperparamsState,
    inject_hyperparams,
    inject_stateful_hyperparams,
)
from ftopt.layouts import flatten
from ftopt.monitoring import MonitorState, SnapshotState, measure_with_ema, monitor, snapshot
from ftopt.privacy import per_example_global_norm_clip, per_example_layer_norm_clip
from ftopt.schedules.stateful import StatefulSchedule, WrappedSchedule
from ftopt.skip_fns import ShouldSkipUpdateFunction, skip_large_updates, skip_not_finite
from ftopt.transforms.factored import clip_by_block_rms
from ftopt.wrappers import MultiSteps, MultiStepsState

#: The names optax's ``optax.transforms`` holds that ftopt defines outside the package.
TRANSFORMS = {
    "ApplyIfFiniteState": ApplyIfFiniteState, "ConditionFn": ConditionFn,
    "ConditionallyMaskState": ConditionallyMaskState,
    "ConditionallyTransformState": ConditionallyTransformState, "MaskedState": MaskedState,
    "MonitorState": MonitorState, "MultiSteps": MultiSteps, "MultiStepsState": MultiStepsState,
    "NonNegativeParamsState": EmptyState, "PartitionState": PartitionState,
    "ShouldSkipUpdateFunction": ShouldSkipUpdateFunction, "SnapshotState": SnapshotState,
    "apply_if_finite": apply_if_finite, "chain": chain, "clip_by_block_rms": clip_by_block_rms,
    "conditionally_mask": conditionally_mask, "conditionally_transform": conditionally_transform,
    "flatten": flatten, "freeze": freeze, "masked": masked, "measure_with_ema": measure_with_ema,
    "monitor": monitor, "named_chain": named_chain, "partition": partition,
    "per_example_global_norm_clip": per_example_global_norm_clip,
    "per_example_layer_norm_clip": per_example_layer_norm_clip,
    "selective_transform": selective_transform, "skip_large_updates": skip_large_updates,
    "skip_not_finite": skip_not_finite, "snapshot": snapshot,
}

#: The names optax's ``optax.schedules`` holds that ftopt defines outside the package.
SCHEDULES = {
    "InjectHyperparamsState": InjectHyperparamsState,
    "InjectStatefulHyperparamsState": InjectStatefulHyperparamsState,
    "StatefulSchedule": StatefulSchedule, "WrappedSchedule": WrappedSchedule,
    "inject_hyperparams": inject_hyperparams,
    "inject_stateful_hyperparams": inject_stateful_hyperparams,
}

for _package, _names in ((transforms, TRANSFORMS), (schedules, SCHEDULES)):
    for _name, _obj in _names.items():
        setattr(_package, _name, _obj)
    _package.__all__ = [*_package.__all__, *(n for n in _names if n not in _package.__all__)]
