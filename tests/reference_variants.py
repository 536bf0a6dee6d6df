"""Float64 references of the optimizers of ``ftopt.alias_variants`` and ``ftopt.alias_more``
(nothing here imports ftopt).

Written from optax's code (optax/_src/transform.py, optax/_src/alias.py,
optax/transforms/_accumulation.py, optax/contrib/_adopt.py, optax/contrib/_ademamix.py,
optax/contrib/_madgrad.py) and
the papers; conventions as in ``reference.py`` (per-leaf float64 state, ``t`` from 1,
``p_new = p + last_update``).

====================  ==========================================================================
adamax / adamaxw      mu <- b1 mu + (1-b1) g; nu <- max(b2 nu, |g| + eps); d = mu/(1-b1^t)/nu
                      [-> + wd p] -> -lr
amsgrad               adam moments; nu_max <- max(nu_max, nu/(1-b2^t)); d = m_hat/(sqrt(nu_max +
                      eps_root) + eps) -> -lr (bias corrections switchable)
nadam / nadamw        adam with nesterov (reference.adam_direction) [-> + wd p] -> -lr
radam                 ro_inf = 2/(1-b2) - 1, ro = ro_inf - 2 t b2^t/(1-b2^t);
                      d = r m_hat/(sqrt(v_hat + eps_root) + eps) if ro >= threshold else m_hat
adabelief             mu; nu <- b2 nu + (1-b2)(g - mu)^2 + eps_root; d = m_hat/(sqrt(nu/(1-b2^t))
                      + eps) [-> + wd p] -> -lr
yogi                  mu, nu from 1e-6; nu <- nu - (1-b2) sign(nu - g^2) g^2; d as adam -> -lr
mars                  c = g + gamma b1/(1-b1) (g - g_prev) (g_prev = 0 at t = 1); c <- c min(1,
                      thr/(||c|| + 1e-12)) over the whole tree; adam moments of c,
                      d = m_hat/(sqrt(v_hat) + eps) -> + wd p -> -lr
ano                   mu <- b1 mu + (1-b1) g (b1 = 1 - 1/log(max(2, t)) with the logarithmic
                      schedule); nu <- b2 nu + (1-b2) sign(g^2 - nu) g^2;
                      d = |g| sign(mu)/sqrt(nu/(1-b2^t) + eps) [-> + wd p] -> -lr
adadelta              u = g + wd p; e_g <- rho e_g + (1-rho) u^2;
                      d = sqrt(e_x + eps)/sqrt(e_g + eps) u; e_x <- rho e_x + (1-rho) d^2 -> -lr
sign_sgd / signum     d = sign(g) / sign(m), m <- beta m + (1-beta) g -> -lr
optimistic GD         d = (alpha + beta) g - beta g_prev (g_prev = g on the first step) -> -lr
adopt                 t = 1: nu <- g^2, d = 0. Later: v = clip(g/max(sqrt(nu_prev), eps), c) with
                      c = (t-1)^0.25; nu <- b2 nu + (1-b2) g^2; mu <- b1 mu + (1-b1) v; d = mu
                      (nesterov: b1 mu + (1-b1) v) -> -lr
simplified_ademamix   m <- b1 m + g; n <- b2 n + (1-b2) g^2; d = (m + alpha g)/(sqrt(n/(1-b2^t) +
                      eps_root) + eps) -> + wd p -> -lr
adan                  d = g - g_prev (0 at t = 1); m, v (of d), n (of (g + (1-b2) d)^2) EMAs;
                      u = (m_hat + (1-b2) v_hat)/(sqrt(n_hat + eps_root) + eps) -> + wd p -> -lr
madgrad               u = g + wd p; lamb = (lr + eps) sqrt(t); G += lamb u^2; s += lamb u;
                      z = x0 - s/(G^(1/3) + eps); p <- (1 - momentum) z + momentum p
rprop                 a = g prev; step <- step if a = 0 else clip(step eta_(+/-)); the update
                      is -(0 if a < 0 else prev); prev <- 0 if a < 0 else step sign(g)
====================  ==========================================================================
"""

from __future__ import annotations

import math

import torch
from reference import F64, RefOptimizer, adam_direction, zeros_state


def _m_hat(st, g, t, b1, nesterov):
    if nesterov:
        return b1 * st["mu"] / (1 - b1 ** (t + 1)) + (1 - b1) * g / (1 - b1**t)
    return st["mu"] / (1 - b1**t)


