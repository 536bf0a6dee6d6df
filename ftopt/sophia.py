"""Sophia (Liu et al. 2023, optax.contrib's ``sophia``): momentum divided by a clipped
running estimate of the Hessian diagonal, the estimate refreshed every ``update_interval``
steps by a transform that reads the objective (``obj_fn=``, passed to ``update``).

:func:`hutchinson_estimator_diag_hessian` is optax's default estimate, ``z ⊙ (H z)`` for
a Rademacher vector ``z`` (``H z`` by forward-over-reverse differentiation of ``obj_fn``
with :func:`torch.func.jvp` of :func:`torch.func.grad`). Its random vectors come from a
``torch.Generator``, not from JAX's PRNG: the same seed gives other (equally distributed)
signs than optax, deterministic given the seed and the device type.

Eager torch ops: the estimate calls ``obj_fn``, and the step reads the step count on the
host (one read per step) to decide whether to run it, so that the estimate costs nothing
on the other steps. (The elementwise part, the momentum and the clipped ratio, could be a
fused rule with the estimate passed in as data; it is not one yet.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ftopt import tree as tree_lib
from ftopt._counts import host_count, remember_count
from ftopt.base import GradientTransformation, check_transform, register_owner, register_state
from ftopt.combine import chain
from ftopt.domains import NONNEG, UNIT_OPEN, check_finite, check_int
from ftopt.finite import safe_increment
from ftopt.program import skip_update
from ftopt.rules import checked_params, compute_dtype, state_dtype
from ftopt.schedules import ScalarOrSchedule
from ftopt.transforms import add_decayed_weights, scale_by_learning_rate
from ftopt.validate import check_leaf

__all__ = ["HutchinsonState", "SophiaState", "hutchinson_estimator_diag_hessian",
           "scale_by_sophia", "sophia"]

_SEED_LIMIT = 2**62
_INT32_MAX = 2**31 - 1


def _host(count: torch.Tensor) -> int:
    """A 0-d integer state's value: from the host mirror, else one device read."""
    known = host_count(count)
    return int(count) if known is None else known


@register_state
class HutchinsonState(NamedTuple):
    """The seed of the next draw (optax keeps a JAX PRNG key): a 0-d int64 tensor."""

    key: torch.Tensor


@register_state
class SophiaState(NamedTuple):
    """optax.contrib's ``SophiaState``: the step count, the momentum, the running Hessian
    diagonal estimate and the estimator's own state."""

    count: torch.Tensor
    mu: Any
    nu: Any
    hessian_fn_state: Any


def rademacher(shape: tuple, dtype: torch.dtype, device: torch.device,
               generator: torch.Generator) -> torch.Tensor:
    """±1 with probability 1/2 each, from ``generator``."""
    bits = torch.randint(0, 2, shape, generator=generator, device=device, dtype=dtype)
    return 2 * bits - 1


def hessian_vector_product(obj_fn: Callable, spec: Any, leaves: list, vectors: list) -> list:
    """``H v`` of ``obj_fn`` at the params ``leaves`` (flattened with ``spec``), as
    optax: ``jvp(grad(obj_fn), (params,), (v,))`` (forward over reverse)."""
    def loss(*xs):
        return obj_fn(tree_lib.unflatten(spec, list(xs)))

    grad = torch.func.grad(loss, argnums=tuple(range(len(leaves))))
    _, hv = torch.func.jvp(grad, tuple(leaves), tuple(vectors))
    return list(hv)


