r"""Label smoothing (optax's ``optax.losses.smooth_labels``), for torch tensors.

Smoothed labels mix the one-hot targets with the uniform distribution over the classes;
used with a cross entropy they favour small logit gaps and better calibrated predictions
(Müller et al., *When does label smoothing help?*, 2019).
"""

from __future__ import annotations

import math

import torch

from ftopt.losses import _checks as check

__all__ = ["smooth_labels"]


def smooth_labels(labels: torch.Tensor, alpha: float | torch.Tensor, *,
                  axis: int | tuple[int, ...] | None = -1,
                  where: torch.Tensor | None = None) -> torch.Tensor:
    r"""Smoothed labels :math:`(1 - \alpha)\, y + \alpha / K`, with :math:`K` the number of
    classes: the size of ``axis`` (the product of the sizes for a tuple, every element
    for ``None``), or with ``where`` (a bool tensor broadcastable to the labels' shape)
    the number of included elements along ``axis``.

    ``labels`` is a floating-point tensor (one-hot or probabilities); the result has its
    shape and dtype. Excluded elements are smoothed too, as in optax; a row with no
    included element divides by zero. A number ``alpha`` must be in [0, 1]; a tensor's
    value is not read (so the function works under ``torch.func`` transforms).
    """
    fn = "smooth_labels"
    check.floating(fn, "labels", labels)
    check.number(fn, "alpha", alpha, "in [0, 1]")
    dims = check.dims(fn, axis, labels.ndim)
    where = check.mask(fn, where, labels.shape, of="the labels'")
    if where is None:
        classes: float | torch.Tensor = float(math.prod(labels.shape[d] for d in dims))
    else:
        classes = where.sum(dims, keepdim=True).to(labels.dtype) if dims else where.to(
            labels.dtype)
    return (1.0 - alpha) * labels + alpha / classes