class RefAdamax(RefOptimizer):
    def __init__(self, lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0):
        super().__init__()
        self.lr, self.b1, self.b2, self.eps, self.wd = lr, b1, b2, eps, weight_decay

    def init_leaf(self, p):
        return zeros_state(p, "mu", "nu")

    def leaf_update(self, p, g, st, t):
        st["mu"] = self.b1 * st["mu"] + (1 - self.b1) * g
        st["nu"] = torch.maximum(self.b2 * st["nu"], g.abs() + self.eps)
        d = st["mu"] / (1 - self.b1**t) / st["nu"]
        return -self.lr * (d + self.wd * p)


class RefAmsgrad(RefOptimizer):
    def __init__(self, lr, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0,
                 bias_correction_mu=True, bias_correction_nu=True):
        super().__init__()
        self.lr, self.b1, self.b2, self.eps, self.eps_root = lr, b1, b2, eps, eps_root
        self.bc_mu, self.bc_nu = bias_correction_mu, bias_correction_nu

    def init_leaf(self, p):
        return zeros_state(p, "mu", "nu", "nu_max")

    def leaf_update(self, p, g, st, t):
        st["mu"] = self.b1 * st["mu"] + (1 - self.b1) * g
        st["nu"] = self.b2 * st["nu"] + (1 - self.b2) * g * g
        m_hat = st["mu"] / (1 - self.b1**t) if self.bc_mu else st["mu"]
        nu = st["nu"] / (1 - self.b2**t) if self.bc_nu else st["nu"]
        st["nu_max"] = torch.maximum(st["nu_max"], nu)
        return -self.lr * m_hat / (torch.sqrt(st["nu_max"] + self.eps_root) + self.eps)


class RefNAdamW(RefOptimizer):
    def __init__(self, lr, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=0.0):
        super().__init__()
        self.lr, self.b1, self.b2, self.eps, self.eps_root = lr, b1, b2, eps, eps_root
        self.wd = weight_decay

    def init_leaf(self, p):
        return zeros_state(p, "mu", "nu")

    def leaf_update(self, p, g, st, t):
        d = adam_direction(st, g, t, self.b1, self.b2, self.eps, self.eps_root, nesterov=True)
        return -self.lr * (d + self.wd * p)


class RefRAdam(RefOptimizer):
    def __init__(self, lr, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, threshold=5.0,
                 nesterov=False):
        super().__init__()
        self.lr, self.b1, self.b2, self.eps, self.eps_root = lr, b1, b2, eps, eps_root
        self.threshold, self.nesterov = threshold, nesterov
        self.rectified: list[bool] = []  # per step: whether the rectified branch ran

    def init_leaf(self, p):
        return zeros_state(p, "mu", "nu")

    def step(self, params, grads):
        out = super().step(params, grads)
        self.rectified.append(self._ro(self.t) >= self.threshold)
        return out

    def _ro(self, t):
        ro_inf = 2 / (1 - self.b2) - 1
        return ro_inf - 2 * t * self.b2**t / (1 - self.b2**t)

    def leaf_update(self, p, g, st, t):
        st["mu"] = self.b1 * st["mu"] + (1 - self.b1) * g
        st["nu"] = self.b2 * st["nu"] + (1 - self.b2) * g * g
        m_hat = _m_hat(st, g, t, self.b1, self.nesterov)
        ro_inf, ro = 2 / (1 - self.b2) - 1, self._ro(t)
        if ro < self.threshold:
            return -self.lr * m_hat
        r = math.sqrt((ro - 4) * (ro - 2) * ro_inf / ((ro_inf - 4) * (ro_inf - 2) * ro))
        v_hat = st["nu"] / (1 - self.b2**t)
        return -self.lr * r * m_hat / (torch.sqrt(v_hat + self.eps_root) + self.eps)


class RefAdaBelief(RefOptimizer):
    def __init__(self, lr, b1=0.9, b2=0.999, eps=1e-16, eps_root=1e-16, weight_decay=None,
                 nesterov=False):
        super().__init__()
        self.lr, self.b1, self.b2, self.eps, self.eps_root = lr, b1, b2, eps, eps_root
        self.wd, self.nesterov = weight_decay or 0.0, nesterov

    def init_leaf(self, p):
        return zeros_state(p, "mu", "nu")

    def leaf_update(self, p, g, st, t):
        st["mu"] = self.b1 * st["mu"] + (1 - self.b1) * g
        err = g - st["mu"]
        st["nu"] = self.b2 * st["nu"] + (1 - self.b2) * err * err + self.eps_root
        m_hat = _m_hat(st, g, t, self.b1, self.nesterov)
        d = m_hat / (torch.sqrt(st["nu"] / (1 - self.b2**t)) + self.eps)
        return -self.lr * (d + self.wd * p)


