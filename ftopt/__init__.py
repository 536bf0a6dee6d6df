"""ftopt: functional, optax-style optimizers for PyTorch with fused Triton kernels."""

from typing import Any

from ftopt import (
    assignment,
    contrib,
    dispatch,
    experimental,
    losses,
    microbatching,
    optax_namespaces,  # noqa: F401 (adds optax's names to ftopt.transforms and .schedules)
    perturbations,
    projections,
    schedules,
    tree,
    tree_utils,
)
from ftopt.alias import adagrad, adam, adamw, ademamix, lamb, lars, lion, rmsprop, sgd
from ftopt.alias_matrix import adafactor, muon, normuon, sm3, soap
from ftopt.alias_more import adan, cocob, dog, dowg, madgrad, mars, rprop
from ftopt.alias_noise import noisy_sgd
from ftopt.alias_norms import fromage, novograd
from ftopt.alias_prodigy import dadapt_adamw, prodigy
from ftopt.alias_variants import (
    acprop,
    adabelief,
    adadelta,
    adamax,
    adamaxw,
    adopt,
    amsgrad,
    ano,
    nadam,
    nadamw,
    optimistic_adam,
    optimistic_adam_v2,
    optimistic_gradient_descent,
    radam,
    sign_sgd,
    signum,
    simplified_ademamix,
    yogi,
)
from ftopt.base import (
    EmptyState,
    GradientTransformation,
    OptState,
    Params,
    TransformInitFn,
    TransformUpdateFn,
    Updates,
    stateless,
)
from ftopt.bnb_port import from_bnb_state_dict, to_bnb_state_dict
from ftopt.cautious import CautiousState, cautious
from ftopt.checkpoint import load_state_dict, state_dict
from ftopt.combine import (
    MaskedState,
    PartitionState,
    chain,
    masked,
    named_chain,
    partition,
    skip_zeros,
)
from ftopt.complex_valued import (
    SplitRealAndImaginaryArrays,
    SplitRealAndImaginaryState,
    split_real_and_imaginary,
)
from ftopt.conditional import (
    ConditionallyMaskState,
    ConditionallyTransformState,
    conditionally_mask,
    conditionally_transform,
)
from ftopt.finite import ApplyIfFiniteState, apply_if_finite
from ftopt.freezing import freeze, multi_transform, selective_transform, set_to_zero
from ftopt.galore import GaLoreDimensionNumbers, GaLoreState, galore, scale_by_galore
from ftopt.inject import (
    InjectHyperparamsState,
    InjectStatefulHyperparamsState,
    inject_hyperparams,
    inject_stateful_hyperparams,
)
from ftopt.layouts import flatten
from ftopt.lbfgs import ScaleByLBFGSState, lbfgs, scale_by_lbfgs
from ftopt.linear_algebra import matrix_inverse_pth_root, nnls, power_iteration
from ftopt.linesearch import (
    BacktrackingLinesearchInfo,
    ScaleByBacktrackingLinesearchState,
    scale_by_backtracking_linesearch,
    value_and_grad_from_state,
)
from ftopt.lookahead import LookaheadParams, LookaheadState, lookahead
from ftopt.lowering.explain import explain
from ftopt.mechanic import MechanicState, mechanize
from ftopt.momo import MomoAdamState, MomoState, momo, momo_adam
from ftopt.monitoring import MonitorState, SnapshotState, measure_with_ema, monitor, snapshot
from ftopt.numerics import (
    abs_sq,
    init_empty_state,
    safe_increment,
    safe_int32_increment,
    safe_norm,
    safe_root_mean_squares,
    scale_gradient,
    stateless_with_tree_map,
    with_extra_args_support,
)
from ftopt.optim import Optimizer
from ftopt.plateau import ReduceLROnPlateauState, reduce_on_plateau
from ftopt.polyak import polyak_sgd, scale_by_polyak
from ftopt.privacy import (
    DifferentiallyPrivateAggregateState,
    differentially_private_aggregate,
    dpsgd,
    per_example_global_norm_clip,
    per_example_layer_norm_clip,
)
from ftopt.quantize import quantize_states
from ftopt.sam import SAMState, sam
from ftopt.sampling import multi_normal
from ftopt.schedule_free import (
    ScheduleFreeState,
    schedule_free,
    schedule_free_adamw,
    schedule_free_eval_params,
    schedule_free_sgd,
)
from ftopt.schedules import (
    ademamix_alpha_warmup,
    ademamix_b3_warmup,
    constant_schedule,
    cosine_decay_schedule,
    cosine_onecycle_schedule,
    exponential_decay,
    join_schedules,
    linear_onecycle_schedule,
    linear_schedule,
    piecewise_constant_schedule,
    piecewise_interpolate_schedule,
    polynomial_schedule,
    sgdr_schedule,
    warmup_constant_schedule,
    warmup_cosine_decay_schedule,
    warmup_exponential_decay_schedule,
)
from ftopt.schedules.decays import ScalarOrSchedule, Schedule
from ftopt.schedules.stateful import StatefulSchedule, WrappedSchedule, WrappedScheduleState
from ftopt.skip_fns import ShouldSkipUpdateFunction, skip_large_updates, skip_not_finite
from ftopt.sophia import (
    HutchinsonState,
    SophiaState,
    hutchinson_estimator_diag_hessian,
    scale_by_sophia,
    sophia,
)
from ftopt.torch_port import from_torch_state_dict, to_torch_state_dict
from ftopt.transforms import (
    ApplyEveryState,
    COCOBState,
    DoGState,
    DoWGState,
    EmaState,
    LeafSecondMomentState,
    MadgradState,
    NovogradMomentumState,
    ScaleByAdaDeltaState,
    ScaleByAdamState,
    ScaleByAdanState,
    ScaleByAdemamixState,
    ScaleByAmsgradState,
    ScaleByBeliefState,
    ScaleByDistanceOverGradientsState,
    ScaleByLionState,
    ScaleByOptimisticGradientState,
    ScaleByRmsState,
    ScaleByRpropState,
    ScaleByRssState,
    ScaleByRStdDevState,
    ScaleByRStdDevWithCountState,
    ScaleByScheduleState,
    ScaleBySimplifiedAdEMAMixState,
    ScaleBySM3State,
    TraceState,
    WeightDecaySchedule,
    adaptive_grad_clip,
    add_cautious_weight_decay,
    add_decayed_weights,
    apply_every,
    clip_by_global_norm,
    clip_by_param_norm_ratio,
    ema,
    identity,
    normalize,
    normalize_by_update_norm,
    scale,
    scale_by_acprop,
    scale_by_adadelta,
    scale_by_adam,
    scale_by_adamax,
    scale_by_adan,
    scale_by_ademamix,
    scale_by_adopt,
    scale_by_amsgrad,
    scale_by_ano,
    scale_by_belief,
    scale_by_cocob,
    scale_by_distance_over_gradients,
    scale_by_dog,
    scale_by_dowg,
    scale_by_learning_rate,
    scale_by_lion,
    scale_by_madgrad,
    scale_by_novograd,
    scale_by_optimistic_gradient,
    scale_by_radam,
    scale_by_rms,
    scale_by_row_norm,
    scale_by_rprop,
    scale_by_rss,
    scale_by_schedule,
    scale_by_sign,
    scale_by_simplified_ademamix,
    scale_by_sm3,
    scale_by_stddev,
    scale_by_trust_ratio,
    scale_by_yogi,
    trace,
    unitwise_clip,
    unitwise_norm,
    weight_decay,
)
from ftopt.transforms.dadapt import DAdaptAdamWState
from ftopt.transforms.factored import (
    FactoredState,
    clip_by_block_rms,
    scale_by_factored_rms,
    scale_by_param_block_norm,
    scale_by_param_block_rms,
)
from ftopt.transforms.mars import MarsCorrectionState, scale_by_mars
from ftopt.transforms.muon import (
    MuonDimensionNumbers,
    MuonMomentumState,
    scale_by_muon,
    scale_by_shape,
)
from ftopt.transforms.noise import AddNoiseState, add_noise
from ftopt.transforms.normuon import NorMuonState, scale_by_normuon
from ftopt.transforms.prodigy import ProdigyState
from ftopt.transforms.soap import SoapState, scale_by_soap
from ftopt.transforms.utility import (
    centralize,
    clip,
    keep_params_nonnegative,
    zero_nans,
)
from ftopt.tree_updates import global_norm, incremental_update, periodic_update
from ftopt.update import apply_updates, step
from ftopt.wrappers import MultiSteps, MultiStepsState
from ftopt.zoom_linesearch import (
    ScaleByZoomLinesearchState,
    ZoomLinesearchInfo,
    scale_by_zoom_linesearch,
)

