"""ftopt: functional, optax-style optimizers for PyTorch with fused Triton kernels."""

from ftopt import dispatch, schedules, tree
from ftopt.alias import adagrad, adam, adamw, ademamix, lamb, lars, lion, rmsprop, sgd
from ftopt.base import EmptyState, GradientTransformation, set_to_zero, stateless
from ftopt.combine import (
    MaskedState,
    PartitionState,
    chain,
    masked,
    named_chain,
    partition,
    skip_zeros,
)
from ftopt.finite import ApplyIfFiniteState, apply_if_finite
from ftopt.lowering.explain import explain
from ftopt.optim import Optimizer
from ftopt.quantize import quantize_states
from ftopt.schedules import (
    ademamix_alpha_warmup,
    ademamix_b3_warmup,
    constant_schedule,
    cosine_decay_schedule,
    exponential_decay,
    join_schedules,
    linear_schedule,
    piecewise_constant_schedule,
    polynomial_schedule,
    warmup_constant_schedule,
    warmup_cosine_decay_schedule,
)
from ftopt.torch_port import from_torch_state_dict, to_torch_state_dict
from ftopt.transforms import (
    ScaleByAdamState,
    ScaleByAdemamixState,
    ScaleByLionState,
    ScaleByRmsState,
    ScaleByRssState,
    ScaleByScheduleState,
    TraceState,
    add_decayed_weights,
    clip_by_global_norm,
    clip_by_param_norm_ratio,
    identity,
    scale,
    scale_by_adam,
    scale_by_ademamix,
    scale_by_learning_rate,
    scale_by_lion,
    scale_by_rms,
    scale_by_rss,
    scale_by_sign,
    scale_by_trust_ratio,
    trace,
    weight_decay,
)
from ftopt.update import apply_updates, step

# The backends, installed where ftopt is imported (imported on first use, except the
# torch.compile entry, which needs no Triton): the core reaches them only through
# ftopt.dispatch.
dispatch.install("fused", "ftopt.lowering.entry")
dispatch.install("compile", "ftopt.lowering.op", now=True)
dispatch.install("chunked", "ftopt.chunked.entry")

__version__ = "0.1.0"

__all__ = [
    "ApplyIfFiniteState",
    "EmptyState",
    "GradientTransformation",
    "MaskedState",
    "Optimizer",
    "PartitionState",
    "ScaleByAdamState",
    "ScaleByAdemamixState",
    "ScaleByLionState",
    "ScaleByRmsState",
    "ScaleByRssState",
    "ScaleByScheduleState",
    "TraceState",
    "adagrad",
    "adam",
    "adamw",
    "add_decayed_weights",
    "ademamix",
    "ademamix_alpha_warmup",
    "ademamix_b3_warmup",
    "apply_if_finite",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "clip_by_param_norm_ratio",
    "constant_schedule",
    "cosine_decay_schedule",
    "explain",
    "exponential_decay",
    "from_torch_state_dict",
    "identity",
    "join_schedules",
    "lamb",
    "lars",
    "linear_schedule",
    "lion",
    "masked",
    "named_chain",
    "partition",
    "piecewise_constant_schedule",
    "polynomial_schedule",
    "quantize_states",
    "rmsprop",
    "scale",
    "scale_by_adam",
    "scale_by_ademamix",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_rms",
    "scale_by_rss",
    "scale_by_sign",
    "scale_by_trust_ratio",
    "schedules",
    "set_to_zero",
    "sgd",
    "skip_zeros",
    "stateless",
    "step",
    "to_torch_state_dict",
    "trace",
    "tree",
    "warmup_constant_schedule",
    "warmup_cosine_decay_schedule",
    "weight_decay",
]