class RefACProp(RefOptimizer):
    """optax.contrib.acprop: the update divided by the previous step's bias-corrected
    second moment of the prediction error g − mu_old (1 on the first step)."""

    def __init__(self, lr, b1=0.9, b2=0.999, eps=1e-16, eps_root=1e-16, weight_decay=0.0):
        super().__init__()
        self.lr, self.b1, self.b2, self.eps, self.eps_root = lr, b1, b2, eps, eps_root
        self.wd = weight_decay

    def init_leaf(self, p):
        return zeros_state(p, "mu", "nu")

    def leaf_update(self, p, g, st, t):
        nu_hat = torch.ones_like(g) if t == 1 else st["nu"] / (1 - self.b2 ** (t - 1))
        err = g - st["mu"]
        st["mu"] = self.b1 * st["mu"] + (1 - self.b1) * g
        st["nu"] = self.b2 * st["nu"] + (1 - self.b2) * err * err + self.eps_root
        return -self.lr * (g / (torch.sqrt(nu_hat) + self.eps) + self.wd * p)


class RefYogi(RefOptimizer):
    def __init__(self, lr, b1=0.9, b2=0.999, eps=1e-3, initial_accumulator_value=1e-6):
        super().__init__()
        self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps
        self.init_value = initial_accumulator_value

    def init_leaf(self, p):
        return {n: torch.full_like(p, self.init_value, dtype=F64) for n in ("mu", "nu")}

    def leaf_update(self, p, g, st, t):
        st["mu"] = self.b1 * st["mu"] + (1 - self.b1) * g
        g2 = g * g
        st["nu"] = st["nu"] - (1 - self.b2) * torch.sign(st["nu"] - g2) * g2
        m_hat = st["mu"] / (1 - self.b1**t)
        v_hat = st["nu"] / (1 - self.b2**t)
        return -self.lr * m_hat / (torch.sqrt(v_hat) + self.eps)


class RefMars(RefOptimizer):
    """MARS: its clip reads the global norm of c over all leaves (``step`` below)."""

    def __init__(self, lr, b1=0.95, b2=0.99, eps=1e-8, gamma=0.025, clip_threshold=1.0,
                 weight_decay=0.0):
        super().__init__()
        self.lr, self.b1, self.b2, self.eps, self.gamma = lr, b1, b2, eps, gamma
        self.thr, self.wd = clip_threshold, weight_decay

    def init_leaf(self, p):
        return zeros_state(p, "last_grad", "mu", "nu")

    def step(self, params, grads):
        self.t += 1
        for n, p in params.items():
            if n not in self.state:
                self.state[n] = self.init_leaf(p.detach().to(F64))
        k = self.gamma * self.b1 / (1 - self.b1)
        c = {n: g.detach().to(F64) + k * (g.detach().to(F64) - self.state[n]["last_grad"])
             for n, g in grads.items()}
        scale = 1.0
        if self.thr is not None:
            norm = math.sqrt(sum(float((x * x).sum()) for x in c.values()))
            scale = min(1.0, self.thr / (norm + 1e-12))
        out = {}
        for n, p in params.items():
            p, st, cn, t = p.detach().to(F64), self.state[n], c[n] * scale, self.t
            st["last_grad"] = grads[n].detach().to(F64)
            st["mu"] = self.b1 * st["mu"] + (1 - self.b1) * cn
            st["nu"] = self.b2 * st["nu"] + (1 - self.b2) * cn * cn
            d = (st["mu"] / (1 - self.b1**t)) / (torch.sqrt(st["nu"] / (1 - self.b2**t))
                                                 + self.eps)
            self.last_update[n] = -self.lr * (d + self.wd * p)
            out[n] = p + self.last_update[n]
        return out