# The backends, installed where ftopt is imported (imported on first use, except the
# torch.compile entry, which needs no Triton): the core reaches them only through
# ftopt.dispatch.
dispatch.install("fused", "ftopt.lowering.entry")
dispatch.install("compile", "ftopt.lowering.op", now=True)
dispatch.install("chunked", "ftopt.chunked.entry")
dispatch.install("distributed", "ftopt.distributed")

__version__ = "0.1.0"

__all__ = [
    "ApplyIfFiniteState", "EmaState", "MadgradState", "COCOBState", "EmptyState",
    "GradientTransformation", "MaskedState", "Optimizer", "PartitionState", "ScaleByAdaDeltaState",
    "ScaleByAdamState", "ScaleByAdanState", "ScaleByAdemamixState", "ScaleByAmsgradState",
    "ScaleByBeliefState", "ScaleByLionState", "ScaleByOptimisticGradientState", "ScaleByRmsState",
    "ScaleByRpropState", "ScaleByRssState", "ScaleByScheduleState",
    "ScaleBySimplifiedAdEMAMixState", "ScheduleFreeState", "TraceState", "adabelief", "acprop",
    "adadelta", "adagrad", "adam", "adamax", "adamaxw", "adamw", "adan", "add_decayed_weights",
    "ademamix", "ademamix_alpha_warmup", "ademamix_b3_warmup", "adopt", "amsgrad",
    "apply_if_finite", "conditionally_transform", "conditionally_mask",
    "ConditionallyTransformState", "ConditionallyMaskState", "apply_every", "ApplyEveryState",
    "apply_updates", "chain", "clip_by_global_norm", "clip_by_param_norm_ratio",
    "constant_schedule", "cosine_decay_schedule", "cosine_onecycle_schedule", "ema", "explain",
    "exponential_decay", "from_bnb_state_dict", "from_torch_state_dict", "state_dict",
    "load_state_dict", "identity", "join_schedules", "lamb", "lars", "linear_schedule",
    "linear_onecycle_schedule", "lion", "madgrad", "cocob", "scale_by_cocob", "masked",
    "multi_transform", "freeze", "selective_transform", "nadam", "nadamw", "named_chain",
    "optimistic_gradient_descent", "optimistic_adam_v2", "partition",
    "piecewise_constant_schedule", "piecewise_interpolate_schedule", "polynomial_schedule",
    "quantize_states", "reduce_on_plateau", "polyak_sgd", "momo", "dadapt_adamw",
    "DAdaptAdamWState", "momo_adam", "MomoState", "MomoAdamState", "sophia", "scale_by_sophia",
    "hutchinson_estimator_diag_hessian", "SophiaState", "HutchinsonState", "galore",
    "scale_by_galore", "GaLoreState", "GaLoreDimensionNumbers", "global_norm",
    "incremental_update", "periodic_update", "scale_by_polyak", "ReduceLROnPlateauState", "radam",
    "rmsprop", "rprop", "schedule_free", "schedule_free_adamw", "schedule_free_eval_params",
    "schedule_free_sgd", "scale", "scale_by_adadelta", "scale_by_acprop", "scale_by_adam",
    "scale_by_adamax", "scale_by_adan", "scale_by_ademamix", "scale_by_adopt", "scale_by_amsgrad",
    "scale_by_belief", "scale_by_learning_rate", "scale_by_schedule", "normalize_by_update_norm",
    "scale_by_lion", "scale_by_madgrad", "scale_by_optimistic_gradient", "scale_by_radam",
    "scale_by_rms", "scale_by_row_norm", "adaptive_grad_clip", "ScaleBySM3State", "scale_by_sm3",
    "sm3", "DoGState", "DoWGState", "scale_by_dog", "scale_by_dowg",
    "scale_by_distance_over_gradients", "ScaleByDistanceOverGradientsState", "dog", "dowg",
    "scale_by_rprop", "scale_by_rss", "scale_by_stddev", "ScaleByRStdDevState",
    "ScaleByRStdDevWithCountState", "scale_by_sign", "scale_by_simplified_ademamix",
    "scale_by_trust_ratio", "scale_by_yogi", "schedules", "set_to_zero", "sgd", "sgdr_schedule",
    "sign_sgd", "signum", "simplified_ademamix", "skip_zeros", "skip_not_finite",
    "skip_large_updates", "stateless", "step", "to_bnb_state_dict", "to_torch_state_dict", "trace",
    "tree", "warmup_constant_schedule", "warmup_cosine_decay_schedule",
    "warmup_exponential_decay_schedule", "weight_decay", "yogi", "FactoredState",
    "MuonMomentumState", "MuonDimensionNumbers", "adafactor", "clip_by_block_rms", "muon",
    "scale_by_factored_rms",
    "scale_by_muon", "scale_by_param_block_rms", "scale_by_param_block_norm", "scale_by_shape"
]

