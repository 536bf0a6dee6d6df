"""Independent float64 reference implementations of ftopt's optimizers.

Written from the formulas of SPEC §2/§4 and from optax's alias chains (optax/_src/alias.py,
optax/contrib/_ademamix.py); nothing here imports ftopt.

Every optimizer keeps its own per-leaf float64 state. ``step(params, grads)`` takes dicts of
tensors of any float dtype (upcast once to float64) and returns a new dict of float64 params;
``last_update`` holds the float64 update of that step (``p_new = p + last_update``).
``t`` counts from 1 on the first step.

Chains, in optax's order (lr = scale_by_learning_rate(lr), i.e. u <- -lr*u):

=============  =================================================================================
sgd            [trace(momentum, nesterov) if momentum is not None] -> lr
adam           scale_by_adam(b1, b2, eps, eps_root, nesterov) -> lr
adamw          scale_by_adam -> add_decayed_weights(wd) -> lr       (decay multiplied by lr)
lion           scale_by_lion(b1, b2) -> add_decayed_weights(wd) -> lr
rmsprop        scale_by_rms(decay, eps, initial_scale, eps_in_sqrt) -> lr -> [trace(momentum)]
adagrad        scale_by_rss(initial_accumulator_value, eps) -> lr
lamb           scale_by_adam(b1, b2, eps, eps_root) -> add_decayed_weights(wd)
               -> scale_by_trust_ratio() -> lr
lars           add_decayed_weights(wd) -> scale_by_trust_ratio(trust_coefficient, eps) -> lr
               -> trace(momentum, nesterov)
ademamix       scale_by_ademamix(b1, b2, b3, alpha, eps, eps_root) -> add_decayed_weights(wd) -> lr
=============  =================================================================================

optax puts the learning rate *before* ``trace`` in rmsprop and lars; ``trace`` is linear, so with a
constant learning rate this equals ``trace -> lr`` exactly (up to rounding).

bitsandbytes rows of SPEC §4, as ftopt chains:

=============  =================================================================================
SGD            add_decayed_weights(wd) -> trace(momentum) -> lr
RMSprop        add_decayed_weights(wd) -> scale_by_rms(alpha, eps, eps_in_sqrt=False) -> lr
Adagrad        add_decayed_weights(wd) -> scale_by_rss(0.0, eps, eps_in_sqrt=False) -> lr
LAMB           scale_by_adam(b1, b2, eps) -> clip_by_param_norm_ratio(max_unorm)
               -> add_decayed_weights(wd) -> lr
LARS           add_decayed_weights(wd) -> trace(momentum) -> clip_by_param_norm_ratio(max_unorm)
               -> lr
=============  =================================================================================
"""

from __future__ import annotations

import torch

F64 = torch.float64


# --------------------------------------------------------------------------- per-leaf helpers


def norm(x: torch.Tensor) -> float:
    """Euclidean norm of a whole leaf, as a Python float (float64)."""
    return float(torch.linalg.vector_norm(x.to(F64)))


def trust_ratio(u, p, min_norm=0.0, trust_coefficient=1.0, eps=0.0) -> float:
    """optax scale_by_trust_ratio factor: c*max(|p|,min)/(max(|u|,min)+eps); 1 if a norm is 0."""
    p_norm = max(norm(p), min_norm)
    u_norm = max(norm(u), min_norm)
    if p_norm == 0.0 or u_norm == 0.0:
        return 1.0
    return trust_coefficient * p_norm / (u_norm + eps)


def clip_by_param_norm_ratio(u, p, max_ratio):
    """If |u| > max_ratio*|p| then u <- u*max_ratio*|p|/|u| (bitsandbytes max_unorm)."""
    u_norm = norm(u)
    limit = max_ratio * norm(p)
    if u_norm > limit:
        return u * (limit / u_norm)
    return u


def adam_direction(st, g, t, b1, b2, eps, eps_root=0.0, nesterov=False):
    """optax scale_by_adam on one leaf; updates st['mu'], st['nu'] in place."""
    st["mu"] = b1 * st["mu"] + (1 - b1) * g
    st["nu"] = b2 * st["nu"] + (1 - b2) * g * g
    if nesterov:  # optax: b1*mu/(1-b1^(t+1)) + (1-b1)*g/(1-b1^t)
        m_hat = b1 * st["mu"] / (1 - b1 ** (t + 1)) + (1 - b1) * g / (1 - b1**t)
    else:
        m_hat = st["mu"] / (1 - b1**t)
    v_hat = st["nu"] / (1 - b2**t)
    return m_hat / (torch.sqrt(v_hat + eps_root) + eps)