class RefAno(RefOptimizer):
    def __init__(self, lr, b1=0.92, b2=0.99, eps=1e-8, weight_decay=0.0,
                 logarithmic_schedule=False):
        super().__init__()
        self.lr, self.b1, self.b2, self.eps, self.wd = lr, b1, b2, eps, weight_decay
        self.log = logarithmic_schedule

    def init_leaf(self, p):
        return zeros_state(p, "mu", "nu")

    def leaf_update(self, p, g, st, t):
        b1 = 1 - 1 / math.log(max(2, t)) if self.log else self.b1
        st["mu"] = b1 * st["mu"] + (1 - b1) * g
        g2 = g * g
        st["nu"] = self.b2 * st["nu"] + (1 - self.b2) * torch.sign(g2 - st["nu"]) * g2
        d = g.abs() * torch.sign(st["mu"]) / torch.sqrt(st["nu"] / (1 - self.b2**t) + self.eps)
        return -self.lr * (d + self.wd * p)


class RefAdadelta(RefOptimizer):
    def __init__(self, lr=1.0, rho=0.9, eps=1e-6, weight_decay=0.0):
        super().__init__()
        self.lr, self.rho, self.eps, self.wd = lr, rho, eps, weight_decay

    def init_leaf(self, p):
        return zeros_state(p, "e_g", "e_x")

    def leaf_update(self, p, g, st, t):
        u = g + self.wd * p
        st["e_g"] = self.rho * st["e_g"] + (1 - self.rho) * u * u
        d = torch.sqrt(st["e_x"] + self.eps) / torch.sqrt(st["e_g"] + self.eps) * u
        st["e_x"] = self.rho * st["e_x"] + (1 - self.rho) * d * d
        return -self.lr * d


class RefSignSGD(RefOptimizer):
    def __init__(self, lr):
        super().__init__()
        self.lr = lr

    def leaf_update(self, p, g, st, t):
        return -self.lr * torch.sign(g)


class RefSignum(RefOptimizer):
    def __init__(self, lr, beta=0.9):
        super().__init__()
        self.lr, self.beta = lr, beta

    def init_leaf(self, p):
        return zeros_state(p, "m")

    def leaf_update(self, p, g, st, t):
        st["m"] = self.beta * st["m"] + (1 - self.beta) * g
        return -self.lr * torch.sign(st["m"])


class RefOptimisticGD(RefOptimizer):
    def __init__(self, lr, alpha=1.0, beta=1.0):
        super().__init__()
        self.lr, self.alpha, self.beta = lr, alpha, beta

    def init_leaf(self, p):
        return {"prev": None}

    def leaf_update(self, p, g, st, t):
        prev = g if st["prev"] is None else st["prev"]
        st["prev"] = g
        return -self.lr * ((self.alpha + self.beta) * g - self.beta * prev)


class RefOptimisticAdam(RefOptimizer):
    """optax.optimistic_adam_v2: the Adam direction r (Nesterov by default), then
    (alpha + beta)·r − beta·r_prev (r_prev = r on the first step) -> -lr."""

    def __init__(self, lr, alpha=1.0, beta=1.0, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0,
                 nesterov=True):
        super().__init__()
        self.lr, self.alpha, self.beta = lr, alpha, beta
        self.b1, self.b2, self.eps, self.eps_root, self.nesterov = b1, b2, eps, eps_root, nesterov

    def init_leaf(self, p):
        st = zeros_state(p, "mu", "nu")
        st["prev"] = None
        return st

    def leaf_update(self, p, g, st, t):
        r = adam_direction(st, g, t, self.b1, self.b2, self.eps, self.eps_root, self.nesterov)
        prev = r if st["prev"] is None else st["prev"]
        st["prev"] = r
        return -self.lr * ((self.alpha + self.beta) * r - self.beta * prev)


class RefAdopt(RefOptimizer):
    def __init__(self, lr, b1=0.9, b2=0.9999, eps=1e-6, nesterov=False, use_clipping=True):
        super().__init__()
        self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps
        self.nesterov, self.use_clipping = nesterov, use_clipping

    def init_leaf(self, p):
        return zeros_state(p, "mu", "nu")

    def leaf_update(self, p, g, st, t):
        if t == 1:  # the first step only measures the second moment
            st["nu"] = g * g
            return torch.zeros_like(g)
        v = g / torch.clamp(torch.sqrt(st["nu"]), min=self.eps)
        if self.use_clipping:
            c = (t - 1) ** 0.25
            v = torch.clamp(v, -c, c)
        st["nu"] = self.b2 * st["nu"] + (1 - self.b2) * g * g
        st["mu"] = self.b1 * st["mu"] + (1 - self.b1) * v
        d = self.b1 * st["mu"] + (1 - self.b1) * v if self.nesterov else st["mu"]
        return -self.lr * d