class Hutchinson:
    """The object behind :func:`hutchinson_estimator_diag_hessian` (see there)."""

    unfused_reason = ("hutchinson_estimator_diag_hessian runs eagerly: it differentiates "
                      "the obj_fn passed to update")
    update_keywords = ("obj_fn",)

    def __init__(self, random_seed: int | torch.Tensor | None, n_samples: int):
        name = "hutchinson_estimator_diag_hessian"
        if isinstance(random_seed, torch.Tensor):
            if random_seed.ndim != 0 or random_seed.is_floating_point():
                raise ValueError(f"{name}: random_seed must be an int or a 0-d integer "
                                 f"tensor, got shape {tuple(random_seed.shape)} and dtype "
                                 f"{random_seed.dtype}")
            random_seed = int(random_seed)
        seed = 0 if random_seed is None else check_int(name, "random_seed", random_seed, 0)
        if seed >= _SEED_LIMIT:
            raise ValueError(f"{name}: random_seed must be below 2**62, got {seed}")
        self.seed = seed
        self.n_samples = check_int(name, "n_samples", n_samples, 1)
        register_owner(self)

    def init(self, params) -> HutchinsonState:
        paths, flat, _ = checked_params(params)
        device = tree_lib.state_device(flat)
        key = torch.full((), self.seed, dtype=torch.int64, device=device)
        remember_count(key, self.seed)
        return HutchinsonState(key)

    def update(self, updates, state, params=None, *, obj_fn: Callable | None = None,
               **extra):
        del updates, extra
        name = "hutchinson_estimator_diag_hessian"
        if params is None:
            raise ValueError(f"{name}: params must be provided to update")
        if obj_fn is None:
            raise ValueError(f"{name}: update needs the objective as obj_fn= (a function of "
                             "the params alone returning the scalar loss: "
                             "tx.update(grads, state, params, obj_fn=loss_of_params))")
        if not callable(obj_fn):
            raise TypeError(f"{name}: obj_fn must be callable, got {type(obj_fn).__name__}")
        if not isinstance(state, HutchinsonState):
            raise TypeError(f"{name}: expected a HutchinsonState, got {type(state).__name__}")
        paths, flat, spec = checked_params(params)
        key = _host(state.key)
        generators: dict[torch.device, torch.Generator] = {}

        def generator(device: torch.device) -> torch.Generator:
            if device not in generators:
                generators[device] = torch.Generator(device=device).manual_seed(key)
            return generators[device]

        leaves = [p.detach() for p in flat]
        total = None
        for _ in range(self.n_samples):
            signs = [rademacher(tuple(p.shape), p.dtype, p.device, generator(p.device))
                     for p in leaves]
            hv = hessian_vector_product(obj_fn, spec, leaves, signs)
            product = [(h * z).to(p.dtype) for h, z, p in zip(hv, signs, leaves)]
            total = product if total is None else [a + b for a, b in zip(total, product)]
        if self.n_samples > 1:
            total = [a / self.n_samples for a in total]
        nxt = key + 1 if key + 1 < _SEED_LIMIT else 0
        new_key = torch.full((), nxt, dtype=torch.int64, device=state.key.device)
        remember_count(new_key, nxt)
        return tree_lib.unflatten(spec, total), HutchinsonState(new_key)


def hutchinson_estimator_diag_hessian(random_seed: int | torch.Tensor | None = None, *,
                                      n_samples: int = 1) -> GradientTransformation:
    """The Hessian diagonal by Hutchinson's estimator (optax.contrib's): unbiased, with
    high variance. Its update ignores the updates and returns ``z ⊙ (H z)`` with ``H`` the
    Hessian of ``obj_fn`` (passed to ``update``: ``obj_fn(params) -> 0-d loss``) at the
    params and ``z`` a Rademacher vector (±1, as optax; the paper draws normals), one per
    leaf, in each param's dtype.

    Randomness (not JAX's PRNG, so not optax's values): the state's ``key`` is an int64
    seed; a draw seeds a ``torch.Generator`` on each params' device with it, draws the
    leaves' signs in tree order, and advances the key by one. A seed gives the same signs
    on every run on one device type (CPU and CUDA generators differ). The Hessian-vector
    product is ``torch.func.jvp`` of ``torch.func.grad`` (forward over reverse, as optax's
    ``jax.jvp(jax.grad(obj_fn))``), so ``obj_fn`` must be written in ops with forward-mode
    derivatives; no gradient flows back through the estimate (the params are detached).

    Args:
        random_seed: an int in [0, 2**62) (default 0, as optax's ``PRNGKey(0)``).
        n_samples: the estimates averaged per call (keyword only, not optax's; 1 is
            optax's estimator).
    """
    obj = Hutchinson(random_seed, n_samples)
    return GradientTransformation(obj.init, obj.update)


