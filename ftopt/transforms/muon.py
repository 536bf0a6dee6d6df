"""Muon (optax.contrib): ``scale_by_muon`` (Nesterov momentum, fused, then a Newton-Schulz
orthogonalisation, a matrix stage) and ``scale_by_shape``.

The momentum is an elementwise rule; the Newton-Schulz iteration is a matrix stage
(:mod:`ftopt.matrix`) that stacks leaves of one shape and runs their iterations as one
``bmm`` chain.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ftopt.base import GradientTransformation, register_state
from ftopt.combine import chain
from ftopt.domains import NONNEG, UNIT_OPEN, check_finite
from ftopt.matrix import matrix_transform
from ftopt.matrix_views import MuonDimensionNumbers
from ftopt.rule_transform import rule_transform
from ftopt.rules import Rule, Slot

__all__ = ["MuonMomentumState", "MuonDimensionNumbers", "scale_by_muon", "scale_by_shape",
           "newton_schulz", "DEFAULT_NS_COEFFS"]

Float = float | torch.Tensor
DEFAULT_NS_COEFFS = (3.4445, -4.7750, 2.0315)
# optax's presets (a name in place of ns_coeffs): Dion's per-step rows
NS_COEFFS_PRESETS: dict[str, Any] = {
    "standard": DEFAULT_NS_COEFFS,
    "dion": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377),
             (3.7418, -5.5913, 2.3037), (2.8769, -3.1427, 1.2046),
             (2.8366, -3.0525, 1.2012)),
}
PRECONDITIONINGS = ("frobenius", "spectral")


@register_state
class MuonMomentumState(NamedTuple):
    """Muon's step count and momentum."""

    count: torch.Tensor
    mu: Any


def _momentum_scalars(t, h):
    beta = h["beta"]
    return {"one_minus_beta": 1 - beta, "bc": 1 - beta**t, "bc_next": 1 - beta ** (t + 1)}


def momentum_stage(nesterov: bool, beta: Float) -> GradientTransformation:
    """mu ← β·mu + (1−β)·u; u ← β·mu/(1−β^{t+1}) + (1−β)·u/(1−βᵗ) (Nesterov, as optax)
    or mu/(1−βᵗ)."""

    def body(o, x):
        mu = o.lerp(x.mu, x.u, x.one_minus_beta)
        if nesterov:
            return x.beta * mu / x.bc_next + x.one_minus_beta * x.u / x.bc, {"mu": mu}
        return mu / x.bc, {"mu": mu}

    return rule_transform(Rule(
        "muon_momentum", body, state_class=MuonMomentumState, slots=(Slot("mu"),),
        hparams={"beta": beta}, domains={"beta": UNIT_OPEN}, scalars=_momentum_scalars,
        counted=True))


def _coefficients(ns_coeffs: Any, ns_steps: int) -> list[tuple[float, float, float]]:
    """One ``(a, b, c)`` per iteration: a triple repeated ``ns_steps`` times, or optax's
    per-step rows (at most ``ns_steps`` of them, the last ``ns_steps`` used), or the name
    of one of optax's presets (:data:`NS_COEFFS_PRESETS`)."""
    if isinstance(ns_coeffs, str):
        if ns_coeffs not in NS_COEFFS_PRESETS:
            raise ValueError(f"scale_by_muon: unknown ns_coeffs preset {ns_coeffs!r}, "
                             f"expected one of {sorted(NS_COEFFS_PRESETS)}")
        ns_coeffs = NS_COEFFS_PRESETS[ns_coeffs]
    rows = [tuple(float(c) for c in r) for r in ns_coeffs] if (
        len(ns_coeffs) and isinstance(ns_coeffs[0], Sequence)) else None
    if rows is None:
        if len(ns_coeffs) != 3:
            raise ValueError(f"scale_by_muon: ns_coeffs must have shape (3,) or (n, 3), got "
                             f"{len(ns_coeffs)} values")
        return [tuple(float(c) for c in ns_coeffs)] * ns_steps
    if any(len(r) != 3 for r in rows) or not rows:
        raise ValueError("scale_by_muon: ns_coeffs must have shape (3,) or (n, 3)")
    if len(rows) > ns_steps:
        raise ValueError(f"scale_by_muon: not enough coefficients to perform {ns_steps} "
                         f"steps (got {len(rows)} rows)")
    return rows[-ns_steps:]