class RefSimplifiedAdEMAMix(RefOptimizer):
    def __init__(self, lr, b1=0.99, b2=0.95, alpha=0.0, eps=1e-8, eps_root=0.0,
                 weight_decay=0.0):
        super().__init__()
        self.lr, self.b1, self.b2, self.alpha = lr, b1, b2, alpha
        self.eps, self.eps_root, self.wd = eps, eps_root, weight_decay

    def init_leaf(self, p):
        return zeros_state(p, "m", "n")

    def leaf_update(self, p, g, st, t):
        st["m"] = self.b1 * st["m"] + g
        st["n"] = self.b2 * st["n"] + (1 - self.b2) * g * g
        n_hat = st["n"] / (1 - self.b2**t)
        d = (st["m"] + self.alpha * g) / (torch.sqrt(n_hat + self.eps_root) + self.eps)
        return -self.lr * (d + self.wd * p)


# ---- ftopt.alias_more (optax/_src/transform.py scale_by_adan, scale_by_rprop;
# optax/contrib/_madgrad.py)


class RefAdan(RefOptimizer):
    """d = g - g_prev (0 at t = 1); m, v, n EMAs keeping a fraction b of the old value;
    u = (m_hat + (1-b2) v_hat)/(sqrt(n_hat + eps_root) + eps) -> + wd p -> -lr."""

    def __init__(self, lr, b1=0.98, b2=0.92, b3=0.99, eps=1e-8, eps_root=1e-8,
                 weight_decay=0.0):
        super().__init__()
        self.lr, self.b1, self.b2, self.b3 = lr, b1, b2, b3
        self.eps, self.eps_root, self.wd = eps, eps_root, weight_decay
        self.first_diff_zero = True  # False: d = g - 0 at t = 1 (a mistake, for the tests)

    def init_leaf(self, p):
        return zeros_state(p, "m", "v", "n", "g")

    def leaf_update(self, p, g, st, t):
        b1, b2, b3 = self.b1, self.b2, self.b3
        d = torch.zeros_like(g) if t == 1 and self.first_diff_zero else g - st["g"]
        st["m"] = b1 * st["m"] + (1 - b1) * g
        st["v"] = b2 * st["v"] + (1 - b2) * d
        st["n"] = b3 * st["n"] + (1 - b3) * (g + (1 - b2) * d) ** 2
        st["g"] = g
        m_hat = st["m"] / (1 - b1**t)
        v_hat = st["v"] / (1 - b2**t)
        n_hat = st["n"] / (1 - b3**t)
        d = (m_hat + (1 - b2) * v_hat) / (torch.sqrt(n_hat + self.eps_root) + self.eps)
        return -self.lr * (d + self.wd * p)


class RefMadgrad(RefOptimizer):
    """u = g + wd p; lamb = (lr + eps) sqrt(t); G += lamb u^2; s += lamb u;
    z = x0 - s/(G^(1/3) + eps); p_new = (1 - momentum) z + momentum p."""

    def __init__(self, lr, momentum=0.9, weight_decay=0.0, eps=1e-6):
        super().__init__()
        self.lr, self.momentum, self.wd, self.eps = lr, momentum, weight_decay, eps

    def init_leaf(self, p):
        return {**zeros_state(p, "grad_sum_sq", "s"), "x0": p.clone()}

    def leaf_update(self, p, g, st, t):
        u = g + self.wd * p
        lamb = (self.lr + self.eps) * math.sqrt(t)
        st["grad_sum_sq"] = st["grad_sum_sq"] + lamb * u * u
        st["s"] = st["s"] + lamb * u
        z = st["x0"] - st["s"] / (st["grad_sum_sq"] ** (1 / 3) + self.eps)
        return (1 - self.momentum) * z + self.momentum * p - p


