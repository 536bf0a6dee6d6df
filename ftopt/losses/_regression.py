r"""Regression losses (optax's ``optax.losses`` regression family), for torch tensors.

Element-wise losses of the error :math:`e = \text{predictions} - \text{targets}` (or of
``predictions`` alone when ``targets`` is ``None``): :func:`squared_error`,
:func:`l2_loss`, :func:`huber_loss`, :func:`log_cosh`; and the reductions over an axis
:func:`cosine_similarity` and :func:`cosine_distance`. Nothing is averaged over a
batch: each returns one loss per element (or per reduced slice), to be reduced by the
caller.

Conventions shared by every function:

* ``predictions`` and ``targets`` are torch tensors (optax also takes Python numbers and
  NumPy arrays); ``predictions`` must be real floating point, else a ``TypeError``.
* Shapes that do not fit raise a ``ValueError`` naming the arguments and their shapes.
* Differentiable with ``torch.autograd`` and ``torch.func`` (``grad``, ``vmap``, ...): no
  host reads, no branch on a tensor's value. A Python-number hyper-parameter is checked
  here; a tensor one is used as given.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ftopt.losses import _checks as check
from ftopt.losses._checks import Scalar

__all__ = [
    "cosine_distance", "cosine_similarity", "huber_loss", "l2_loss", "log_cosh",
    "squared_error",
]

Axis = int | Sequence[int] | None

_LOG2 = math.log(2.0)
# Below this |error|, log(cosh(e)) is taken as log1p(2 sinh(e/2)^2), which keeps full
# relative precision for tiny errors; above it as |e| - log 2 + log1p(exp(-2|e|)), which
# never overflows. Both are exact; the switch only picks the better-conditioned one.
_LOG_COSH_SWITCH = 1.0


# --- helpers ---------------------------------------------------------------------------

def _sum(x: torch.Tensor, dims: tuple[int, ...], *, keepdim: bool = False) -> torch.Tensor:
    """Sum over ``dims``; an empty ``dims`` sums nothing (``torch.sum(dim=())`` would sum
    everything)."""
    return x.sum(dim=dims, keepdim=keepdim) if dims else x


def _check_args(fn: str, predictions: torch.Tensor, targets: torch.Tensor | None) -> None:
    check.floating(fn, "predictions", predictions)
    if targets is not None:
        check.tensor(fn, "targets", targets)
        check.broadcast(fn, {"predictions": predictions, "targets": targets})


def _error(fn: str, predictions: torch.Tensor,
           targets: torch.Tensor | None) -> torch.Tensor:
    _check_args(fn, predictions, targets)
    return predictions if targets is None else predictions - targets


# --- element-wise losses ---------------------------------------------------------------

def squared_error(predictions: torch.Tensor,
                  targets: torch.Tensor | None = None) -> torch.Tensor:
    r"""Element-wise squared error :math:`(p - t)^2` (:math:`p^2` without targets).

    ``targets`` must have exactly ``predictions``' shape (as optax checks; no
    broadcasting). A mean squared error is ``squared_error(p, t).mean()``.
    """
    return _squared_error("squared_error", predictions, targets)


def l2_loss(predictions: torch.Tensor,
            targets: torch.Tensor | None = None) -> torch.Tensor:
    r"""Element-wise :math:`\tfrac12 (p - t)^2`: half the :func:`squared_error`, with its
    shape rule. The factor 1/2 (Bishop's convention) makes the gradient :math:`p - t`."""
    return 0.5 * _squared_error("l2_loss", predictions, targets)


def _squared_error(fn: str, predictions: torch.Tensor,
                   targets: torch.Tensor | None) -> torch.Tensor:
    check.floating(fn, "predictions", predictions)
    if targets is not None:
        check.tensor(fn, "targets", targets)
        if targets.shape != predictions.shape:
            raise ValueError(f"{fn}: targets must have predictions' shape "
                             f"{tuple(predictions.shape)}, got {tuple(targets.shape)}")
    e = _error(fn, predictions, targets)
    return e * e


def huber_loss(predictions: torch.Tensor, targets: torch.Tensor | None = None, *,
               delta: Scalar = 1.0) -> torch.Tensor:
    r"""Element-wise Huber loss of :math:`e = p - t`:

    .. math::
        \tfrac12 e^2 \ \text{if}\ |e| \le \delta, \qquad
        \delta\,(|e| - \tfrac12\delta) \ \text{otherwise}.

    Quadratic near zero, linear far away: its gradient is :math:`e` clipped to
    :math:`[-\delta, \delta]`. ``targets`` broadcasts against ``predictions``; ``delta``
    (a number > 0, or a tensor that broadcasts) is the switch point.
    """
    fn = "huber_loss"
    check.number(fn, "delta", delta, "> 0")
    _check_args(fn, predictions, targets)
    if (targets is not None and targets.dtype == predictions.dtype
            and not isinstance(delta, torch.Tensor)):
        # torch's one kernel of the same function (forward and backward)
        p, t = torch.broadcast_tensors(predictions, targets)
        return torch.nn.functional.huber_loss(p, t, reduction="none", delta=float(delta))
    abs_e = (predictions if targets is None else predictions - targets).abs()
    # min(|e|, delta) carries the quadratic part, the excess over delta the linear part;
    # written this way no branch ever squares a large error.
    inner = torch.clamp(abs_e, max=delta)
    return 0.5 * inner * inner + delta * (abs_e - inner)


def log_cosh(predictions: torch.Tensor,
             targets: torch.Tensor | None = None) -> torch.Tensor:
    r"""Element-wise :math:`\log\cosh(p - t)`: about :math:`e^2/2` for small errors and
    :math:`|e| - \log 2` for large ones, a smooth (twice differentiable) Huber loss whose
    gradient is :math:`\tanh(e)`.

    Evaluated without overflow for any finite error, and to full relative precision for
    tiny ones. ``targets`` broadcasts against ``predictions``.
    """
    e = _error("log_cosh", predictions, targets)
    abs_e = e.abs()
    small = abs_e < _LOG_COSH_SWITCH
    # cosh(e) - 1 = 2 sinh(e/2)^2 exactly, so log1p of it has no cancellation near 0. The
    # small branch sees 0 where it is not taken, so its gradient stays finite there.
    half = torch.where(small, e, torch.zeros_like(e)) * 0.5
    near = torch.log1p(2.0 * torch.sinh(half) ** 2)
    far = abs_e + torch.log1p(torch.exp(-2.0 * abs_e)) - _LOG2
    return torch.where(small, near, far)


# --- reductions over an axis -----------------------------------------------------------

def cosine_similarity(predictions: torch.Tensor, targets: torch.Tensor, *,
                      epsilon: Scalar = 0.0, axis: Axis = -1,
                      where: torch.Tensor | None = None) -> torch.Tensor:
    r"""Cosine of the angle between ``predictions`` and ``targets`` along ``axis``:

    .. math::
        \sum_i \frac{p_i}{\max(\|p\|^2, \epsilon)^{1/2}}
               \frac{t_i}{\max(\|t\|^2, \epsilon)^{1/2}}

    over the elements of ``axis`` (an int, a tuple of ints, or ``None`` for all) that
    ``where`` (a bool tensor, or ``None`` for all) selects; ``epsilon`` clips the
    *squared* norms, so the smallest norm used is :math:`\sqrt{\epsilon}`
    (``torch.nn.functional.cosine_similarity``'s ``eps`` clips the norms themselves).

    ``predictions``, ``targets`` and ``where`` broadcast to one shape (optax broadcasts
    only the final product; the norms here are those of the broadcast vectors), and the
    result has that shape without ``axis``. With the default ``epsilon=0`` a zero
    vector gives NaN, as in optax.
    """
    return _cosine_similarity("cosine_similarity", predictions, targets, epsilon, axis,
                              where)


def cosine_distance(predictions: torch.Tensor, targets: torch.Tensor, *,
                    epsilon: Scalar = 0.0, axis: Axis = -1,
                    where: torch.Tensor | None = None) -> torch.Tensor:
    r"""Cosine distance :math:`1 - \cos\theta`, in :math:`[0, 2]`: one minus
    :func:`cosine_similarity` with the same arguments."""
    return 1.0 - _cosine_similarity("cosine_distance", predictions, targets, epsilon, axis,
                                    where)


def _cosine_similarity(fn: str, predictions: torch.Tensor, targets: torch.Tensor,
                       epsilon: Scalar, axis: Axis,
                       where: torch.Tensor | None) -> torch.Tensor:
    check.floating(fn, "predictions", predictions)
    check.floating(fn, "targets", targets)
    check.number(fn, "epsilon", epsilon, ">= 0")
    named = {"predictions": predictions, "targets": targets}
    if where is not None:
        named["where"] = check.boolean(fn, "where", where)
    shape = check.broadcast(fn, named)
    dims = check.dims(fn, axis, len(shape), any_sequence=True, allow_empty=True)
    p, t = predictions.expand(shape), targets.expand(shape)

    def masked_sum(x: torch.Tensor, keepdim: bool) -> torch.Tensor:
        if where is not None:  # torch.where, not a product: masked NaN/inf stay out
            x = torch.where(where, x, torch.zeros((), dtype=x.dtype, device=x.device))
        return _sum(x, dims, keepdim=keepdim)

    p_norm = torch.clamp(masked_sum(p * p, True), min=epsilon).sqrt()
    t_norm = torch.clamp(masked_sum(t * t, True), min=epsilon).sqrt()
    return masked_sum((p / p_norm) * (t / t_norm), False)