# optax's everyday utilities and wrappers
__all__ += [
    "InjectHyperparamsState",
    "InjectStatefulHyperparamsState",
    "LookaheadParams",
    "LookaheadState",
    "MultiSteps",
    "MultiStepsState",
    "centralize",
    "clip",
    "inject_hyperparams",
    "inject_stateful_hyperparams",
    "keep_params_nonnegative",
    "lookahead",
    "zero_nans",
]

# Stateful schedules for inject_hyperparams (ftopt.schedules.stateful)
__all__ += ["StatefulSchedule", "WrappedSchedule", "WrappedScheduleState"]
# A transform over all leaves as one vector (ftopt.layouts)
__all__ += ["flatten"]
# The unit-wise norm and clip of adaptive_grad_clip
__all__ += ["unitwise_clip", "unitwise_norm"]
# Measurements of the updates kept in the state (ftopt.monitoring)
__all__ += ["MonitorState", "SnapshotState", "measure_with_ema", "monitor", "snapshot"]
# optax.contrib's SAM and Mechanic wrappers (ftopt.sam, ftopt.mechanic)
__all__ += ["SAMState", "sam", "MechanicState", "mechanize"]
# optax's other names of the same things: type aliases for annotations, and the states
# of its stateless transforms (EmptyState here)
GradientTransformationExtraArgs = GradientTransformation  # (every update takes **extra)
TransformUpdateExtraArgsFn = TransformUpdateFn
MultiTransformState = PartitionState
ApplyEvery = ApplyEveryState
AdaptiveGradClipState = AddDecayedWeightsState = ClipByGlobalNormState = ClipState = \
    NonNegativeParamsState = NormalizeState = ScaleByTrustRatioState = ScaleState = EmptyState
