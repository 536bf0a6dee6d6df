"""Loss functions (optax's ``optax.losses``), for torch tensors.

Each takes and returns tensors, reduces what optax's reduces (nothing for the regression
losses, the class axis for the classification losses; ``ntxent`` and
``multiclass_generalized_dice_loss`` the batch too, ``ranking_softmax_loss`` by its
``reduce_fn``), so take ``.mean()`` yourself where optax's users do, and differentiates
through autograd and ``torch.func`` (``grad``, ``vmap``). Arguments are optax's: ``axis``
and ``where`` where optax has them, integer labels as int64 tensors. Differences from
optax are stated in each function's docstring; bad input raises an error naming the
argument.
"""

from __future__ import annotations

from ftopt.losses._classification import (
    convex_kl_divergence,
    generalized_kl_divergence,
    hinge_loss,
    kl_divergence,
    kl_divergence_with_log_targets,
    multiclass_hinge_loss,
    multiclass_perceptron_loss,
    perceptron_loss,
    poly_loss_cross_entropy,
    safe_softmax_cross_entropy,
    sigmoid_binary_cross_entropy,
    sigmoid_focal_loss,
    softmax_cross_entropy,
    softmax_cross_entropy_with_integer_labels,
)
from ftopt.losses._ctc import ctc_loss, ctc_loss_with_forward_probs
from ftopt.losses._fenchel_young import make_fenchel_young_loss
from ftopt.losses._ranking import ranking_softmax_loss
from ftopt.losses._regression import (
    cosine_distance,
    cosine_similarity,
    huber_loss,
    l2_loss,
    log_cosh,
    squared_error,
)
from ftopt.losses._segmentation import binary_dice_loss, dice_loss, multiclass_generalized_dice_loss
from ftopt.losses._self_supervised import ntxent, triplet_margin_loss
from ftopt.losses._smoothing import smooth_labels
from ftopt.losses._sparsemax import multiclass_sparsemax_loss, sparsemax_loss

__all__ = [
    "binary_dice_loss", "convex_kl_divergence", "cosine_distance", "cosine_similarity",
    "ctc_loss", "ctc_loss_with_forward_probs", "dice_loss", "generalized_kl_divergence",
    "hinge_loss", "huber_loss", "kl_divergence", "kl_divergence_with_log_targets", "l2_loss",
    "log_cosh", "make_fenchel_young_loss", "multiclass_generalized_dice_loss",
    "multiclass_hinge_loss", "multiclass_perceptron_loss", "multiclass_sparsemax_loss",
    "ntxent", "perceptron_loss", "poly_loss_cross_entropy", "ranking_softmax_loss",
    "safe_softmax_cross_entropy", "sigmoid_binary_cross_entropy", "sigmoid_focal_loss",
    "smooth_labels", "softmax_cross_entropy", "softmax_cross_entropy_with_integer_labels",
    "sparsemax_loss", "squared_error", "triplet_margin_loss",
]
