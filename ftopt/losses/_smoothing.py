r"""Label smoothing (optax's ``optax.losses.smooth_labels``), for torch tensors.

Smoothed labels mix the one-hot targets with the uniform distribution over the classes;
used with a cross entropy they favour small logit gaps and better calibrated predictions
(Müller et al., *When does label smoothing help?*, 2019).
"""

from __future__ import annotations

import math
import numbers

import torch

__all__ = ["smooth_labels"]


def _dims(axis: int | tuple[int, ...] | None, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    axes = axis if isinstance(axis, tuple) else (axis,)
    if not axes or any(isinstance(a, bool) or not isinstance(a, int) for a in axes):
        raise TypeError("smooth_labels: axis must be an int, a non-empty tuple of ints or "
                        f"None, got {axis!r}")
    if any(not -ndim <= a < ndim for a in axes):
        raise ValueError(f"smooth_labels: axis {axis!r} is out of range for {ndim} "
                         "dimensions")
    dims = tuple(a % ndim for a in axes)
    if len(set(dims)) != len(dims):
        raise ValueError(f"smooth_labels: axis {axis!r} repeats a dimension")
    return dims


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
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"{fn}: labels must be a torch.Tensor, got {type(labels).__name__}")
    if not labels.is_floating_point():
        raise TypeError(f"{fn}: labels must be a real floating-point tensor, got "
                        f"{labels.dtype}")
    if not isinstance(alpha, torch.Tensor):
        if not isinstance(alpha, numbers.Real) or isinstance(alpha, bool):
            raise TypeError(f"{fn}: alpha must be a number or a tensor, got "
                            f"{type(alpha).__name__}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"{fn}: alpha must be in [0, 1], got {alpha}")
    dims = _dims(axis, labels.ndim)
    if where is None:
        classes: float | torch.Tensor = float(math.prod(labels.shape[d] for d in dims))
    else:
        if not isinstance(where, torch.Tensor) or where.dtype != torch.bool:
            got = where.dtype if isinstance(where, torch.Tensor) else type(where).__name__
            raise TypeError(f"{fn}: where must be a bool tensor, got {got}")
        try:
            where = where.expand(labels.shape)
        except RuntimeError:
            raise ValueError(f"{fn}: where of shape {tuple(where.shape)} does not broadcast "
                             f"to the labels' shape {tuple(labels.shape)}") from None
        classes = where.sum(dims, keepdim=True).to(labels.dtype) if dims else where.to(
            labels.dtype)
    return (1.0 - alpha) * labels + alpha / classes
