"""MoMo (Schaipp et al. 2023, optax.contrib's ``momo`` and ``momo_adam``): SGD with
momentum, or Adam, whose step is capped by a Polyak-type step from the loss passed to
``update`` as ``value=`` and a lower bound of the loss. Eager torch ops; every decision a
``torch.where`` on 0-d tensors (no host read).

``skip_zeros`` (SPEC §3): where the raw gradient is zero the momenta keep their bits and
the update is ``-0.0`` (weight decay included); the tree's sums (⟨u, p⟩, ⟨m, p⟩, ‖m‖²)
see a skipped element's update as the zero it is and its momentum as kept.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import torch

from ftopt import tree as tree_lib
from ftopt.base import GradientTransformation, register_owner, register_state
from ftopt.domains import NONNEG, UNIT, UNIT_OPEN, check_finite
from ftopt.finite import safe_increment
from ftopt.program import skip_update
from ftopt.rules import checked_params, compute_dtype, state_dtype
from ftopt.schedules import ScalarOrSchedule
from ftopt.validate import check_leaf

__all__ = ["MomoState", "MomoAdamState", "momo", "momo_adam"]

_TINY = sys.float_info.epsilon  # optax: jnp.finfo(float).eps


@register_state
class MomoState(NamedTuple):
    """optax.contrib's ``MomoState``: the momentum, the averaged loss, ⟨g, p⟩'s average,
    the loss' lower bound (0-d) and the step count."""

    exp_avg: Any
    barf: torch.Tensor
    gamma: torch.Tensor
    lb: torch.Tensor
    count: torch.Tensor


@register_state
class MomoAdamState(NamedTuple):
    """optax.contrib's ``MomoAdamState``: :class:`MomoState` with Adam's second moment."""

    exp_avg: Any
    exp_avg_sq: Any
    barf: torch.Tensor
    gamma: torch.Tensor
    lb: torch.Tensor
    count: torch.Tensor


def _dot(a: list, b: list, dtype: torch.dtype, device) -> torch.Tensor:
    if not a:
        return torch.zeros((), dtype=dtype, device=device)
    return torch.stack([(x * y).sum().to(device) for x, y in zip(a, b)]).sum()