class ScaleBySophia:
    """The object behind :func:`scale_by_sophia` (see there)."""

    mask_aware = True
    unfused_reason = ("scale_by_sophia runs eagerly: its Hessian estimate reads the obj_fn "
                      "passed to update, every update_interval steps")

    def __init__(self, b1, b2, eps, gamma, clip_threshold, update_interval,
                 hessian_diagonal_fn, mu_dtype, verbose, print_win_rate_every_n_steps):
        name = self.name = "scale_by_sophia"
        self.b1 = check_finite(name, "b1", b1, UNIT_OPEN)
        self.b2 = check_finite(name, "b2", b2, UNIT_OPEN)
        self.eps = check_finite(name, "eps", eps, NONNEG)
        self.gamma = check_finite(name, "gamma", gamma, NONNEG)
        self.clip = (None if clip_threshold is None
                     else check_finite(name, "clip_threshold", clip_threshold, NONNEG))
        self.interval = check_int(name, "update_interval", update_interval, 1,
                                  integral_floats=True)
        if hessian_diagonal_fn is None:
            hessian_diagonal_fn = hutchinson_estimator_diag_hessian()
        check_transform(hessian_diagonal_fn, f"{name}: argument hessian_diagonal_fn")
        self.hess = hessian_diagonal_fn
        if mu_dtype is not None and not (isinstance(mu_dtype, torch.dtype)
                                         and mu_dtype.is_floating_point):
            raise TypeError(f"{name}: mu_dtype must be None or a floating-point torch.dtype, "
                            f"got {mu_dtype!r}")
        self.mu_dtype = mu_dtype
        self.verbose = bool(verbose)
        self.every = check_int(name, "print_win_rate_every_n_steps",
                               print_win_rate_every_n_steps, 0)
        register_owner(self)

    def init(self, params) -> SophiaState:
        paths, flat, spec = checked_params(params)
        mu = [torch.zeros(p.shape, dtype=self.mu_dtype or state_dtype(p), device=p.device)
              for p in flat]
        nu = [torch.zeros(p.shape, dtype=state_dtype(p), device=p.device) for p in flat]
        count = torch.zeros((), dtype=torch.int32, device=tree_lib.state_device(flat))
        remember_count(count, 0)
        return SophiaState(count, tree_lib.unflatten(spec, mu), tree_lib.unflatten(spec, nu),
                           self.hess.init(params))

    def _flat(self, updates, state, params, zero_mask):
        if params is None:
            raise ValueError(f"{self.name}: params must be provided to update (and the "
                             "objective as obj_fn=)")
        if not isinstance(state, SophiaState):
            raise TypeError(f"{self.name}: expected a SophiaState, got {type(state).__name__}")
        paths, p_flat, spec = tree_lib.flatten_with_paths(params)
        u_flat = tree_lib.flatten_like(spec, updates, "updates", paths)
        mu = tree_lib.flatten_like(spec, state.mu, "state mu", paths)
        nu = tree_lib.flatten_like(spec, state.nu, "state nu", paths)
        for path, u, p, m, n in zip(paths, u_flat, p_flat, mu, nu):
            if u is None:
                continue
            check_leaf(path, u, p)
            for what, s in (("mu", m), ("nu", n)):
                if not (isinstance(s, torch.Tensor) and s.is_floating_point()
                        and s.shape == u.shape and s.device == u.device):
                    raise ValueError(f"state {what} at {path}: expected a floating-point "
                                     f"tensor of shape {tuple(u.shape)} on {u.device}, got "
                                     f"{_describe(s)}")
        zero = (tree_lib.flatten_like(spec, zero_mask, "zero_mask", paths)
                if zero_mask is not None else [None] * len(u_flat))
        return spec, paths, u_flat, mu, nu, zero

    def update(self, updates, state, params=None, *, zero_mask=None, **extra):
        spec, paths, u_flat, mu, nu, zero = self._flat(updates, state, params, zero_mask)
        count = _host(state.count)  # (no device read for a count ftopt made)
        new_count = safe_increment(state.count)
        after = min(count + 1, _INT32_MAX)
        remember_count(new_count, after)
        refresh = count % self.interval == 0
        hess_state, h_flat = state.hessian_fn_state, None
        if refresh:  # from the incoming gradients and the params, before this step's update
            h_tree, hess_state = self.hess.update(updates, hess_state, params, **extra)
            h_flat = _flatten_estimate(spec, paths, h_tree, u_flat)
        bc1 = 1 - self.b1 ** after
        out, new_mu, new_nu = list(u_flat), list(mu), list(nu)
        kept, total = 0, 0
        for i, u in enumerate(u_flat):
            if u is None:
                continue
            g = u.to(compute_dtype(u))
            m_old, n_old = mu[i].to(g.dtype), nu[i].to(g.dtype)
            m = (1 - self.b1) * g + self.b1 * m_old
            step = (m / bc1) / torch.clamp(self.gamma * n_old, min=self.eps)
            if self.clip is not None:
                if self.verbose:
                    kept = kept + (step.abs() < self.clip).sum()
                    total += step.numel()
                step = torch.clamp(step, -self.clip, self.clip)
            n = n_old
            if h_flat is not None:
                n = (1 - self.b2) * h_flat[i].to(g.dtype) + self.b2 * n_old
            if zero[i] is not None:  # every per-element state keeps its bits (SPEC §3)
                m = torch.where(zero[i], m_old, m)
                n = torch.where(zero[i], n_old, n)
                step = skip_update(step, zero[i])
            new_mu[i] = m.to(mu[i].dtype)
            new_nu[i] = n.to(nu[i].dtype)
            out[i] = step
        if self.verbose and self.every > 0 and total and after % self.every == 0:
            print(f"Sophia optimizer win rate: {float(kept) / total}")
        return tree_lib.unflatten(spec, out), SophiaState(
            new_count, tree_lib.unflatten(spec, new_mu), tree_lib.unflatten(spec, new_nu),
            hess_state)