def newton_schulz(x: torch.Tensor, coeffs: Sequence[tuple[float, float, float]],
                  eps: float = 1e-8, preconditioning: str = "frobenius",
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """Orthogonalise a batch of matrices ``(B, m, n)`` as optax does: transpose tall ones,
    divide each by its Frobenius (or spectral) norm + eps, then per ``(a, b, c)``:
    A = X·Xᵀ, X ← a·X + (b·A + c·A·A)·X. ``dtype``: the dtype of the iterations (the
    normalisation is done in ``x``'s dtype); the result is in ``x``'s dtype."""
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.transpose(-2, -1)
    if preconditioning == "frobenius":
        norm = torch.linalg.matrix_norm(x, ord="fro", keepdim=True)
    else:
        norm = torch.linalg.matrix_norm(x, ord=2, keepdim=True)
    y = (x / (norm + eps)).to(dtype or x.dtype)
    for a, b, c in coeffs:
        gram = y @ y.transpose(-2, -1)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c) if gram.dim() == 3 else (
            b * gram + c * gram @ gram)
        y = torch.baddbmm(y, poly, y, beta=a) if y.dim() == 3 else a * y + poly @ y
    y = y.to(x.dtype)
    return y.transpose(-2, -1) if tall else y


def _ns_dtype(batch: torch.Tensor, ns_dtype: torch.dtype | None) -> torch.dtype:
    if ns_dtype is not None:
        return ns_dtype
    return torch.bfloat16 if batch.device.type == "cuda" else batch.dtype


def orthogonalise(ns_coeffs: Any, ns_steps: int, eps: float, adaptive: bool,
                   preconditioning: str, ns_dtype: torch.dtype | None, dims: Any
                   ) -> GradientTransformation:
    coeffs = _coefficients(ns_coeffs, ns_steps)

    def fn(batch: torch.Tensor) -> torch.Tensor:
        out = newton_schulz(batch, coeffs, eps, preconditioning, _ns_dtype(batch, ns_dtype))
        if adaptive:  # scale by the dual norm ⟨mu_hat, O⟩ of the update
            out = (batch * out).sum(dim=(-2, -1), keepdim=True) * out
        return out

    return matrix_transform("newton_schulz", fn, dims=dims)


def check_muon_options(who: str, ns_steps: Any, preconditioning: Any, ns_dtype: Any) -> None:
    """Raise (naming ``who``) unless the Newton-Schulz options are valid."""
    if not isinstance(ns_steps, int) or isinstance(ns_steps, bool) or ns_steps < 1:
        raise ValueError(f"{who}: ns_steps must be an int >= 1, got {ns_steps!r}")
    if preconditioning not in PRECONDITIONINGS:
        raise ValueError(f"{who}: preconditioning must be one of {PRECONDITIONINGS}, "
                         f"got {preconditioning!r}")
    if ns_dtype is not None and not (isinstance(ns_dtype, torch.dtype)
                                     and ns_dtype.is_floating_point):
        raise TypeError(f"{who}: ns_dtype must be a floating torch.dtype or None, "
                        f"got {ns_dtype!r}")


