"""``mechanize`` (optax.contrib): Mechanic (Cutkosky, Defazio and Mehta, 2023), a learned
scale of a base optimizer's updates. Eager torch ops around the base optimizer (whose own
update runs as it would alone); the global sums and every decision stay 0-d tensors on the
device (no host read).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ftopt import tree as tree_lib
from ftopt._counts import host_count, new_count, remember_count
from ftopt.base import GradientTransformation, check_transform, register_owner, register_state
from ftopt.domains import NONNEG, POSITIVE, check_finite, check_int
from ftopt.finite import safe_increment
from ftopt.rules import checked_params, compute_dtype
from ftopt.validate import check_leaf

__all__ = ["MechanicState", "mechanize"]


@register_state
class MechanicState(NamedTuple):
    """optax.contrib's ``MechanicState``: the base optimizer's state, the step count, the
    per-beta accumulators r, m, v and scales s (each of shape ``(num_betas,)``) and x0, the
    params at the first step (a copy of the params tree)."""

    base_optimizer_state: Any
    count: torch.Tensor
    r: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    s: torch.Tensor
    x0: Any


def _sum(terms: list[torch.Tensor], dtype: torch.dtype, device) -> torch.Tensor:
    """Σ of 0-d tensors on ``device`` in ``dtype`` (0 for none)."""
    if not terms:
        return torch.zeros((), dtype=dtype, device=device)
    return torch.stack([t.to(device, dtype) for t in terms]).sum()


class Mechanic:
    """The object behind :func:`mechanize` (see there)."""

    # It raises on a chain's skip_zeros mask (see mechanize): the chain must hand it over.
    mask_aware = True
    unfused_reason = ("mechanize runs eagerly: its scale comes from global dot products "
                      "of the updates, the gradients and the params")

    def __init__(self, base: GradientTransformation, weight_decay: float, eps: float,
                 s_init: float, num_betas: int):
        check_transform(base, "mechanize: argument base_optimizer")
        self.base = base
        self.wd = check_finite("mechanize", "weight_decay", weight_decay, NONNEG)
        self.eps = check_finite("mechanize", "eps", eps, NONNEG)
        self.s_init = check_finite("mechanize", "s_init", s_init, POSITIVE)
        self.num_betas = check_int("mechanize", "num_betas", num_betas, minimum=1)
        register_owner(self)

    def init(self, params) -> MechanicState:
        paths, flat, _ = checked_params(params)
        device = tree_lib.state_device(flat)
        dtype = (torch.float64 if flat and all(p.dtype == torch.float64 for p in flat)
                 else torch.float32)
        count = new_count(0, device)
        zeros = lambda: torch.zeros(self.num_betas, dtype=dtype, device=device)  # noqa: E731
        return MechanicState(
            base_optimizer_state=self.base.init(params), count=count, r=zeros(), m=zeros(),
            v=zeros(), s=torch.full((self.num_betas,), self.s_init, dtype=dtype,
                                    device=device),
            x0=tree_lib.map(torch.clone, params))

    def _check(self, updates, state, params, extra: dict):
        if extra.get("zero_mask") is not None:
            raise ValueError(
                "mechanize cannot keep skip_zeros' promise: every step moves each param "
                "along x0 − p by the learned scale s, zero gradient or not. Put skip_zeros "
                "on the base optimizer instead (mechanize(ftopt.adam(1.0, skip_zeros=True))): "
                "its states then keep their bits where the gradient is zero")
        if params is None:
            raise ValueError("mechanize needs params: call update(grads, state, params)")
        if not isinstance(state, MechanicState):
            raise TypeError(f"mechanize expects a MechanicState, got {type(state).__name__} "
                            "(a state made by another transform?)")
        for name in ("r", "m", "v", "s"):
            t = getattr(state, name)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (self.num_betas,):
                raise ValueError(f"mechanize: state.{name} must be a tensor of shape "
                                 f"({self.num_betas},) (num_betas), got "
                                 f"{getattr(t, 'shape', type(t).__name__)}")
        paths, p_flat, spec = tree_lib.flatten_with_paths(params)
        u_flat = tree_lib.flatten_like(spec, updates, "updates", paths)
        x_flat = tree_lib.flatten_like(spec, state.x0, "state x0", paths)
        for path, u, p, x in zip(paths, u_flat, p_flat, x_flat):
            if u is None:
                continue
            check_leaf(path, u, p)
            if not isinstance(x, torch.Tensor) or x.shape != p.shape:
                raise ValueError(f"state x0 at {path}: expected a tensor of shape "
                                 f"{tuple(p.shape)}, got "
                                 f"{getattr(x, 'shape', type(x).__name__)}")
        return paths, spec, u_flat, p_flat, x_flat

    def update(self, updates, state, params=None, **extra):
        paths, spec, g_flat, p_flat, x_flat = self._check(updates, state, params, extra)
        base_u, base_state = self.base.update(updates, state.base_optimizer_state, params,
                                              **extra)
        b_flat = tree_lib.flatten_like(spec, base_u, "mechanize base_optimizer's update",
                                       paths)
        dt, dev = state.s.dtype, state.s.device
        on = [i for i, g in enumerate(g_flat) if g is not None]
        for i in on:
            if b_flat[i] is None:
                raise ValueError(f"mechanize: the base optimizer's update at {paths[i]} is "
                                 "None where the gradient is a tensor")
        g = {i: g_flat[i].to(compute_dtype(g_flat[i])) for i in on}
        p = {i: p_flat[i].to(g[i].dtype) for i in on}
        # x0: the params of the first step (a pre-trained model loaded after init counts).
        known = host_count(state.count)
        if known is None:
            first = (state.count == 0).to(dev)
            x0 = {i: torch.where(first.to(p[i].device), p[i], x_flat[i].to(p[i].dtype))
                  for i in on}
        else:
            x0 = {i: p[i] if known == 0 else x_flat[i].to(p[i].dtype) for i in on}
        s_sum = state.s.sum()
        grad_norm = _sum([g[i].square().sum() for i in on], dt, dev).sqrt()
        param_norm = _sum([p[i].square().sum() for i in on], dt, dev).sqrt()
        decay = self.wd * s_sum * grad_norm / (param_norm + self.eps)
        delta_prev, h_terms = {}, []
        for i in on:
            d = decay.to(g[i].device, g[i].dtype)
            delta_prev[i] = (x0[i] - p[i]) / (s_sum.to(p[i].device, p[i].dtype) + self.eps)
            h_terms.append(((g[i] + d * p[i]) * delta_prev[i]).sum())
        h = _sum(h_terms, dt, dev)
        betas = 1.0 - 0.1 ** torch.arange(1, self.num_betas + 1, dtype=torch.float64,
                                           device=dev)
        betas = betas.to(dt)
        clipped_h = torch.maximum(torch.minimum(h, state.m), -state.m)
        m = torch.maximum(betas * state.m, h.abs() + self.eps)
        v = betas * betas * state.v + h * h
        r = betas * state.r + clipped_h * state.s
        wealth = (self.s_init / self.num_betas) * m + torch.clamp(r, min=0.0)
        s = wealth / (v.sqrt() + self.eps)
        scale = s.sum()
        out = list(g_flat)
        x0_out = list(x_flat)
        for i in on:
            delta = delta_prev[i] - b_flat[i].to(p[i].dtype)
            new_p = x0[i] - scale.to(p[i].device, p[i].dtype) * delta
            out[i] = new_p - p[i]
            if known is None:  # (a new tensor: torch.where's)
                x0_out[i] = x0[i].to(x_flat[i].dtype)
            elif known == 0:  # a copy: never the caller's params themselves
                x0_out[i] = p_flat[i].clone()
        count = safe_increment(state.count)
        if known is not None:
            remember_count(count, min(known + 1, 2**31 - 1))
        return tree_lib.unflatten(spec, out), MechanicState(
            base_optimizer_state=base_state, count=count, r=r, m=m, v=v, s=s,
            x0=tree_lib.unflatten(spec, x0_out))


def mechanize(
    base_optimizer: GradientTransformation,
    weight_decay: float = 1e-2,
    eps: float = 1e-8,
    s_init: float = 1e-6,
    num_betas: int = 6,
) -> GradientTransformation:
    """Mechanic (optax.contrib's ``mechanize``): learns the scale of ``base_optimizer``'s
    updates, so that its learning rate can be left at 1 (a schedule's shape still helps).

    With g the gradient, u the base optimizer's update, x0 the params at the first step,
    S = Σs (the previous scales), ĝ = g + wd·S·‖g‖/(‖p‖ + eps)·p (norms over the tree),
    Δ = (x0 − p)/(S + eps), h = ⟨ĝ, Δ⟩ (over the tree) and, per beta βᵢ = 1 − 10⁻ⁱ
    (i = 1 … num_betas): m ← max(β·m, |h| + eps), v ← β²·v + h², r ← β·r +
    clamp(h, −m_old, m_old)·s, s ← (s_init/num_betas·m + max(r, 0))/(√v + eps); the new
    params are x0 − Σs·(Δ − u), returned as the update (new − p).

    Eager torch ops; the sums and the first-step choice of x0 are 0-d tensors on the
    device (no host read). Scalars r, m, v, s are fp32 (float64 when every param is);
    optax keeps them in the params' lowest dtype. A ``None`` gradient leaf is left out of
    every sum and its param does not move.

    ``skip_zeros``: mechanize moves every param along x0 − p by the change of Σs, whatever
    its gradient, so the promise cannot hold: ``chain(mechanize(...), skip_zeros())``
    raises at the first update. A base optimizer built with ``skip_zeros=True`` keeps its
    states' bits where the gradient is zero (its update is ``-0.0`` there); such an element
    still moves with the scale (it stays where it is only while p = x0).

    Args:
        base_optimizer: the optimizer whose updates are scaled.
        weight_decay: >= 0, Mechanic's own decay of the gradient in h (not the base's).
        eps: >= 0. s_init: the initial scale, > 0.
        num_betas: the number of betas, an int >= 1.
    """
    obj = Mechanic(base_optimizer, weight_decay, eps, s_init, num_betas)
    return GradientTransformation(obj.init, obj.update)