class RefCOCOB(RefOptimizer):
    """optax.contrib.cocob: u = lr·(g + wd·p) (no sign flip); L = max(L, |u|); G += |u|;
    R = max(R − u·(p − p0), 0); C −= u; p_new = p0 + C/(L·max(G + L, alpha·L))·(L + R).
    (State names as ftopt's slots: C cumulative_gradients, L scale, G subgradients, R
    reward, p0 init_particles.)"""

    def __init__(self, lr=1.0, alpha=100.0, eps=1e-8, weight_decay=0.0):
        super().__init__()
        self.lr, self.alpha, self.eps, self.wd = lr, alpha, eps, weight_decay

    def init_leaf(self, p):
        return {**zeros_state(p, "cumulative_gradients", "subgradients", "reward"),
                "scale": torch.full_like(p, self.eps, dtype=F64), "init_particles": p.clone()}

    def leaf_update(self, p, g, st, t):
        u = self.lr * (g + self.wd * p)
        st["scale"] = torch.maximum(st["scale"], u.abs())
        st["subgradients"] = st["subgradients"] + u.abs()
        st["reward"] = torch.clamp(st["reward"] - u * (p - st["init_particles"]), min=0.0)
        st["cumulative_gradients"] = st["cumulative_gradients"] - u
        L, G = st["scale"], st["subgradients"]
        bet = st["cumulative_gradients"] / (L * torch.maximum(G + L, self.alpha * L))
        return st["init_particles"] + bet * (L + st["reward"]) - p


class RefRprop(RefOptimizer):
    """optax's Rprop: the step for sign(g_t) is applied at t + 1 (the first update is 0)."""

    def __init__(self, lr, eta_minus=0.5, eta_plus=1.2, min_step_size=1e-6,
                 max_step_size=50.0):
        super().__init__()
        self.lr, self.eta_minus, self.eta_plus = lr, eta_minus, eta_plus
        self.min, self.max = min_step_size, max_step_size

    def init_leaf(self, p):
        return {"step_sizes": torch.full_like(p, self.lr, dtype=F64),
                **zeros_state(p, "prev_updates")}

    def leaf_update(self, p, g, st, t):
        agree = g * st["prev_updates"]
        factor = torch.where(agree > 0, self.eta_plus, self.eta_minus)
        grown = torch.clamp(st["step_sizes"] * factor, self.min, self.max)
        st["step_sizes"] = torch.where(agree == 0, st["step_sizes"], grown)
        flipped = agree < 0
        prev_new = torch.where(flipped, 0.0, st["step_sizes"] * torch.sign(g))
        update = torch.where(flipped, 0.0, st["prev_updates"])
        st["prev_updates"] = prev_new
        return -update


class RefScheduleFree(RefOptimizer):
    """optax.contrib.schedule_free around SGD (``adam=False``: u = -lr (g + wd p)) or Adam
    without momentum (u = -lr (g/(sqrt(nu/(1-b2^t)) + eps) + wd p)); lr(k) = peak
    min(k, W)/W with warmup W, else peak. Per step s = t (step_count from 1): max_lr =
    max(max_lr, lr(s)); w = max_lr^power; W_sum += w; c = w/W_sum; z' = z + u_base (the
    base reads lr at its count t-1); x = (y - (1-b1) z)/b1; x' = (1-c) x + c z';
    y' = b1 x' + (1-b1) z'."""

    def __init__(self, lr, warmup_steps=None, b1=0.9, weight_decay=0.0, power=2.0,
                 adam=False, b2=0.999, eps=1e-8):
        super().__init__()
        self.peak, self.warmup, self.b1, self.wd, self.power = (lr, warmup_steps, b1,
                                                                weight_decay, power)
        self.adam, self.b2, self.eps = adam, b2, eps
        self.max_lr, self.weight_sum, self.c = 0.0, 0.0, 0.0

    def lr(self, k):
        if self.warmup is None:
            return self.peak
        return self.peak * min(k, self.warmup) / self.warmup

    def step(self, params, grads):
        s = self.t + 1
        self.max_lr = max(self.max_lr, self.lr(s))
        w = self.max_lr ** self.power
        self.weight_sum += w
        self.c = w / self.weight_sum if self.weight_sum > 0 else 0.0
        return super().step(params, grads)

    def init_leaf(self, p):
        return {"z": p.clone(), **zeros_state(p, "nu")}

    def leaf_update(self, p, g, st, t):
        if self.adam:
            st["nu"] = self.b2 * st["nu"] + (1 - self.b2) * g * g
            d = g / (torch.sqrt(st["nu"] / (1 - self.b2**t)) + self.eps)
        else:
            d = g
        u_base = -self.lr(t - 1) * (d + self.wd * p)
        z_old, z = st["z"], st["z"] + u_base
        x = (p - (1 - self.b1) * z_old) / self.b1
        x = (1 - self.c) * x + self.c * z
        st["z"] = z
        return self.b1 * x + (1 - self.b1) * z - p