MaskOrFn = Any  # (a pytree of bools like the params, a function of them giving one, or None)
ArrayTree = Any  # (a pytree of tensors: optax's name for what Params and OptState are)
__all__ += [
    "ArrayTree", "GradientTransformationExtraArgs", "OptState", "Params", "ScalarOrSchedule",
    "Schedule",
    "TransformInitFn", "TransformUpdateExtraArgsFn", "TransformUpdateFn", "Updates",
    "AdaptiveGradClipState", "AddDecayedWeightsState", "ApplyEvery", "ClipByGlobalNormState",
    "ClipState", "MultiTransformState", "NonNegativeParamsState", "ScaleByTrustRatioState",
    "ScaleState", "NormalizeState", "MaskOrFn", "ShouldSkipUpdateFunction",
]
# optax.contrib's NorMuon (ftopt.transforms.normuon) and SOAP (ftopt.transforms.soap)
__all__ += ["normuon", "scale_by_normuon", "NorMuonState", "soap", "scale_by_soap",
            "SoapState"]
# optax.contrib's Ano (ftopt.transforms.sign) and MARS (ftopt.transforms.mars)
__all__ += ["ano", "scale_by_ano", "mars", "scale_by_mars", "MarsCorrectionState"]
# optax.contrib's cautious wrapper (ftopt.cautious) and cautious weight decay
__all__ += ["CautiousState", "cautious", "add_cautious_weight_decay", "WeightDecaySchedule"]
# Per-leaf norm optimizers (ftopt.alias_norms)
__all__ += ["LeafSecondMomentState", "NovogradMomentumState", "fromage", "novograd",
            "scale_by_novograd"]
