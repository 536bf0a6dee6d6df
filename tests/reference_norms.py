"""Float64 references of ``ftopt.alias_norms`` (nothing here imports ftopt).

Written from optax's code (optax/_src/transform.py ``scale_by_novograd``,
optax/_src/alias.py ``novograd`` and ``fromage``) and the papers; conventions as in
``reference.py`` (per-leaf float64 state, ``t`` from 1, ``p_new = p + last_update``).

========  ==============================================================================
novograd  per leaf s = ||g||^2: nu <- s at t = 1, else b2 nu + (1-b2) s (one number per leaf);
          a = g/(sqrt(nu + eps_root) + eps) + wd p; mu <- a at t = 1, else b1 mu + a -> -lr
fromage   r = max(||p||, min_norm)/max(||g||, min_norm) (1 where a norm is 0); m = 1/sqrt(1 + lr^2);
          p <- m (p - lr r g)
========  ==============================================================================
"""

from __future__ import annotations

import math

import torch
from reference import RefOptimizer


class RefNovograd(RefOptimizer):
    def __init__(self, lr, b1=0.9, b2=0.25, eps=1e-6, eps_root=0.0, weight_decay=0.0):
        super().__init__()
        self.lr, self.b1, self.b2 = lr, b1, b2
        self.eps, self.eps_root, self.wd = eps, eps_root, weight_decay

    def init_leaf(self, p):
        return {"nu": 0.0, "mu": torch.zeros_like(p)}

    def leaf_update(self, p, g, st, t):
        s = float((g * g).sum())
        st["nu"] = s if t == 1 else self.b2 * st["nu"] + (1 - self.b2) * s
        a = g / (math.sqrt(st["nu"] + self.eps_root) + self.eps) + self.wd * p
        st["mu"] = a if t == 1 else self.b1 * st["mu"] + a
        return -self.lr * st["mu"]


class RefFromage(RefOptimizer):
    def __init__(self, lr, min_norm=1e-6):
        super().__init__()
        self.lr, self.min_norm = lr, min_norm
        self.shrink = True  # False: p <- p - lr r g (a mistake, for the tests)

    def leaf_update(self, p, g, st, t):
        p_norm = max(float(p.norm()), self.min_norm)
        g_norm = max(float(g.norm()), self.min_norm)
        ratio = 1.0 if p_norm == 0.0 or g_norm == 0.0 else p_norm / g_norm
        m = 1 / math.sqrt(1 + self.lr**2) if self.shrink else 1.0
        return m * (p - self.lr * ratio * g) - p