def scale_by_muon(
    ns_coeffs: Sequence = DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    beta: Float = 0.95,
    eps: float = 1e-8,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: str = "frobenius",
    ns_dtype: torch.dtype | None = None,
    weight_dimension_numbers: Any = None,
) -> GradientTransformation:
    """Muon's update (optax.contrib.scale_by_muon): momentum orthogonalised by Newton-Schulz.

    mu ← β·mu + (1−β)·u; m̂ = β·mu/(1−β^{t+1}) + (1−β)·u/(1−βᵗ) with ``nesterov``, else
    mu/(1−βᵗ); then each 2-D leaf's m̂ is orthogonalised (:func:`newton_schulz`, optax's
    quintic iteration with ``(a, b, c) = (3.4445, −4.7750, 2.0315)`` ``ns_steps`` times);
    ``adaptive`` scales the result O by ⟨m̂, O⟩. Leaves that are not 2-D get m̂ as it is
    (the :func:`ftopt.muon` alias gives them Adam, as optax does).

    A chain of an elementwise rule (the momentum: fused) and a matrix stage (leaves of one
    shape in one ``bmm`` chain). Its state is ``(MuonMomentumState(count, mu),
    EmptyState())`` (optax keeps ``ns_coeffs`` in the state too; here they are constants).

    Args:
        ns_coeffs: ``(a, b, c)``, one such row per iteration, or a preset's name
            (``"standard"``, ``"dion"``: optax's) (default: optax's standard triple).
        ns_steps: iterations, >= 1 (default: 5).
        beta: momentum decay, in [0, 1) (default: 0.95).
        eps: added to the norm that scales m̂ before the iterations, >= 0 (default: 1e-8).
        nesterov: Nesterov momentum (default: True).
        adaptive: scale by the dual norm of m̂ (default: False).
        preconditioning: ``"frobenius"`` (default) or ``"spectral"``: the norm m̂ is
            divided by (optax's ``"aol"`` and ``"schatten"`` are not supported).
        ns_dtype: the dtype of the iterations. ``None`` (default): bfloat16 on CUDA (as
            the reference PyTorch implementation; about 3 significant digits, the
            orthogonalisation tolerates that) and the update's dtype (fp32) elsewhere,
            which is optax's math exactly.
        weight_dimension_numbers: which leaves are matrices, and how
            (:class:`MuonDimensionNumbers`: one for every leaf, a tree of them and
            ``None`` like the params or a prefix of them, or a function of the updates
            giving one). A leaf's batch axes (those neither reduction nor output axes)
            index separate matrices, each orthogonalised on its own; a ``None`` leaf gets
            m̂ as it is. ``None`` (default): every 2-D leaf is one matrix.
    """
    eps = check_finite("scale_by_muon", "eps", eps, NONNEG)
    check_muon_options("scale_by_muon", ns_steps, preconditioning, ns_dtype)
    return chain(momentum_stage(nesterov, beta),
                 orthogonalise(ns_coeffs, ns_steps, eps, adaptive, preconditioning,
                                ns_dtype, weight_dimension_numbers))


def scale_by_shape(consistent_rms: float | None = None,
                   weight_dimension_numbers: Any = None) -> GradientTransformation:
    """Scale each 2-D leaf by a factor of its shape ``(fan_in, fan_out)``, as optax.contrib:
    √max(1, fan_out/fan_in), or √max(fan_in, fan_out)·consistent_rms.

    optax reads a matrix as ``x @ W`` (rows: fan_in). A ``torch.nn.Linear`` weight is
    ``(out, in)``: the same formula on it gives √max(1, in/out). Leaves that are not 2-D
    pass through. With ``weight_dimension_numbers`` (see :func:`scale_by_muon`) the leaves
    named there are scaled, fan_in the product of their reduction axes and fan_out of
    their output axes. A matrix stage (a multiply per shape).
    """
    if consistent_rms is not None:
        consistent_rms = check_finite("scale_by_shape", "consistent_rms", consistent_rms,
                                      NONNEG)

    def fn(batch: torch.Tensor) -> torch.Tensor:
        fan_in, fan_out = batch.shape[-2], batch.shape[-1]
        if consistent_rms is None:
            return batch * max(1.0, fan_out / fan_in) ** 0.5
        return batch * (max(fan_in, fan_out) ** 0.5 * consistent_rms)

    return matrix_transform("scale_by_shape", fn, dims=weight_dimension_numbers)