# Gradient noise
__all__ += ["AddNoiseState", "add_noise", "noisy_sgd"]
# Prodigy (ftopt.alias_prodigy)
__all__ += ["ProdigyState", "prodigy"]
__all__ += ["dpsgd", "differentially_private_aggregate", "DifferentiallyPrivateAggregateState",
            "per_example_global_norm_clip", "per_example_layer_norm_clip",
            "split_real_and_imaginary", "SplitRealAndImaginaryArrays",
            "SplitRealAndImaginaryState", "abs_sq", "safe_norm", "safe_root_mean_squares",
            "safe_increment", "safe_int32_increment", "stateless_with_tree_map",
            "with_extra_args_support", "init_empty_state", "scale_gradient"]
__all__ += ["lbfgs", "scale_by_lbfgs", "ScaleByLBFGSState",
            "scale_by_backtracking_linesearch", "ScaleByBacktrackingLinesearchState",
            "BacktrackingLinesearchInfo", "scale_by_zoom_linesearch",
            "ScaleByZoomLinesearchState", "ZoomLinesearchInfo", "value_and_grad_from_state"]
__all__ += ["optimistic_adam", "normalize"]
# Linear-algebra and sampling utilities (ftopt.linear_algebra, ftopt.sampling)
__all__ += ["power_iteration", "matrix_inverse_pth_root", "nnls", "multi_normal"]
__all__ += ["projections"]
# optax's microbatching (ftopt.microbatching): a batch's gradient a slice at a time
microbatch = microbatching.microbatch
__all__ += ["microbatching", "microbatch"]
# optax's perturbations (ftopt.perturbations) and assignment (the Hungarian algorithm)
__all__ += ["perturbations", "assignment"]
# optax's namespaces ``optax.contrib``, ``optax.experimental`` (per-example aggregators)
# and ``optax.tree_utils`` (``tree_``-prefixed names),
# and its top-level names for tree helpers
tree_map_params = tree.map_params
bias_correction = tree.bias_correction
update_moment = tree.update_moment
update_infinity_moment = tree.update_infinity_moment
update_moment_per_elem_norm = tree.update_moment_per_elem_norm
__all__ += ["contrib", "experimental", "tree_utils", "tree_map_params", "bias_correction",
            "update_moment", "update_infinity_moment", "update_moment_per_elem_norm"]
# optax's losses (ftopt.losses), and the ones optax also names at its top level
convex_kl_divergence = losses.convex_kl_divergence
cosine_distance = losses.cosine_distance
cosine_similarity = losses.cosine_similarity
ctc_loss = losses.ctc_loss
ctc_loss_with_forward_probs = losses.ctc_loss_with_forward_probs
generalized_kl_divergence = losses.generalized_kl_divergence
hinge_loss = losses.hinge_loss
huber_loss = losses.huber_loss
kl_divergence = losses.kl_divergence
l2_loss = losses.l2_loss
log_cosh = losses.log_cosh
ntxent = losses.ntxent
safe_softmax_cross_entropy = losses.safe_softmax_cross_entropy
sigmoid_binary_cross_entropy = losses.sigmoid_binary_cross_entropy
sigmoid_focal_loss = losses.sigmoid_focal_loss
smooth_labels = losses.smooth_labels
softmax_cross_entropy = losses.softmax_cross_entropy
softmax_cross_entropy_with_integer_labels = losses.softmax_cross_entropy_with_integer_labels
squared_error = losses.squared_error
_TOP_LEVEL_LOSSES = [
    "convex_kl_divergence", "cosine_distance", "cosine_similarity", "ctc_loss",
    "ctc_loss_with_forward_probs", "generalized_kl_divergence", "hinge_loss", "huber_loss",
    "kl_divergence", "l2_loss", "log_cosh", "ntxent", "safe_softmax_cross_entropy",
    "sigmoid_binary_cross_entropy", "sigmoid_focal_loss", "smooth_labels",
    "softmax_cross_entropy", "softmax_cross_entropy_with_integer_labels", "squared_error",
]
__all__ += ["losses", *_TOP_LEVEL_LOSSES]