class Momo:
    """The object behind :func:`momo` and :func:`momo_adam` (see there)."""

    mask_aware = True
    update_keywords = ("value",)

    def __init__(self, name: str, learning_rate: ScalarOrSchedule, b1: float, b2: float | None,
                 eps: float, lower_bound: float, weight_decay: float, adapt: bool):
        self.name, self.adam = name, b2 is not None
        self.unfused_reason = f"{name} runs eagerly: it reads the loss passed to update as value="
        if not callable(learning_rate):
            learning_rate = check_finite(name, "learning_rate", learning_rate, NONNEG)
        self.learning_rate = learning_rate
        self.b1 = check_finite(name, "b1" if self.adam else "beta", b1,
                               UNIT_OPEN if self.adam else UNIT)
        self.b2 = None if b2 is None else check_finite(name, "b2", b2, UNIT_OPEN)
        self.eps = check_finite(name, "eps", eps, NONNEG)
        self.lower_bound = check_finite(name, "lower_bound", lower_bound)
        self.wd = check_finite(name, "weight_decay", weight_decay, NONNEG)
        self.adapt = bool(adapt)
        register_owner(self)

    def init(self, params) -> MomoState | MomoAdamState:
        paths, flat, spec = checked_params(params)
        zeros = lambda: tree_lib.unflatten(spec, [  # noqa: E731
            torch.zeros(p.shape, dtype=state_dtype(p), device=p.device) for p in flat])
        device = tree_lib.state_device(flat)
        dtype = (torch.float64 if flat and all(p.dtype == torch.float64 for p in flat)
                 else torch.float32)
        scalars = dict(barf=torch.zeros((), dtype=dtype, device=device),
                       gamma=torch.zeros((), dtype=dtype, device=device),
                       lb=torch.full((), self.lower_bound, dtype=dtype, device=device),
                       count=torch.zeros((), dtype=torch.int32, device=device))
        if self.adam:
            return MomoAdamState(zeros(), zeros(), **scalars)
        return MomoState(zeros(), **scalars)

    def _flat(self, updates, state, params, zero_mask):
        if params is None:
            raise ValueError(f"{self.name} needs params: call update(updates, state, params, "
                             "value=loss)")
        want = MomoAdamState if self.adam else MomoState
        if not isinstance(state, want):
            raise TypeError(f"{self.name}: expected a {want.__name__}, got "
                            f"{type(state).__name__}")
        paths, p_flat, spec = tree_lib.flatten_with_paths(params)
        u_flat = tree_lib.flatten_like(spec, updates, "updates", paths)
        slots = [tree_lib.flatten_like(spec, state.exp_avg, "state exp_avg", paths)]
        if self.adam:
            slots.append(tree_lib.flatten_like(spec, state.exp_avg_sq, "state exp_avg_sq",
                                               paths))
        for i, (path, u, p) in enumerate(zip(paths, u_flat, p_flat)):
            if u is None:
                continue
            check_leaf(path, u, p)
            for name, leaves in zip(("exp_avg", "exp_avg_sq"), slots):
                s = leaves[i]
                if not isinstance(s, torch.Tensor) or s.shape != u.shape:
                    raise ValueError(f"state {name} at {path}: expected a tensor of shape "
                                     f"{tuple(u.shape)}, got "
                                     f"{getattr(s, 'shape', type(s).__name__)}")
        zero = (tree_lib.flatten_like(spec, zero_mask, "zero_mask", paths)
                if zero_mask is not None else [None] * len(u_flat))
        return spec, u_flat, p_flat, slots, zero

    def update(self, updates, state, params=None, *, value: Any = None, zero_mask=None,
               **extra):
        del extra
        if value is None:
            raise TypeError(f"{self.name}: update needs the loss as value= "
                            "(tx.update(grads, state, params, value=loss))")
        spec, u_flat, p_flat, slots, zero = self._flat(updates, state, params, zero_mask)
        dt, dev = state.barf.dtype, state.barf.device
        on = [i for i, u in enumerate(u_flat) if u is not None]
        u = {i: u_flat[i].to(compute_dtype(u_flat[i])) for i in on}
        p = {i: p_flat[i].to(u[i].dtype) for i in on}
        for i in on:  # a skipped element's update is the zero it is
            if zero[i] is not None:
                u[i] = torch.where(zero[i], 0.0, u[i])
        count = state.count
        new_count = safe_increment(count)
        # (MoMo's first step takes the gradient as it is; MoMo-Adam's is bias-corrected.)
        b1 = torch.full((), self.b1, dtype=dt, device=dev)
        if not self.adam:
            b1 = torch.where(count.to(dev) == 0, torch.zeros_like(b1), b1)
        loss = torch.as_tensor(value, dtype=dt, device=dev).reshape(())
        barf = b1 * state.barf + (1 - b1) * loss
        m, v, denom = {}, {}, {}
        for i in on:
            old = slots[0][i].to(u[i].dtype)
            b = b1.to(u[i].device, u[i].dtype)
            m[i] = b * old + (1 - b) * u[i]
            if zero[i] is not None:
                m[i] = torch.where(zero[i], old, m[i])
        if self.adam:
            bc1 = (1 - self.b1 ** new_count.to(torch.float64)).to(dt)
            bc2 = (1 - self.b2 ** new_count.to(torch.float64)).to(dt)
            for i in on:
                old = slots[1][i].to(u[i].dtype)
                v[i] = self.b2 * old + (1 - self.b2) * u[i] * u[i]
                if zero[i] is not None:
                    v[i] = torch.where(zero[i], old, v[i])
                denom[i] = self.eps + torch.sqrt(v[i] / bc2.to(u[i].device))
            norm = _dot([m[i] for i in on], [m[i] / denom[i] for i in on], dt, dev)
        else:
            bc1 = torch.ones((), dtype=dt, device=dev)
            norm = _dot([m[i] for i in on], [m[i] for i in on], dt, dev)
        gamma = b1 * state.gamma + (1 - b1) * _dot([u[i] for i in on], [p[i] for i in on],
                                                   dt, dev)
        iprod = _dot([m[i] for i in on], [p[i] for i in on], dt, dev)
        alpha = self.learning_rate(count) if callable(self.learning_rate) \
            else self.learning_rate
        alpha = torch.as_tensor(alpha, dtype=dt, device=dev)
        decay = 1 + alpha * self.wd
        lb = state.lb
        if self.adapt:
            cap = decay * (barf - gamma) + iprod
            lb = torch.where(cap < decay * bc1 * state.lb,
                             torch.clamp(cap / (2 * bc1 * decay), min=self.lower_bound),
                             state.lb)
        t1 = torch.clamp(decay * (barf - bc1 * lb - gamma) + iprod, min=0.0) / norm
        t1 = torch.where(norm <= _TINY, torch.zeros_like(t1), t1)
        tau = torch.minimum(alpha / bc1, t1)
        shrink = alpha * self.wd / decay
        out = list(u_flat)
        for i in on:
            step = m[i] / denom[i] if self.adam else m[i]
            new = -shrink.to(p[i].device) * p[i] - tau.to(p[i].device) * step
            out[i] = new if zero[i] is None else skip_update(new, zero[i])
        new_lb = state.lb
        if self.adapt:
            new_lb = torch.clamp(((barf + iprod - gamma) - 0.5 * tau * norm) / bc1,
                                 min=self.lower_bound)
        slots_out = []
        for k, table in enumerate([m, v] if self.adam else [m]):
            leaves = list(slots[k])
            for i in on:
                leaves[i] = table[i].to(slots[k][i].dtype)
            slots_out.append(tree_lib.unflatten(spec, leaves))
        scalars = dict(barf=barf, gamma=gamma.to(dt), lb=new_lb.to(dt), count=new_count)
        cls = MomoAdamState if self.adam else MomoState
        return tree_lib.unflatten(spec, out), cls(*slots_out, **scalars)


