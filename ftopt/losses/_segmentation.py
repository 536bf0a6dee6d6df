r"""Segmentation losses (optax's Dice family), for torch tensors.

Soft Dice / Tversky losses over tensors laid out ``[batch, *spatial, classes]``: per
class :math:`c`, with :math:`p` the predicted probabilities and :math:`t` the (one-hot
or binary) targets summed over the spatial positions,

.. math::
    I_c = \sum_i p_{ic} t_{ic}, \quad P_c = \sum_i p_{ic}, \quad T_c = \sum_i t_{ic},
    \qquad
    \ell_c = 1 - \frac{I_c + s}{I_c + \alpha (P_c - I_c) + \beta (T_c - I_c) + s},

where :math:`\alpha` weighs false positives, :math:`\beta` false negatives and
:math:`s` smooths empty classes. :math:`\alpha = \beta = 1/2` is the Dice loss.

Differences from optax, where JAX and torch differ:

* With ``apply_softmax=False`` the probabilities are checked (a host read), on eager
  tensors only: under ``torch.func`` transforms or ``torch.compile`` the values are used
  unchecked. A single-channel input (binary probabilities) is checked to lie in
  :math:`[0, 1]`; optax asks it to sum to 1 over its one channel, which only all-ones
  predictions pass, so ``binary_dice_loss(..., apply_sigmoid=False)`` could not be used.
* Inputs are torch tensors; ``predictions`` must be floating point. Bool or integer
  targets are cast to ``predictions``' dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ftopt.losses import _checks as check
from ftopt.losses._checks import Scalar
from ftopt.losses._regression import Axis, _sum

__all__ = ["binary_dice_loss", "dice_loss", "multiclass_generalized_dice_loss"]

_REDUCTIONS = ("mean", "sum", "none")
# Added to the squared class frequencies of the generalized Dice weights, so that a class
# absent from the targets gets a large but finite weight.
_FREQUENCY_EPS = 1e-7


def _check_probabilities(fn: str, flag: str, probs: torch.Tensor) -> None:
    """Eager check that ``probs`` holds probabilities over its last (class) axis; ``flag``
    names the argument that says the predictions are probabilities."""
    if torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(
            probs):
        return
    values = probs.detach()
    if values.shape[-1] == 1:
        low, high = values.min().item(), values.max().item()
        if low < 0.0 or high > 1.0:
            raise ValueError(
                f"{fn}: predictions must be valid probabilities in [0, 1] when {flag}=False "
                f"(a single channel), got values in [{low:.6f}, {high:.6f}]")
        return
    sums = values.sum(dim=-1)
    if not torch.allclose(sums, torch.ones_like(sums), rtol=1e-5, atol=1e-8):
        raise ValueError(
            f"{fn}: predictions must be valid probability distributions that sum to 1 "
            f"along the class axis (the last) when {flag}=False, got sums in "
            f"[{sums.min().item():.6f}, {sums.max().item():.6f}]")


def _check_pair(fn: str, predictions: torch.Tensor, targets: torch.Tensor) -> None:
    """``predictions`` and ``targets`` of one shape ``[..., classes]``."""
    if predictions.shape != targets.shape:
        raise ValueError(f"{fn}: targets must have the shape of predictions "
                         f"{tuple(predictions.shape)} (one-hot [..., classes]), got "
                         f"{tuple(targets.shape)}")
    if predictions.ndim == 0:
        raise ValueError(f"{fn}: predictions and targets must have a class axis (the "
                         "last), got 0-dimensional tensors")


def dice_loss(predictions: torch.Tensor, targets: torch.Tensor, *,
              class_weights: torch.Tensor | Sequence[float] | None = None,
              smooth: Scalar = 1.0, alpha: Scalar = 0.5, beta: Scalar = 0.5,
              apply_softmax: bool = True, reduction: str = "mean",
              ignore_background: bool = False, axis: Axis = None) -> torch.Tensor:
    r"""Soft Dice (Tversky) loss :math:`\ell_c` per class, reduced over the classes.

    ``predictions`` are logits ``[..., classes]`` (a softmax over the last axis; a
    sigmoid when there is one channel) or, with ``apply_softmax=False``, probabilities.
    ``targets`` are one-hot (or binary) of the same shape; either may lack a trailing
    channel axis of size 1. The sums :math:`I, P, T` run over ``axis`` (default: every
    axis but the first and the last; an empty tuple sums nothing). ``class_weights``
    (1-D, one per class) scale :math:`\ell_c`; ``ignore_background`` drops class 0 when
    there are several. ``reduction`` over the classes: ``"mean"``, ``"sum"``, or
    ``"none"`` to keep them. Result ``[batch]`` for ``[batch, *spatial, classes]``
    inputs (``[batch, classes]`` with ``"none"``).
    """
    return _dice("dice_loss", "apply_softmax", predictions, targets,
                 class_weights=class_weights, smooth=smooth, alpha=alpha, beta=beta,
                 apply_softmax=apply_softmax, reduction=reduction,
                 ignore_background=ignore_background, axis=axis)


def _dice(fn: str, flag: str, predictions: torch.Tensor, targets: torch.Tensor, *,
          class_weights: torch.Tensor | Sequence[float] | None, smooth: Scalar,
          alpha: Scalar, beta: Scalar, apply_softmax: bool, reduction: str,
          ignore_background: bool, axis: Axis) -> torch.Tensor:
    """:func:`dice_loss`, its errors naming ``fn`` and, for ``apply_softmax``, ``flag``."""
    check.floating(fn, "predictions", predictions)
    check.tensor(fn, "targets", targets)
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{fn}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    for name, value in (("smooth", smooth), ("alpha", alpha), ("beta", beta)):
        check.number(fn, name, value, ">= 0")
    if predictions.ndim == targets.ndim - 1:
        predictions = predictions.unsqueeze(-1)
    elif targets.ndim == predictions.ndim - 1:
        targets = targets.unsqueeze(-1)
    _check_pair(fn, predictions, targets)
    num_classes = predictions.shape[-1]
    if apply_softmax:
        probs = (torch.sigmoid(predictions) if num_classes == 1
                 else torch.softmax(predictions, dim=-1))
    else:
        _check_probabilities(fn, flag, predictions)
        probs = predictions
    targets = targets.to(probs.dtype)
    dims = (tuple(range(1, probs.ndim - 1)) if axis is None
            else check.dims(fn, axis, probs.ndim, any_sequence=True, allow_empty=True))

    overlap = _sum(probs * targets, dims)
    false_pos = _sum(probs, dims) - overlap
    false_neg = _sum(targets, dims) - overlap
    loss = 1.0 - (overlap + smooth) / (overlap + alpha * false_pos + beta * false_neg
                                       + smooth)

    if class_weights is not None:
        if not isinstance(class_weights, torch.Tensor):
            class_weights = torch.as_tensor(class_weights)
        if class_weights.ndim != 1:
            raise ValueError(f"{fn}: class_weights must be 1-D (one weight per class), "
                             f"got shape {tuple(class_weights.shape)}")
        if loss.ndim == 0 or class_weights.shape[0] not in (1, loss.shape[-1]):
            raise ValueError(f"{fn}: class_weights must have one weight per class of the "
                             f"per-class losses of shape {tuple(loss.shape)}, got shape "
                             f"{tuple(class_weights.shape)}")
        loss = loss * class_weights.to(dtype=loss.dtype, device=loss.device)
    if ignore_background and num_classes > 1:
        loss = loss[..., 1:]
    if reduction == "mean":
        return loss.mean(dim=-1)
    if reduction == "sum":
        return loss.sum(dim=-1)
    return loss


def multiclass_generalized_dice_loss(predictions: torch.Tensor, targets: torch.Tensor, *,
                                     smooth: Scalar = 1.0, apply_softmax: bool = True,
                                     ignore_background: bool = False) -> torch.Tensor:
    r"""Generalized Dice loss: :func:`dice_loss` per class and sample, weighted by
    :math:`w_c \propto 1 / (F_c^2 + 10^{-7})` with :math:`F_c` class :math:`c`'s
    target count over every axis but the last, normalized so that
    :math:`\sum_c w_c = C`; then the mean over samples and (kept) classes, a scalar.

    ``predictions`` and ``targets`` have one shape ``[..., classes]``; rare classes weigh
    more, which counters class imbalance.
    """
    fn = "multiclass_generalized_dice_loss"
    check.floating(fn, "predictions", predictions)
    check.tensor(fn, "targets", targets)
    _check_pair(fn, predictions, targets)
    counts = _sum(targets.to(predictions.dtype), tuple(range(targets.ndim - 1)))
    weights = 1.0 / (counts * counts + _FREQUENCY_EPS)
    weights = weights * (weights.shape[0] / weights.sum())
    return _dice(fn, "apply_softmax", predictions, targets, class_weights=weights,
                 smooth=smooth, alpha=0.5, beta=0.5, apply_softmax=apply_softmax,
                 reduction="none", ignore_background=ignore_background, axis=None).mean()


def binary_dice_loss(predictions: torch.Tensor, targets: torch.Tensor, *,
                     smooth: Scalar = 1.0, apply_sigmoid: bool = True) -> torch.Tensor:
    r"""Binary Dice loss: :func:`dice_loss` with one channel (a sigmoid of the logits
    unless ``apply_sigmoid=False``), :math:`\alpha = \beta = 1/2`, averaged over it.

    ``predictions`` and ``targets`` are ``[...]`` or ``[..., 1]``; the result has the
    batch dimensions only (``[batch]`` for ``[batch, *spatial]`` inputs).
    """
    fn = "binary_dice_loss"
    check.floating(fn, "predictions", predictions)
    check.tensor(fn, "targets", targets)
    if predictions.ndim == targets.ndim and (predictions.ndim == 0
                                             or predictions.shape[-1] != 1):
        predictions, targets = predictions.unsqueeze(-1), targets.unsqueeze(-1)
    return _dice(fn, "apply_sigmoid", predictions, targets, class_weights=None,
                 smooth=smooth, alpha=0.5, beta=0.5, apply_softmax=apply_sigmoid,
                 reduction="mean", ignore_background=False, axis=None)