def trace(st, u, decay, nesterov=False):
    """optax trace: tr <- u + decay*tr; returns tr, or u + decay*tr (new) if nesterov."""
    st["tr"] = u + decay * st["tr"]
    return u + decay * st["tr"] if nesterov else st["tr"]


def zeros_state(p, *names):
    return {n: torch.zeros_like(p, dtype=F64) for n in names}


# --------------------------------------------------------------------------- base class


class RefOptimizer:
    """Holds per-leaf float64 state; ``step`` maps dicts of params/grads to new float64 params."""

    def __init__(self):
        self.t = 0
        self.state: dict = {}
        self.last_update: dict = {}

    def init_leaf(self, p):  # p: float64 tensor
        return {}

    def leaf_update(self, p, g, st, t):  # returns the float64 update u (p_new = p + u)
        raise NotImplementedError

    def step(self, params: dict, grads: dict) -> dict:
        self.t += 1
        out = {}
        for k, p in params.items():
            p = p.detach().to(F64)
            g = grads[k].detach().to(F64)
            if k not in self.state:
                self.state[k] = self.init_leaf(p)
            u = self.leaf_update(p, g, self.state[k], self.t)
            self.last_update[k] = u
            out[k] = p + u
        return out


# --------------------------------------------------------------------------- optax aliases


class RefSGD(RefOptimizer):
    def __init__(self, lr, momentum=None, nesterov=False):
        super().__init__()
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov

    def init_leaf(self, p):
        return zeros_state(p, "tr")

    def leaf_update(self, p, g, st, t):
        u = g if self.momentum is None else trace(st, g, self.momentum, self.nesterov)
        return -self.lr * u


class RefAdamW(RefOptimizer):
    def __init__(self, lr, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=1e-4,
                 nesterov=False):
        super().__init__()
        self.lr, self.b1, self.b2, self.eps, self.eps_root = lr, b1, b2, eps, eps_root
        self.wd, self.nesterov = weight_decay, nesterov

    def init_leaf(self, p):
        return zeros_state(p, "mu", "nu")

    def leaf_update(self, p, g, st, t):
        d = adam_direction(st, g, t, self.b1, self.b2, self.eps, self.eps_root, self.nesterov)
        return -self.lr * (d + self.wd * p)


class RefAdam(RefAdamW):
    """adam = adamw without the decay (adding 0*p is exact)."""

    def __init__(self, lr, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, nesterov=False):
        super().__init__(lr, b1, b2, eps, eps_root, weight_decay=0.0, nesterov=nesterov)


class RefLion(RefOptimizer):
    def __init__(self, lr, b1=0.9, b2=0.99, weight_decay=1e-3):
        super().__init__()
        self.lr, self.b1, self.b2, self.wd = lr, b1, b2, weight_decay

    def init_leaf(self, p):
        return zeros_state(p, "mu")

    def leaf_update(self, p, g, st, t):
        c = self.b1 * st["mu"] + (1 - self.b1) * g
        u = torch.sign(c)  # sign(0) = 0
        st["mu"] = self.b2 * st["mu"] + (1 - self.b2) * g
        return -self.lr * (u + self.wd * p)


class RefRMSprop(RefOptimizer):
    """optax rmsprop; ``centered``: scale_by_stddev (nu - mu² under the root, the running
    mean mu of g; torch.optim.RMSprop's centered=True with eps outside)."""

    def __init__(self, lr, decay=0.9, eps=1e-8, initial_scale=0.0, eps_in_sqrt=True,
                 momentum=None, nesterov=False, centered=False):
        super().__init__()
        self.lr, self.decay, self.eps, self.initial_scale = lr, decay, eps, initial_scale
        self.eps_in_sqrt, self.momentum, self.nesterov = eps_in_sqrt, momentum, nesterov
        self.centered = centered

    def init_leaf(self, p):
        st = zeros_state(p, "tr", *(["mu"] if self.centered else []))
        st["nu"] = torch.full_like(p, self.initial_scale, dtype=F64)
        return st

    def leaf_update(self, p, g, st, t):
        st["nu"] = self.decay * st["nu"] + (1 - self.decay) * g * g
        var = st["nu"]
        if self.centered:
            st["mu"] = self.decay * st["mu"] + (1 - self.decay) * g
            var = st["nu"] - st["mu"] ** 2
        if self.eps_in_sqrt:
            u = g / torch.sqrt(var + self.eps)
        else:
            u = g / (torch.sqrt(var) + self.eps)
        u = -self.lr * u
        if self.momentum is not None:
            u = trace(st, u, self.momentum, self.nesterov)
        return u