def momo(learning_rate: ScalarOrSchedule = 1.0, beta: float = 0.9, lower_bound: float = 0.0,
         weight_decay: float = 0.0, adapt_lower_bound: bool = False) -> GradientTransformation:
    """MoMo (optax.contrib): SGD with momentum whose step is min(lr, a Polyak-type step
    from the loss, its lower bound and the momentum); call ``tx.update(grads, state,
    params, value=loss)``. With m ← β·m + (1−β)·g (β = 0 on the first step), f̄ and γ the
    same averages of the loss and of ⟨g, p⟩, and ρ = 1 + lr·wd: τ = min(lr,
    max(ρ(f̄ − lb − γ) + ⟨m, p⟩, 0)/‖m‖²) (0 where ‖m‖² <= float64 epsilon), and
    u = −(lr·wd/ρ)·p − τ·m. ``adapt_lower_bound`` re-estimates lb each step (the paper's).

    Args:
        learning_rate: the largest step, >= 0, or a schedule of the step count.
        beta: the momentum, in [0, 1]. lower_bound: a lower bound of the loss.
        weight_decay: >= 0. adapt_lower_bound: estimate lb on the fly.
    """
    obj = Momo("momo", learning_rate, beta, None, 0.0, lower_bound, weight_decay,
               adapt_lower_bound)
    return GradientTransformation(obj.init, obj.update)


def momo_adam(learning_rate: ScalarOrSchedule = 1e-2, b1: float = 0.9, b2: float = 0.999,
              eps: float = 1e-8, lower_bound: float = 0.0, weight_decay: float = 0.0,
              adapt_lower_bound: bool = False) -> GradientTransformation:
    """MoMo-Adam (optax.contrib): Adam(W) whose step is min(lr/(1−b1ᵗ), a Polyak-type step
    in the Adam geometry); call ``tx.update(grads, state, params, value=loss)``. With
    D = eps + √(v/(1−b2ᵗ)), ‖m‖²_D = ⟨m, m/D⟩ and bc1 = 1 − b1ᵗ: τ = min(lr/bc1,
    max(ρ(f̄ − bc1·lb − γ) + ⟨m, p⟩, 0)/‖m‖²_D) and u = −(lr·wd/ρ)·p − τ·m/D.

    Args:
        learning_rate: >= 0, or a schedule. b1, b2: in [0, 1). eps: >= 0.
        lower_bound: a lower bound of the loss. weight_decay: >= 0.
        adapt_lower_bound: estimate lb on the fly.
    """
    obj = Momo("momo_adam", learning_rate, b1, b2, eps, lower_bound, weight_decay,
               adapt_lower_bound)
    return GradientTransformation(obj.init, obj.update)