def _flatten_estimate(spec, paths, h_tree, u_flat) -> list:
    h = tree_lib.flatten_like(spec, h_tree, "hessian_diagonal_fn's output", paths)
    for path, u, x in zip(paths, u_flat, h):
        if u is not None and (not isinstance(x, torch.Tensor) or x.shape != u.shape):
            raise ValueError(f"hessian_diagonal_fn's output at {path}: expected a tensor of "
                             f"shape {tuple(u.shape)}, got {_describe(x)}")
    return h


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    return type(x).__name__


def scale_by_sophia(b1: float = 0.965, b2: float = 0.99, eps: float = 1e-8,
                    gamma: float = 0.01, clip_threshold: float | None = 1.0,
                    update_interval: int = 10,
                    hessian_diagonal_fn: GradientTransformation | None = None,
                    mu_dtype: torch.dtype | None = None, verbose: bool = False,
                    print_win_rate_every_n_steps: int = 0) -> GradientTransformation:
    """Sophia's scaling (optax.contrib's ``scale_by_sophia``); call ``tx.update(grads,
    state, params, obj_fn=loss_of_params)`` (extra keywords reach the estimator).

    With ``t`` the step count after this step and ``ν`` the estimate kept so far:
    ``μ ← b1·μ + (1−b1)·g``, ``u ← clip(μ/(1−b1ᵗ) / max(γ·ν, eps), ±clip_threshold)``
    (no clip when ``None``); then, on the steps whose count before the step is a multiple
    of ``update_interval`` (the 1st, the 11th, ...), ``ν ← b2·ν + (1−b2)·ĥ`` with ``ĥ``
    ``hessian_diagonal_fn``'s output for the incoming gradients and the params. So a step
    divides by the estimate of the steps before it (the first by ``eps``: its update is
    ``±clip_threshold``), as optax's.

    ``skip_zeros``: where the raw gradient is zero ``μ`` and ``ν`` keep their bits (the
    estimate is not folded in there) and the update is ``-0.0``. ``verbose`` with
    ``print_win_rate_every_n_steps > 0`` prints the fraction of unclipped elements every so
    many steps (a host read). Hyperparameters are Python floats (a 0-d tensor is read once).

    Args:
        b1: the momentum's decay, in [0, 1). b2: the estimate's decay, in [0, 1) (its
            effective decay is ``1 − (1 − b2)/update_interval``). eps: >= 0.
        gamma: the estimate's scale, >= 0. clip_threshold: >= 0, or ``None``.
        update_interval: steps between estimates, >= 1.
        hessian_diagonal_fn: the estimator (default:
            :func:`hutchinson_estimator_diag_hessian`, seed 0).
        mu_dtype: the momentum's dtype (default: the params', at least fp32).
        verbose, print_win_rate_every_n_steps: the win rate's diagnostic print.
    """
    obj = ScaleBySophia(b1, b2, eps, gamma, clip_threshold, update_interval,
                        hessian_diagonal_fn, mu_dtype, verbose, print_win_rate_every_n_steps)
    return GradientTransformation(obj.init, obj.update)


def sophia(learning_rate: ScalarOrSchedule, b1: float = 0.965, b2: float = 0.99,
           eps: float = 1e-8, weight_decay: float = 1e-4, weight_decay_mask: Any = None,
           gamma: float = 0.01, clip_threshold: float | None = 1.0,
           update_interval: int = 10,
           hessian_diagonal_fn: GradientTransformation | None = None,
           mu_dtype: torch.dtype | None = None, verbose: bool = False,
           print_win_rate_every_n_steps: int = 0) -> GradientTransformation:
    """Sophia (optax.contrib): ``chain(scale_by_sophia(...), add_decayed_weights(
    weight_decay, weight_decay_mask), scale_by_learning_rate(learning_rate))``; call
    ``tx.update(grads, state, params, obj_fn=loss_of_params)``, where ``obj_fn`` takes the
    params alone and returns the scalar loss of this step's batch (for a module:
    ``lambda p: loss_fn(torch.func.functional_call(model, p, (x,)), y)``). Add
    :func:`ftopt.skip_zeros` to the chain for SPEC §3's semantics."""
    return chain(
        scale_by_sophia(b1, b2, eps, gamma, clip_threshold, update_interval,
                        hessian_diagonal_fn, mu_dtype, verbose, print_win_rate_every_n_steps),
        add_decayed_weights(weight_decay, weight_decay_mask),
        scale_by_learning_rate(learning_rate))