class RefAdagrad(RefOptimizer):
    """optax adagrad: scale_by_rss (eps inside the sqrt, 0 where s == 0) -> lr."""

    def __init__(self, lr, initial_accumulator_value=0.1, eps=1e-7):
        super().__init__()
        self.lr, self.iav, self.eps = lr, initial_accumulator_value, eps

    def init_leaf(self, p):
        return {"s": torch.full_like(p, self.iav, dtype=F64)}

    def leaf_update(self, p, g, st, t):
        st["s"] = st["s"] + g * g
        s = st["s"]
        safe = torch.where(s > 0, s, torch.ones_like(s))
        u = torch.where(s > 0, g / torch.sqrt(safe + self.eps), torch.zeros_like(g))
        return -self.lr * u


class RefLamb(RefOptimizer):
    def __init__(self, lr, b1=0.9, b2=0.999, eps=1e-6, eps_root=0.0, weight_decay=0.0):
        super().__init__()
        self.lr, self.b1, self.b2, self.eps, self.eps_root = lr, b1, b2, eps, eps_root
        self.wd = weight_decay

    def init_leaf(self, p):
        return zeros_state(p, "mu", "nu")

    def leaf_update(self, p, g, st, t):
        u = adam_direction(st, g, t, self.b1, self.b2, self.eps, self.eps_root)
        u = u + self.wd * p
        u = u * trust_ratio(u, p)
        return -self.lr * u


class RefLars(RefOptimizer):
    """``trust_ratio_mask``: a predicate of the leaf (default: every leaf), as optax's
    ``masked(scale_by_trust_ratio(...), trust_ratio_mask)``."""

    def __init__(self, lr, weight_decay=0.0, trust_coefficient=0.001, eps=0.0, momentum=0.9,
                 nesterov=False, trust_ratio_mask=None):
        super().__init__()
        self.lr, self.wd, self.tc, self.eps = lr, weight_decay, trust_coefficient, eps
        self.momentum, self.nesterov = momentum, nesterov
        self.trust_ratio_mask = trust_ratio_mask

    def init_leaf(self, p):
        return zeros_state(p, "tr")

    def leaf_update(self, p, g, st, t):
        u = g + self.wd * p
        if self.trust_ratio_mask is None or self.trust_ratio_mask(p):
            u = u * trust_ratio(u, p, trust_coefficient=self.tc, eps=self.eps)
        u = -self.lr * u
        return trace(st, u, self.momentum, self.nesterov)


class RefAdEMAMix(RefOptimizer):
    def __init__(self, lr, b1=0.9, b2=0.999, b3=0.9999, alpha=5.0, eps=1e-8, eps_root=0.0,
                 weight_decay=0.0):
        super().__init__()
        self.lr, self.b1, self.b2, self.b3, self.alpha = lr, b1, b2, b3, alpha
        self.eps, self.eps_root, self.wd = eps, eps_root, weight_decay

    def init_leaf(self, p):
        return zeros_state(p, "m1", "m2", "nu")

    def leaf_update(self, p, g, st, t):
        b1, b2, b3 = self.b1, self.b2, self.b3
        st["m1"] = b1 * st["m1"] + (1 - b1) * g
        st["m2"] = b3 * st["m2"] + (1 - b3) * g
        st["nu"] = b2 * st["nu"] + (1 - b2) * g * g
        m1_hat = st["m1"] / (1 - b1**t)
        nu_hat = st["nu"] / (1 - b2**t)
        u = (m1_hat + self.alpha * st["m2"]) / (torch.sqrt(nu_hat + self.eps_root) + self.eps)
        return -self.lr * (u + self.wd * p)


# --------------------------------------------------------------------------- bitsandbytes rows


