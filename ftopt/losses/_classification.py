r"""Classification losses (optax's ``optax.losses``), for torch tensors.

Every loss is computed element-wise or per example, with no reduction over the batch:
take the mean (or a weighted sum) of the result yourself.

Conventions shared by every function:

* Array arguments are tensors (a Python number or list is refused with a ``TypeError``);
  logits, scores and log-probabilities are real floating point. Integer labels are an
  integer dtype (``int64`` is the usual one); a floating-point or bool tensor given as
  integer labels is refused rather than silently truncated.
* ``axis`` is an int, a tuple of ints, or ``None`` (every dimension); ``where`` is an
  optional bool tensor of the elements to include. A reduction over no included element
  gives 0. The cross entropies also take a ``where`` of the batch shape (the input's
  shape without the ``axis`` dimensions), which masks whole examples.
* Shapes broadcast as optax's do; a pair that does not raises a ``ValueError`` naming
  the arguments.
* Differentiable with ``torch.autograd`` and ``torch.func`` (``grad``, ``vmap``, ...):
  no tensor value is read on the host, so values are not checked: a label outside
  ``[-C, C)`` gives NaN in the cross entropy (optax's gather) and selects no class in the
  multiclass margin losses (optax's ``one_hot``). At a kink (``max(0, z)`` at ``z = 0``,
  ties in a maximum) the gradient is split between the tied branches, as in JAX.
  Elements that ``where`` excludes get zero gradient; in the cross entropies their logits
  may hold any value, ``-inf`` included.

Differences from optax, where JAX and torch differ or optax gives NaN:

* ``kl_divergence`` and ``generalized_kl_divergence`` count a zero target as 0 even where
  the log-prediction is ``-inf`` (:math:`0 \log(0/0) = 0`; optax gives NaN), and
  ``kl_divergence_with_log_targets`` counts a log-target of ``-inf`` as 0 (optax: NaN).
* ``safe_softmax_cross_entropy``'s gradient with respect to a zero label whose logit is
  ``-inf`` is 0 (optax's custom derivative gives ``+inf`` there); every other gradient
  is optax's.
* In ``softmax_cross_entropy`` and ``poly_loss_cross_entropy`` a positive ``axis`` names
  a dimension of ``logits`` even where ``labels`` has more dimensions.
* ``convex_kl_divergence`` is optax's deprecated alias and warns the same way.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from ftopt.losses import _checks as check
from ftopt.losses._checks import Scalar

__all__ = [
    "convex_kl_divergence", "generalized_kl_divergence", "hinge_loss", "kl_divergence",
    "kl_divergence_with_log_targets", "multiclass_hinge_loss", "multiclass_perceptron_loss",
    "perceptron_loss", "poly_loss_cross_entropy", "safe_softmax_cross_entropy",
    "sigmoid_binary_cross_entropy", "sigmoid_focal_loss", "softmax_cross_entropy",
    "softmax_cross_entropy_with_integer_labels",
]

Tensor = torch.Tensor
Axis = int | tuple[int, ...] | None


def _masked_sum(x: Tensor, dims: tuple[int, ...], where: Tensor | None) -> Tensor:
    if where is not None:
        x = torch.where(where, x, 0.0)
    return x.sum(dims) if dims else x


def _log_softmax(logits: Tensor, dims: tuple[int, ...], where: Tensor | None) -> Tensor:
    """log softmax over ``dims``, normalised over the included elements only; excluded
    elements get 0 (callers leave them out of their sums)."""
    if where is None:
        if len(dims) == 1:
            return torch.log_softmax(logits, dims[0])
        return logits - torch.logsumexp(logits, dims, keepdim=True)
    # Rows with no included element get a finite stand-in, so that no NaN or infinity
    # reaches the backward pass; their result is masked out.
    some = where.any(dim=dims, keepdim=True)
    x = torch.where(where, logits, -math.inf)
    x = torch.where(some, x, 0.0)
    out = x - torch.logsumexp(x, dims, keepdim=True)
    return torch.where(where, out, 0.0)


def _cross_entropy_parts(fn: str, logits: Tensor, labels: Tensor, axis: Axis,
                         where: Tensor | None
                         ) -> tuple[Tensor, tuple[int, ...], Tensor | None]:
    """The log-probabilities, dimensions to sum and mask of a softmax cross entropy over
    ``axis`` of ``logits`` (counted from its end in the product with ``labels``)."""
    check.broadcast(fn, {"logits": logits, "labels": labels})
    dims = check.dims(fn, axis, logits.ndim)
    where = check.mask(fn, where, logits.shape, batch_dims=dims, widen=True)
    log_probs = _log_softmax(logits, dims, where)
    shift = max(labels.ndim - logits.ndim, 0)
    return log_probs, tuple(d + shift for d in dims), where


# --- softmax cross entropies -----------------------------------------------------------

def softmax_cross_entropy(logits: Tensor, labels: Tensor, axis: Axis = -1,
                          where: Tensor | None = None) -> Tensor:
    r"""Cross entropy of ``labels`` (class probabilities) and ``softmax(logits)``:
    :math:`-\sum_j y_j \log \operatorname{softmax}(x)_j`, summed over ``axis``.

    ``labels`` broadcasts with ``logits``. With ``where``, the softmax and the sum run over
    the included classes only; ``where`` has the logits' shape or their batch shape. A
    logit of ``-inf`` with label 0 gives NaN, as in optax (see
    :func:`safe_softmax_cross_entropy`). Returns the batch shape.
    """
    fn = "softmax_cross_entropy"
    check.floating(fn, "logits", logits)
    check.tensor(fn, "labels", labels)
    log_probs, dims, where = _cross_entropy_parts(fn, logits, labels, axis, where)
    return -_masked_sum(labels * log_probs, dims, where)


def safe_softmax_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    r""":func:`softmax_cross_entropy` over the last axis, with :math:`0 \log 0 = 0`: a
    class with label 0 adds nothing even where its logit is ``-inf``.

    :math:`-\sum_{j: y_j \ne 0} y_j \log \operatorname{softmax}(x)_j`. Returns
    ``logits.shape[:-1]`` (broadcast with the labels').
    """
    fn = "safe_softmax_cross_entropy"
    check.floating(fn, "logits", logits)
    check.tensor(fn, "labels", labels)
    check.broadcast(fn, {"logits": logits, "labels": labels})
    if logits.ndim == 0:
        raise ValueError(f"{fn}: logits must have a class dimension, got a 0-d tensor")
    log_probs = torch.log_softmax(logits, -1)
    absent = (labels == 0) & ~torch.isfinite(log_probs)
    log_probs = torch.where(absent, 0.0, log_probs)
    return -(labels * log_probs).sum(-1)


def softmax_cross_entropy_with_integer_labels(
        logits: Tensor, labels: Tensor, axis: int | tuple[int, ...] = -1,
        where: Tensor | None = None) -> Tensor:
    r"""Cross entropy of integer class ``labels`` and ``softmax(logits)`` over ``axis``:
    :math:`\log \sum_j e^{x_j} - x_y`.

    ``labels`` has the logits' shape without ``axis`` (broadcastable to it). With a tuple
    ``axis`` the classes are the elements of a ``logits`` slice over those dimensions, in
    the order given, and a label is a flat (row-major) index into that slice. A label in
    ``[-C, 0)`` counts from the end; one outside ``[-C, C)`` gives NaN. With ``where``
    (the logits' shape or the batch shape) the normaliser runs over the included classes
    only, and an example with none included gives 0.
    """
    fn = "softmax_cross_entropy_with_integer_labels"
    check.floating(fn, "logits", logits)
    check.integer(fn, "labels", labels)
    if axis is None or isinstance(axis, bool) or not isinstance(axis, (int, tuple)):
        raise TypeError(f"{fn}: axis must be an int or a tuple of ints, got {axis!r}")
    dims = check.dims(fn, axis, logits.ndim)
    where = check.mask(fn, where, logits.shape, batch_dims=dims, widen=True)
    batch = tuple(d for d in range(logits.ndim) if d not in dims)
    if labels.ndim != len(batch):
        raise ValueError(f"{fn}: labels must have the logits' shape without axis "
                         f"{axis!r}, {tuple(logits.shape[d] for d in batch)}, got "
                         f"{tuple(labels.shape)}")
    # Classes last, flattened into one dimension.
    logits = logits.permute(batch + dims).flatten(len(batch))
    check.broadcast(fn, {"logits (batch shape)": logits[..., 0], "labels": labels})
    classes = logits.shape[-1]
    index = labels.long()
    index = torch.where(index < 0, index + classes, index)
    valid = (index >= 0) & (index < classes)
    index = torch.where(valid, index, 0).unsqueeze(-1)
    if where is None:
        # -log_softmax at the label, as torch's cross entropy computes it (its backward is
        # softmax minus the one-hot in one pass): 1.9x faster than logsumexp - x_y on the
        # CPU (benchmarks/losses_cpu.py)
        picked = torch.take_along_dim(torch.log_softmax(logits, -1), index, dim=-1)
        return torch.where(valid, -picked.squeeze(-1), math.nan)
    picked = torch.take_along_dim(logits, index, dim=-1).squeeze(-1)
    picked = torch.where(valid, picked, math.nan)
    where = where.permute(batch + dims).flatten(len(batch))
    some = where.any(-1)
    x = torch.where(where, logits, -math.inf)
    x = torch.where(some.unsqueeze(-1), x, 0.0)
    out = torch.logsumexp(x, -1) - picked
    return torch.where(some, out, 0.0)


def poly_loss_cross_entropy(logits: Tensor, labels: Tensor, *, epsilon: Scalar = 2.0,
                            axis: Axis = -1, where: Tensor | None = None) -> Tensor:
    r"""Poly-1 loss: the softmax cross entropy plus ``epsilon`` times
    :math:`1 - p_t = \sum_j y_j (1 - \operatorname{softmax}(x)_j)`, over ``axis``.

    ``labels`` are floating-point class probabilities; ``axis`` and ``where`` act as in
    :func:`softmax_cross_entropy` (optax's own ``where`` must have the logits' shape here;
    the batch shape is accepted too).
    """
    fn = "poly_loss_cross_entropy"
    check.floating(fn, "logits", logits)
    check.floating(fn, "labels", labels)
    log_probs, dims, where = _cross_entropy_parts(fn, logits, labels, axis, where)
    cross_entropy = -_masked_sum(labels * log_probs, dims, where)
    one_minus_pt = _masked_sum(labels * (1.0 - torch.exp(log_probs)), dims, where)
    return cross_entropy + epsilon * one_minus_pt


# --- sigmoid losses --------------------------------------------------------------------

def _sigmoid_labels(fn: str, logits: Tensor, labels: Tensor) -> Tensor:
    """``labels`` checked against ``logits`` and cast to their dtype."""
    check.floating(fn, "logits", logits)
    check.tensor(fn, "labels", labels)
    check.broadcast(fn, {"logits": logits, "labels": labels})
    return labels.to(logits.dtype)


def _sigmoid_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    # -y log σ(x) - (1 - y) log σ(-x) = max(x, 0) - x y + log(1 + e^-|x|): torch's one
    # kernel of it (forward and backward, labels differentiable too), on broadcast views
    logits, labels = torch.broadcast_tensors(logits, labels)
    return F.binary_cross_entropy_with_logits(logits, labels, reduction="none")


def sigmoid_binary_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    r"""Element-wise cross entropy of ``sigmoid(logits)`` and ``labels`` in [0, 1]:
    :math:`-y \log \sigma(x) - (1 - y) \log \sigma(-x)`.

    ``labels`` (binary or probabilities, any real dtype) are cast to the logits' dtype
    and broadcast with them.
    """
    labels = _sigmoid_labels("sigmoid_binary_cross_entropy", logits, labels)
    return _sigmoid_cross_entropy(logits, labels)


def sigmoid_focal_loss(logits: Tensor, labels: Tensor, *, alpha: Scalar | None = None,
                       gamma: Scalar = 2.0) -> Tensor:
    r"""Focal loss: :math:`-\alpha_t (1 - p_t)^\gamma \log p_t` element-wise, with
    :math:`p = \sigma(x)`, :math:`p_t = y p + (1 - y)(1 - p)` and
    :math:`\alpha_t = \alpha y + (1 - \alpha)(1 - y)` (no weighting when ``alpha`` is
    None).

    ``labels`` are in [0, 1] (soft labels too). :math:`\log(1 - p_t)` is formed in log
    space, :math:`\operatorname{logaddexp}(\log y + \log\sigma(-x),\ \log(1-y) +
    \log\sigma(x))`, so the loss and its gradient stay finite for extreme logits and
    any ``gamma > 0``. A number ``alpha`` must be in [0, 1].
    """
    fn = "sigmoid_focal_loss"
    labels = _sigmoid_labels(fn, logits, labels)
    if alpha is not None:
        check.number(fn, "alpha", alpha, "in [0, 1]")
    cross_entropy = _sigmoid_cross_entropy(logits, labels)
    log_one_minus_pt = torch.logaddexp(torch.log(labels) + F.logsigmoid(-logits),
                                       torch.log1p(-labels) + F.logsigmoid(logits))
    loss = cross_entropy * torch.exp(gamma * log_one_minus_pt)
    if alpha is None:
        return loss
    return (alpha * labels + (1.0 - alpha) * (1.0 - labels)) * loss


# --- margin losses ---------------------------------------------------------------------

def _relu(z: Tensor) -> Tensor:
    # torch.maximum splits the gradient at a tie, as jnp.maximum does.
    return torch.maximum(z, z.new_zeros(()))


def hinge_loss(predictor_outputs: Tensor, targets: Tensor) -> Tensor:
    r"""Binary hinge loss, element-wise: :math:`\max(0, 1 - s t)` for targets
    :math:`t \in \{-1, 1\}` (not {0, 1}); the shapes broadcast."""
    fn = "hinge_loss"
    check.floating(fn, "predictor_outputs", predictor_outputs)
    check.tensor(fn, "targets", targets)
    check.broadcast(fn, {"predictor_outputs": predictor_outputs, "targets": targets})
    return _relu(1.0 - predictor_outputs * targets)


def perceptron_loss(predictor_outputs: Tensor, targets: Tensor) -> Tensor:
    r"""Binary perceptron loss, element-wise: :math:`\max(0, -s t)` for targets
    :math:`t \in \{-1, 1\}`; both arguments have the same shape."""
    fn = "perceptron_loss"
    check.floating(fn, "predictor_outputs", predictor_outputs)
    check.tensor(fn, "targets", targets)
    if predictor_outputs.shape != targets.shape:
        raise ValueError(f"{fn}: predictor_outputs and targets must have the same shape, "
                         f"got {tuple(predictor_outputs.shape)} and {tuple(targets.shape)}")
    return _relu(-predictor_outputs * targets)


def _one_hot(fn: str, scores: Tensor, labels: Tensor) -> Tensor:
    check.floating(fn, "scores", scores)
    check.integer(fn, "labels", labels)
    if scores.ndim == 0:
        raise ValueError(f"{fn}: scores must have a class dimension, got a 0-d tensor")
    check.broadcast(fn, {"scores (batch shape)": scores[..., 0], "labels": labels})
    classes = torch.arange(scores.shape[-1], device=scores.device)
    # A label outside [0, C) selects no class (optax's one_hot gives a zero row).
    return (labels.unsqueeze(-1) == classes).to(scores.dtype)


def multiclass_hinge_loss(scores: Tensor, labels: Tensor) -> Tensor:
    r"""Multiclass (Crammer-Singer) hinge loss over the last axis:
    :math:`\max_j (s_j + 1 - [j = y]) - s_y`, for integer ``labels`` of the batch shape."""
    one_hot = _one_hot("multiclass_hinge_loss", scores, labels)
    return torch.amax(scores + 1.0 - one_hot, -1) - (scores * one_hot).sum(-1)


def multiclass_perceptron_loss(scores: Tensor, labels: Tensor) -> Tensor:
    r"""Multiclass perceptron loss over the last axis: :math:`\max_j s_j - s_y`, for integer
    ``labels`` of the batch shape."""
    one_hot = _one_hot("multiclass_perceptron_loss", scores, labels)
    return torch.amax(scores, -1) - (scores * one_hot).sum(-1)


# --- Kullback-Leibler divergences ------------------------------------------------------

def _kl_args(fn: str, log_predictions: Tensor, targets: Tensor, targets_name: str,
             axis: Axis, where: Tensor | None) -> tuple[tuple[int, ...], Tensor | None]:
    check.floating(fn, "log_predictions", log_predictions)
    check.floating(fn, targets_name, targets)
    shape = check.broadcast(fn, {"log_predictions": log_predictions, targets_name: targets})
    return check.dims(fn, axis, len(shape)), check.mask(fn, where, shape, widen=True)


def kl_divergence(log_predictions: Tensor, targets: Tensor, axis: Axis = -1,
                  where: Tensor | None = None) -> Tensor:
    r"""Kullback-Leibler divergence of the predictions from the targets, over ``axis``:
    :math:`\sum_j q_j (\log q_j - \log p_j)`, with predictions given as :math:`\log p`.

    A zero target adds 0 (:math:`0 \log 0 = 0`), also where :math:`\log p_j = -\infty`.
    """
    fn = "kl_divergence"
    dims, where = _kl_args(fn, log_predictions, targets, "targets", axis, where)
    zero = targets == 0
    log_targets = torch.log(torch.where(zero, 1.0, targets))
    log_predictions = torch.where(zero & (log_predictions == -math.inf),
                                  0.0,
                                  log_predictions)
    return _masked_sum(targets * (log_targets - log_predictions), dims, where)


def kl_divergence_with_log_targets(log_predictions: Tensor, log_targets: Tensor,
                                   axis: Axis = -1, where: Tensor | None = None) -> Tensor:
    r""":func:`kl_divergence` with the targets also in log space:
    :math:`\sum_j e^{\log q_j} (\log q_j - \log p_j)`; a log-target of ``-inf`` adds 0."""
    fn = "kl_divergence_with_log_targets"
    dims, where = _kl_args(fn, log_predictions, log_targets, "log_targets", axis, where)
    absent = log_targets == -math.inf
    difference = (torch.where(absent, 0.0, log_targets)
                  - torch.where(absent, 0.0, log_predictions))
    return _masked_sum(torch.exp(log_targets) * difference, dims, where)


def generalized_kl_divergence(log_predictions: Tensor, targets: Tensor, axis: Axis = -1,
                              where: Tensor | None = None) -> Tensor:
    r"""Generalised KL divergence, for unnormalised distributions, over ``axis``:
    :math:`\sum_j q_j (\log q_j - \log p_j) - q_j + p_j` (the Bregman divergence of
    :math:`x \log x - x`), with predictions given as :math:`\log p`."""
    return _generalized_kl_divergence("generalized_kl_divergence", log_predictions, targets,
                                      axis, where)


def _generalized_kl_divergence(fn: str, log_predictions: Tensor, targets: Tensor,
                               axis: Axis, where: Tensor | None) -> Tensor:
    dims, where = _kl_args(fn, log_predictions, targets, "targets", axis, where)
    divergence = kl_divergence(log_predictions, targets, axis=axis, where=where)
    return divergence + _masked_sum(torch.exp(log_predictions) - targets, dims, where)


def convex_kl_divergence(log_predictions: Tensor, targets: Tensor, axis: Axis = -1,
                         where: Tensor | None = None) -> Tensor:
    r"""Deprecated name of :func:`generalized_kl_divergence` (warns with a
    ``DeprecationWarning``): :math:`\sum_j q_j (\log q_j - \log p_j) - q_j + p_j`."""
    warnings.warn("convex_kl_divergence is deprecated: use generalized_kl_divergence",
                  DeprecationWarning, stacklevel=2)
    return _generalized_kl_divergence("convex_kl_divergence", log_predictions, targets,
                                      axis, where)
