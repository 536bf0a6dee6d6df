"""Every transform of ftopt, one module per family."""

from ftopt.transforms.adam_family import (
    ScaleByAmsgradState,
    ScaleByBeliefState,
    scale_by_acprop,
    scale_by_adamax,
    scale_by_amsgrad,
    scale_by_belief,
    scale_by_yogi,
)
from ftopt.transforms.adam_rectified import quarter_power, scale_by_adopt, scale_by_radam
from ftopt.transforms.adan import ScaleByAdanState, scale_by_adan
from ftopt.transforms.adaptive import (
    ScaleByAdaDeltaState,
    ScaleByAdamState,
    ScaleByAdemamixState,
    ScaleByRmsState,
    ScaleByRssState,
    ScaleByRStdDevState,
    ScaleByRStdDevWithCountState,
    ScaleBySimplifiedAdEMAMixState,
    scale_by_adadelta,
    scale_by_adam,
    scale_by_ademamix,
    scale_by_rms,
    scale_by_rss,
    scale_by_simplified_ademamix,
    scale_by_stddev,
)
from ftopt.transforms.clipping import (
    clip_by_global_norm,
    clip_by_param_norm_ratio,
    normalize,
    normalize_by_update_norm,
    scale_by_trust_ratio,
)
from ftopt.transforms.cocob import COCOBState, scale_by_cocob
from ftopt.transforms.dog import (
    DoGState,
    DoWGState,
    ScaleByDistanceOverGradientsState,
    scale_by_distance_over_gradients,
    scale_by_dog,
    scale_by_dowg,
)
from ftopt.transforms.madgrad import MadgradState, scale_by_madgrad
from ftopt.transforms.matrix_stages import (
    adaptive_grad_clip,
    scale_by_row_norm,
    unitwise_clip,
    unitwise_norm,
)
from ftopt.transforms.momentum import (
    ApplyEveryState,
    EmaState,
    ScaleByOptimisticGradientState,
    TraceState,
    apply_every,
    ema,
    scale_by_optimistic_gradient,
    trace,
)
from ftopt.transforms.noise import AddNoiseState, add_noise
from ftopt.transforms.novograd import (
    LeafSecondMomentState,
    NovogradMomentumState,
    scale_by_novograd,
)
from ftopt.transforms.rprop import ScaleByRpropState, scale_by_rprop
from ftopt.transforms.scaling import (
    ScaleByScheduleState,
    WeightDecaySchedule,
    add_cautious_weight_decay,
    add_decayed_weights,
    identity,
    scale,
    scale_by_learning_rate,
    scale_by_schedule,
    weight_decay,
)
from ftopt.transforms.sign import ScaleByLionState, scale_by_ano, scale_by_lion, scale_by_sign
from ftopt.transforms.sm3 import ScaleBySM3State, scale_by_sm3
from ftopt.transforms.utility import (
    centralize,
    clip,
    keep_params_nonnegative,
    zero_nans,
)

__all__ = [
    "LeafSecondMomentState",
    "NovogradMomentumState",
    "scale_by_novograd",
    "EmaState",
    "MadgradState",
    "COCOBState",
    "ScaleByAdaDeltaState",
    "ScaleByAdamState",
    "ScaleByAdanState",
    "ScaleByAdemamixState",
    "ScaleByAmsgradState",
    "ScaleByBeliefState",
    "ScaleByLionState",
    "ScaleByOptimisticGradientState",
    "ScaleByRmsState",
    "ScaleByRStdDevState",
    "ScaleByRStdDevWithCountState",
    "ScaleByRpropState",
    "ScaleByRssState",
    "ScaleByScheduleState",
    "ScaleBySimplifiedAdEMAMixState",
    "TraceState",
    "ApplyEveryState",
    "add_decayed_weights",
    "add_cautious_weight_decay",
    "WeightDecaySchedule",
    "clip_by_global_norm",
    "clip_by_param_norm_ratio",
    "ema",
    "identity",
    "quarter_power",
    "scale",
    "scale_by_adadelta",
    "scale_by_adam",
    "scale_by_adan",
    "scale_by_acprop",
    "scale_by_adamax",
    "scale_by_ademamix",
    "scale_by_adopt",
    "scale_by_amsgrad",
    "scale_by_belief",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "scale_by_lion",
    "scale_by_ano",
    "scale_by_madgrad",
    "scale_by_cocob",
    "scale_by_optimistic_gradient",
    "scale_by_radam",
    "scale_by_rms",
    "scale_by_row_norm",
    "adaptive_grad_clip",
    "unitwise_clip",
    "unitwise_norm",
    "ScaleBySM3State",
    "scale_by_sm3",
    "DoGState",
    "DoWGState",
    "scale_by_dog",
    "scale_by_dowg",
    "scale_by_distance_over_gradients",
    "ScaleByDistanceOverGradientsState",
    "scale_by_rprop",
    "scale_by_rss",
    "scale_by_stddev",
    "scale_by_sign",
    "scale_by_simplified_ademamix",
    "scale_by_trust_ratio",
    "normalize_by_update_norm",
    "normalize",
    "scale_by_yogi",
    "trace",
    "apply_every",
    "weight_decay",
]

# optax's everyday utilities (ftopt.transforms.utility)
__all__ += ["centralize", "clip", "keep_params_nonnegative", "zero_nans"]

# Gradient noise (ftopt.transforms.noise)
__all__ += ["AddNoiseState", "add_noise"]
