"""L-BFGS (optax's ``scale_by_lbfgs`` and ``lbfgs``): the two-loop recursion over the
whole tree (its inner products are global), as eager torch ops with every decision a
``torch.where`` on 0-d tensors and the memory's ring index a device tensor (no host read).

``skip_zeros`` (SPEC §3) cannot be honoured: the state holds the params and the update of
the last step and their differences, which must move where the raw gradient is zero (a
kept stale difference would break the secant pairs), and the direction at such an element
is a mix of all the others. The update raises when a skip-aware chain holds it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ftopt import tree as tree_lib
from ftopt.base import GradientTransformation, register_owner, register_state
from ftopt.combine import chain
from ftopt.domains import check_int
from ftopt.finite import safe_increment
from ftopt.linesearch import check_refuses_mask
from ftopt.rules import checked_params, compute_dtype, state_dtype
from ftopt.schedules import ScalarOrSchedule
from ftopt.transforms.scaling import identity, scale, scale_by_learning_rate
from ftopt.validate import check_leaf
from ftopt.zoom_linesearch import scale_by_zoom_linesearch

__all__ = ["ScaleByLBFGSState", "scale_by_lbfgs", "lbfgs"]

_SLOTS = ("params", "updates", "diff_params_memory", "diff_updates_memory")


@register_state
class ScaleByLBFGSState(NamedTuple):
    """optax's layout: the step count, the params and updates of the last step, the last
    ``memory_size`` differences of each (leaves of shape ``(memory_size, *param.shape)``,
    a ring buffer indexed by the count) and their weights ρ (shape ``(memory_size,)``)."""

    count: torch.Tensor
    params: Any
    updates: Any
    diff_params_memory: Any
    diff_updates_memory: Any
    weights_memory: torch.Tensor


def _dot(a: dict, b: dict, dtype: torch.dtype, device) -> torch.Tensor:
    """Σ⟨a_i, b_i⟩ over the leaves, a 0-d tensor on ``device`` (no host read)."""
    if not a:
        return torch.zeros((), dtype=dtype, device=device)
    return torch.stack([(a[i] * b[i]).sum().to(device, dtype) for i in a]).sum()


class ScaleByLBFGS:
    """The object behind :func:`scale_by_lbfgs` (see there)."""

    unfused_reason = ("scale_by_lbfgs runs eagerly: its direction mixes every element "
                      "through global inner products")

    def __init__(self, memory_size: int, scale_init_precond: bool):
        self.memory_size = check_int("scale_by_lbfgs", "memory_size", memory_size, minimum=1)
        self.scale_init_precond = bool(scale_init_precond)
        register_owner(self)

    def init(self, params) -> ScaleByLBFGSState:
        paths, flat, spec = checked_params(params)
        m = self.memory_size
        zeros = lambda shape: tree_lib.unflatten(spec, [  # noqa: E731
            torch.zeros(shape(p), dtype=state_dtype(p), device=p.device) for p in flat])
        device = tree_lib.state_device(flat)
        dtype = (torch.float64 if flat and all(p.dtype == torch.float64 for p in flat)
                 else torch.float32)
        return ScaleByLBFGSState(
            count=torch.zeros((), dtype=torch.int32, device=device),
            params=zeros(lambda p: p.shape), updates=zeros(lambda p: p.shape),
            diff_params_memory=zeros(lambda p: (m, *p.shape)),
            diff_updates_memory=zeros(lambda p: (m, *p.shape)),
            weights_memory=torch.zeros(m, dtype=dtype, device=device))

    def _flat(self, updates, state, params):
        if params is None:
            raise ValueError("scale_by_lbfgs needs params: call update(updates, state, "
                             "params)")
        if not isinstance(state, ScaleByLBFGSState):
            raise TypeError(f"scale_by_lbfgs: expected a ScaleByLBFGSState, got "
                            f"{type(state).__name__}")
        m = self.memory_size
        w = state.weights_memory
        if not isinstance(w, torch.Tensor) or tuple(w.shape) != (m,):
            raise ValueError(f"state weights_memory: expected a tensor of shape ({m},) "
                             f"(memory_size={m}), got {getattr(w, 'shape', type(w).__name__)}")
        paths, p_flat, spec = tree_lib.flatten_with_paths(params)
        u_flat = tree_lib.flatten_like(spec, updates, "updates", paths)
        slots = {k: tree_lib.flatten_like(spec, getattr(state, k), f"state {k}", paths)
                 for k in _SLOTS}
        for i, (path, u, p) in enumerate(zip(paths, u_flat, p_flat)):
            if u is None:
                continue
            check_leaf(path, u, p)
            for k in _SLOTS:
                want = (m, *u.shape) if k.endswith("memory") else tuple(u.shape)
                s = slots[k][i]
                if not isinstance(s, torch.Tensor) or tuple(s.shape) != want:
                    raise ValueError(f"state {k} at {path}: expected a tensor of shape "
                                     f"{want}, got {getattr(s, 'shape', type(s).__name__)}")
        return spec, u_flat, p_flat, slots

    def update(self, updates, state, params=None, **extra):
        check_refuses_mask("scale_by_lbfgs", extra, "its state holds the last params and "
                           "updates and their differences, which move where the raw "
                           "gradient is zero, and its direction mixes all elements")
        spec, u_flat, p_flat, slots = self._flat(updates, state, params)
        m = self.memory_size
        dt, dev = state.weights_memory.dtype, state.weights_memory.device
        on = [i for i, u in enumerate(u_flat) if u is not None]
        u = {i: u_flat[i].to(compute_dtype(u_flat[i])) for i in on}
        count = state.count.to(dev)
        first = count == 0
        idx = torch.remainder(count.long(), m)  # the oldest pair's slot
        prev = torch.remainder(count.long() - 1, m)  # the slot of the pair made now
        # 1. The newest pair (zero on the first step, where there is no previous point).
        dw, du = {}, {}
        for i in on:
            zero = torch.zeros((), dtype=u[i].dtype, device=u[i].device)
            f = first.to(u[i].device)
            dw[i] = torch.where(f, zero, p_flat[i].to(u[i].dtype) - slots["params"][i].to(
                u[i].dtype))
            du[i] = torch.where(f, zero, u[i] - slots["updates"][i].to(u[i].dtype))
        curv = _dot(du, dw, dt, dev)
        weight = torch.where(first | (curv == 0), torch.zeros_like(curv), 1.0 / curv)
        mem_w = {i: slots["diff_params_memory"][i].index_copy(
            0, prev.to(u[i].device).view(1),
            dw[i].to(slots["diff_params_memory"][i].dtype).unsqueeze(0)) for i in on}
        mem_u = {i: slots["diff_updates_memory"][i].index_copy(
            0, prev.to(u[i].device).view(1),
            du[i].to(slots["diff_updates_memory"][i].dtype).unsqueeze(0)) for i in on}
        rho = state.weights_memory.index_copy(0, prev.view(1), weight.to(dt).view(1))
        # 2. γ, the initial preconditioner's scale.
        if self.scale_init_precond:
            sq = _dot(du, du, dt, dev)
            gamma = torch.where(sq > 0, curv / sq, torch.ones_like(sq))
            first_scale = torch.clamp(1.0 / torch.sqrt(_dot(u, u, dt, dev)), max=1.0)
            gamma = torch.where(first, first_scale, gamma)
        else:
            gamma = torch.ones((), dtype=dt, device=dev)
        # 3. The two-loop recursion, newest pair first, then back from the oldest.
        order = torch.remainder(idx + torch.arange(m, device=dev), m)
        pick = lambda mem, i, k: mem[i].index_select(  # noqa: E731
            0, order[k:k + 1].to(u[i].device)).squeeze(0).to(u[i].dtype)
        vec = dict(u)
        alphas = [None] * m
        for k in reversed(range(m)):
            r = rho.index_select(0, order[k:k + 1]).squeeze(0)
            dwk = {i: pick(mem_w, i, k) for i in on}
            alphas[k] = r * _dot(dwk, vec, dt, dev)
            vec = {i: vec[i] - alphas[k].to(vec[i].device, vec[i].dtype) * pick(mem_u, i, k)
                   for i in on}
        vec = {i: gamma.to(vec[i].device, vec[i].dtype) * vec[i] for i in on}
        for k in range(m):
            r = rho.index_select(0, order[k:k + 1]).squeeze(0)
            beta = r * _dot({i: pick(mem_u, i, k) for i in on}, vec, dt, dev)
            c = alphas[k] - beta
            vec = {i: vec[i] + c.to(vec[i].device, vec[i].dtype) * pick(mem_w, i, k)
                   for i in on}
        out = list(u_flat)
        new = {k: list(slots[k]) for k in _SLOTS}
        for i in on:
            out[i] = vec[i].to(u_flat[i].dtype)
            # copies: the caller may change its params and gradients in place later
            new["params"][i] = p_flat[i].to(slots["params"][i].dtype, copy=True)
            new["updates"][i] = u_flat[i].to(slots["updates"][i].dtype, copy=True)
            new["diff_params_memory"][i] = mem_w[i]
            new["diff_updates_memory"][i] = mem_u[i]
        trees = {k: tree_lib.unflatten(spec, v) for k, v in new.items()}
        return tree_lib.unflatten(spec, out), ScaleByLBFGSState(
            count=safe_increment(state.count), weights_memory=rho, **trees)


def scale_by_lbfgs(memory_size: int = 10, scale_init_precond: bool = True
                   ) -> GradientTransformation:
    """Scales updates by L-BFGS' approximation of the inverse Hessian, as optax: the
    direction P_k·u_k (not negated) from the last ``memory_size`` pairs δw_j = w_{j+1} −
    w_j, δu_j = u_{j+1} − u_j and ρ_j = 1/⟨δu_j, δw_j⟩ (0 where that is 0), by the
    two-loop recursion (Nocedal & Wright, Algorithm 7.4) started from γ_k·I, with γ_k =
    ⟨δw, δu⟩/‖δu‖² of the newest pair (1 where ‖δu‖ = 0) if ``scale_init_precond`` (else
    1), and min(1, 1/‖u_0‖) on the first step. Inner products and norms run over the
    whole tree. Call ``update(updates, state, params)``; chain it with a line search
    (:func:`lbfgs`).

    ``None`` update leaves take no part and keep their state. Per-element state: the
    params and updates (each leaf's dtype, at least float32) and the 2·``memory_size``
    differences. Differences from optax: intermediate vectors stay in the compute dtype
    (float32 for 16-bit updates) where optax casts each back to the updates' dtype; real
    tensors only; refuses ``skip_zeros`` (module docstring).

    Args:
        memory_size: the number of pairs kept, >= 1.
        scale_init_precond: scale the initial preconditioner by γ_k.
    """
    obj = ScaleByLBFGS(memory_size, scale_init_precond)
    return GradientTransformation(obj.init, obj.update)


# optax's default line search of lbfgs (a pure transform: one instance serves every call).
DEFAULT_LINESEARCH = scale_by_zoom_linesearch(max_linesearch_steps=20,
                                              initial_guess_strategy="one")


def lbfgs(learning_rate: ScalarOrSchedule | None = None, memory_size: int = 10,
          scale_init_precond: bool = True,
          linesearch: GradientTransformation | None = DEFAULT_LINESEARCH,
          ) -> GradientTransformation:
    """L-BFGS, as optax: ``chain(scale_by_lbfgs(memory_size, scale_init_precond),
    scale(-1.0) if learning_rate is None else scale_by_learning_rate(learning_rate),
    linesearch)`` (no line search: ``linesearch=None``). The default line search is
    optax's: ``scale_by_zoom_linesearch(max_linesearch_steps=20,
    initial_guess_strategy="one")``. Call ``tx.update(grad, state, params, value=f(w),
    grad=grad, value_fn=f)``; :func:`ftopt.value_and_grad_from_state` reuses the value and
    gradient the line search computed at the new params. Memory: about 2·memory_size + 3
    copies of the params. Refuses ``skip_zeros`` (:func:`scale_by_lbfgs`).

    Args:
        learning_rate: ``None`` (the line search picks the step), or a float >= 0, 0-d
            tensor or schedule. memory_size: >= 1. scale_init_precond: see
            :func:`scale_by_lbfgs`. linesearch: a line search transform, or ``None``.
    """
    base = scale(-1.0) if learning_rate is None else scale_by_learning_rate(learning_rate)
    return chain(scale_by_lbfgs(memory_size, scale_init_precond), base,
                 identity() if linesearch is None else linesearch)
