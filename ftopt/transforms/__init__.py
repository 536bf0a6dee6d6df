"""Every transform of ftopt, one module per family."""

from ftopt.transforms.adaptive import (
    ScaleByAdamState,
    ScaleByAdemamixState,
    ScaleByRmsState,
    ScaleByRssState,
    scale_by_adam,
    scale_by_ademamix,
    scale_by_rms,
    scale_by_rss,
)
from ftopt.transforms.clipping import (
    clip_by_global_norm,
    clip_by_param_norm_ratio,
    scale_by_trust_ratio,
)
from ftopt.transforms.matrix_stages import scale_by_row_norm
from ftopt.transforms.momentum import TraceState, trace
from ftopt.transforms.scaling import (
    ScaleByScheduleState,
    add_decayed_weights,
    identity,
    scale,
    scale_by_learning_rate,
    weight_decay,
)
from ftopt.transforms.sign import ScaleByLionState, scale_by_lion, scale_by_sign

__all__ = [
    "ScaleByAdamState",
    "ScaleByAdemamixState",
    "ScaleByLionState",
    "ScaleByRmsState",
    "ScaleByRssState",
    "ScaleByScheduleState",
    "TraceState",
    "add_decayed_weights",
    "clip_by_global_norm",
    "clip_by_param_norm_ratio",
    "identity",
    "scale",
    "scale_by_adam",
    "scale_by_ademamix",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_rms",
    "scale_by_row_norm",
    "scale_by_rss",
    "scale_by_sign",
    "scale_by_trust_ratio",
    "trace",
    "weight_decay",
]