class RefBnbSGD(RefOptimizer):
    """add_decayed_weights(wd) -> trace(momentum, nesterov) -> lr (= torch SGD, dampening 0)."""

    def __init__(self, lr, momentum, weight_decay=0.0, nesterov=False):
        super().__init__()
        self.lr, self.momentum, self.wd, self.nesterov = lr, momentum, weight_decay, nesterov

    def init_leaf(self, p):
        return zeros_state(p, "tr")

    def leaf_update(self, p, g, st, t):
        u = trace(st, g + self.wd * p, self.momentum, self.nesterov)
        return -self.lr * u


class RefBnbRMSprop(RefOptimizer):
    """add_decayed_weights(wd) -> scale_by_rms(alpha, eps, eps_in_sqrt=False) -> lr."""

    def __init__(self, lr, alpha, eps, weight_decay=0.0):
        super().__init__()
        self.lr, self.alpha, self.eps, self.wd = lr, alpha, eps, weight_decay

    def init_leaf(self, p):
        return zeros_state(p, "nu")

    def leaf_update(self, p, g, st, t):
        u = g + self.wd * p
        st["nu"] = self.alpha * st["nu"] + (1 - self.alpha) * u * u
        return -self.lr * u / (torch.sqrt(st["nu"]) + self.eps)


class RefBnbAdagrad(RefOptimizer):
    """add_decayed_weights(wd) -> scale_by_rss(iav, eps, eps_in_sqrt=False) -> lr.

    The bitsandbytes row uses initial_accumulator_value=0; it is a parameter here so that the
    same code can be checked against torch.optim.Adagrad with a non-zero accumulator.
    """

    def __init__(self, lr, eps, weight_decay=0.0, initial_accumulator_value=0.0):
        super().__init__()
        self.lr, self.eps, self.wd, self.iav = lr, eps, weight_decay, initial_accumulator_value

    def init_leaf(self, p):
        return {"s": torch.full_like(p, self.iav, dtype=F64)}

    def leaf_update(self, p, g, st, t):
        u = g + self.wd * p
        st["s"] = st["s"] + u * u
        return -self.lr * u / (torch.sqrt(st["s"]) + self.eps)


class RefBnbLamb(RefOptimizer):
    """scale_by_adam(b1, b2, eps) -> clip_by_param_norm_ratio(max_unorm)
    -> add_decayed_weights(wd) -> lr."""

    def __init__(self, lr, b1, b2, eps, weight_decay, max_unorm):
        super().__init__()
        self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps
        self.wd, self.max_unorm = weight_decay, max_unorm
        self.clip_log: list[bool] = []

    def init_leaf(self, p):
        return zeros_state(p, "mu", "nu")

    def leaf_update(self, p, g, st, t):
        u = adam_direction(st, g, t, self.b1, self.b2, self.eps)
        self.clip_log.append(norm(u) > self.max_unorm * norm(p))  # lets tests see both branches
        u = clip_by_param_norm_ratio(u, p, self.max_unorm)
        return -self.lr * (u + self.wd * p)


class RefBnbLars(RefOptimizer):
    """add_decayed_weights(wd) -> trace(momentum) -> clip_by_param_norm_ratio(max_unorm) -> lr."""

    def __init__(self, lr, momentum, weight_decay, max_unorm):
        super().__init__()
        self.lr, self.momentum, self.wd, self.max_unorm = lr, momentum, weight_decay, max_unorm
        self.clip_log: list[bool] = []

    def init_leaf(self, p):
        return zeros_state(p, "tr")

    def leaf_update(self, p, g, st, t):
        u = trace(st, g + self.wd * p, self.momentum)
        self.clip_log.append(norm(u) > self.max_unorm * norm(p))
        u = clip_by_param_norm_ratio(u, p, self.max_unorm)
        return -self.lr * u


# --------------------------------------------------------------------------- comparison helper


def max_rel_err(actual: dict, expected: dict, floor: float) -> float:
    """max over leaves/elements of |a - b| / max(|b|, floor), computed in float64."""
    worst = 0.0
    for k, b in expected.items():
        a = actual[k].detach().to(F64)
        b = b.detach().to(F64)
        assert a.shape == b.shape, (k, a.shape, b.shape)
        err = (a - b).abs() / torch.clamp(b.abs(), min=floor)
        if not bool(torch.isfinite(err).all()):
            return float("inf")  # NaN/inf must fail, never compare as "small"
        if err.numel():
            worst = max(worst, float(err.max()))
    return worst
