"""``cautious`` (optax.contrib): Cautious Optimizers (Liang et al., 2024). A base
optimizer's update is kept only where it moves against the gradient, and the kept part is
scaled per tensor so that its mean magnitude stays the same. Eager torch ops around the
base optimizer, whose own update runs as it would alone (fused where it can be).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ftopt import tree as tree_lib
from ftopt.base import GradientTransformation, check_transform, register_owner, register_state
from ftopt.domains import NONNEG, check_finite
from ftopt.rules import compute_dtype

__all__ = ["CautiousState", "cautious"]


@register_state
class CautiousState(NamedTuple):
    """optax.contrib's ``CautiousState``: the base optimizer's state."""

    base_optimizer_state: Any


class Cautious:
    """The object behind :func:`cautious` (see there)."""

    unfused_reason = ("cautious runs eagerly: each leaf's update is scaled by the share "
                      "of its elements that move against the gradient")

    def __init__(self, base: GradientTransformation, eps: float):
        check_transform(base, "cautious: argument base_optimizer")
        self.base = base
        self.eps = check_finite("cautious", "eps", eps, NONNEG)
        register_owner(self)

    @property
    def transforms(self) -> tuple[GradientTransformation, ...]:
        return (self.base,)

    def rebuild(self, transforms) -> GradientTransformation:
        obj = Cautious(transforms[0], self.eps)
        return GradientTransformation(obj.init, obj.update)

    def init(self, params) -> CautiousState:
        return CautiousState(self.base.init(params))

    def update(self, updates, state, params=None, **extra):
        if not isinstance(state, CautiousState):
            raise TypeError(f"cautious expects a CautiousState, got {type(state).__name__} "
                            "(a state made by another transform?)")
        paths, g_flat, spec = tree_lib.flatten_with_paths(updates)
        base_u, base_state = self.base.update(updates, state.base_optimizer_state, params,
                                              **extra)
        u_flat = tree_lib.flatten_like(spec, base_u, "cautious base_optimizer's update",
                                       paths)
        out = [_cautious(path, u, g, self.eps) for path, u, g in zip(paths, u_flat, g_flat)]
        return tree_lib.unflatten(spec, out), CautiousState(base_state)


def _cautious(path: str, u, g, eps: float):
    """One leaf: ``u · 1[u·g < 0] · n / (Σ 1[u·g < 0] + eps)``. The condition is taken
    from the signs (exact: a product that underflows to 0 would drop the element), and a
    NaN in ``u`` stays a NaN, as in the product form."""
    if g is None:
        return u
    if g.is_complex():
        raise TypeError(f"cautious: the gradient at {path} is {g.dtype}: expected a real "
                        "floating-point tensor (a complex number has no sign to agree "
                        "with; ftopt.split_real_and_imaginary(cautious(...)) steps the "
                        "real and imaginary parts)")
    if u is None:
        raise ValueError(f"cautious: the base optimizer's update at {path} is None where "
                         "the gradient is a tensor")
    if not (isinstance(u, torch.Tensor) and u.is_floating_point() and u.shape == g.shape
            and u.device == g.device):
        got = (f"{u.dtype} of shape {tuple(u.shape)} on {u.device}"
               if isinstance(u, torch.Tensor) else type(u).__name__)
        raise ValueError(f"cautious: the base optimizer's update at {path}: expected a "
                         f"floating-point tensor of the gradient's shape {tuple(g.shape)} "
                         f"on {g.device}, got {got}")
    cd = compute_dtype(u)
    keep = ((u < 0) & (g > 0)) | ((u > 0) & (g < 0))
    kept = keep.sum(dtype=torch.float64)
    scale = (u.numel() / (kept + eps)).to(cd)
    return (u.to(cd) * keep.to(cd) * scale).to(u.dtype)


def cautious(base_optimizer: GradientTransformation,
             eps: float = 1e-8) -> GradientTransformation:
    """Cautious wrapper (optax.contrib's ``cautious``): each leaf's update ``u`` from
    ``base_optimizer`` is kept where it moves against the gradient ``g`` (``u·g < 0``,
    a descent direction for ``p + u``) and zeroed elsewhere, and the kept elements are
    scaled by ``n / (k + eps)`` (``n`` elements in the leaf, ``k`` kept), so the mean
    magnitude is preserved. ``eps=1.0`` is the paper's, which damps the update when few
    elements agree.

    Runs eagerly around the base optimizer's update (fused where it can be). In a chain
    with ``skip_zeros`` the base optimizer receives the chain's mask, so its states keep
    their bits where the gradient is zero; the update there is ``-0.0`` (a zero gradient
    never agrees, so it also counts as not kept).
    """
    obj = Cautious(base_optimizer, eps)
    return GradientTransformation(obj.init, obj.update)
