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
import numbers
from collections.abc import Sequence

import torch

__all__ = [
    "cosine_distance", "cosine_similarity", "huber_loss", "l2_loss", "log_cosh",
    "squared_error",
]

Scalar = float | torch.Tensor
Axis = int | Sequence[int] | None

_LOG2 = math.log(2.0)
# Below this |error|, log(cosh(e)) is taken as log1p(2 sinh(e/2)^2), which keeps full
# relative precision for tiny errors; above it as |e| - log 2 + log1p(exp(-2|e|)), which
# never overflows. Both are exact; the switch only picks the better-conditioned one.
_LOG_COSH_SWITCH = 1.0


# --- argument checks (shared with the segmentation and self-supervised losses) ----------

def _require_tensor(x: object, name: str, *, floating: bool = False) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must have a real floating-point dtype, got {x.dtype}")
    return x


def _require_number(value: object, name: str, *, positive: bool = False,
                    non_negative: bool = False) -> None:
    """Checks a Python-number hyper-parameter; a tensor one passes unread."""
    if isinstance(value, torch.Tensor):
        return
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a real number or a tensor, got "
                        f"{type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if non_negative and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def _broadcast_shape(named: dict[str, torch.Tensor]) -> torch.Size:
    try:
        return torch.broadcast_shapes(*(t.shape for t in named.values()))
    except RuntimeError:
        shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in named.items())
        raise ValueError(f"shapes do not broadcast: {shapes}") from None


def _dims(axis: Axis, ndim: int, name: str = "axis") -> tuple[int, ...]:
    """``axis`` (an int, a sequence of ints or ``None`` for all) as sorted non-negative
    dims of an ``ndim``-dimensional tensor, checked."""
    if axis is None:
        return tuple(range(ndim))
    items = (axis,) if isinstance(axis, int) else axis
    if isinstance(items, torch.Tensor) or not isinstance(items, Sequence) or any(
            not isinstance(a, int) or isinstance(a, bool) for a in items):
        raise TypeError(f"{name} must be an int, a sequence of ints or None, got {axis!r}")
    dims = []
    for a in items:
        if not -ndim <= a < ndim:
            raise ValueError(f"{name}={axis!r} is out of range for a tensor of {ndim} "
                             f"dimension(s)")
        dims.append(a % ndim)
    if len(set(dims)) != len(dims):
        raise ValueError(f"{name}={axis!r} repeats a dimension")
    return tuple(sorted(dims))


def _sum(x: torch.Tensor, dims: tuple[int, ...], *, keepdim: bool = False) -> torch.Tensor:
    """Sum over ``dims``; an empty ``dims`` sums nothing (``torch.sum(dim=())`` would sum
    everything)."""
    return x.sum(dim=dims, keepdim=keepdim) if dims else x


def _error(predictions: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
    _require_tensor(predictions, "predictions", floating=True)
    if targets is None:
        return predictions
    _require_tensor(targets, "targets")
    _broadcast_shape({"predictions": predictions, "targets": targets})
    return predictions - targets


# --- element-wise losses ---------------------------------------------------------------

def squared_error(predictions: torch.Tensor,
                  targets: torch.Tensor | None = None) -> torch.Tensor:
    r"""Element-wise squared error :math:`(p - t)^2` (:math:`p^2` without targets).

    ``targets`` must have exactly ``predictions``' shape (as optax checks; no
    broadcasting). A mean squared error is ``squared_error(p, t).mean()``.
    """
    _require_tensor(predictions, "predictions", floating=True)
    if targets is not None:
        _require_tensor(targets, "targets")
        if targets.shape != predictions.shape:
            raise ValueError(f"targets must have predictions' shape "
                             f"{tuple(predictions.shape)}, got {tuple(targets.shape)}")
    e = _error(predictions, targets)
    return e * e


def l2_loss(predictions: torch.Tensor,
            targets: torch.Tensor | None = None) -> torch.Tensor:
    r"""Element-wise :math:`\tfrac12 (p - t)^2`: half the :func:`squared_error`, with its
    shape rule. The factor 1/2 (Bishop's convention) makes the gradient :math:`p - t`."""
    return 0.5 * squared_error(predictions, targets)


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
    _require_number(delta, "delta", positive=True)
    abs_e = _error(predictions, targets).abs()
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
    e = _error(predictions, targets)
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
    _require_tensor(predictions, "predictions", floating=True)
    _require_tensor(targets, "targets", floating=True)
    _require_number(epsilon, "epsilon", non_negative=True)
    named = {"predictions": predictions, "targets": targets}
    if where is not None:
        _require_tensor(where, "where")
        if where.dtype != torch.bool:
            raise TypeError(f"where must be a bool tensor, got dtype {where.dtype}")
        named["where"] = where
    shape = _broadcast_shape(named)
    dims = _dims(axis, len(shape))
    p, t = predictions.expand(shape), targets.expand(shape)

    def masked_sum(x: torch.Tensor, keepdim: bool) -> torch.Tensor:
        if where is not None:  # torch.where, not a product: masked NaN/inf stay out
            x = torch.where(where, x, torch.zeros((), dtype=x.dtype, device=x.device))
        return _sum(x, dims, keepdim=keepdim)

    p_norm = torch.clamp(masked_sum(p * p, True), min=epsilon).sqrt()
    t_norm = torch.clamp(masked_sum(t * t, True), min=epsilon).sqrt()
    return masked_sum((p / p_norm) * (t / t_norm), False)


def cosine_distance(predictions: torch.Tensor, targets: torch.Tensor, *,
                    epsilon: Scalar = 0.0, axis: Axis = -1,
                    where: torch.Tensor | None = None) -> torch.Tensor:
    r"""Cosine distance :math:`1 - \cos\theta`, in :math:`[0, 2]`: one minus
    :func:`cosine_similarity` with the same arguments."""
    return 1.0 - cosine_similarity(predictions, targets, epsilon=epsilon, axis=axis,
                                   where=where)
