"""Float64 reference of ``ftopt.prodigy`` (nothing here imports ftopt), written from
optax/contrib/_prodigy.py: E the estimate, t the step, dlr = E·lr·√(1−b2ᵗ)/(1−b1ᵗ);
dg = E·g; m ← b1 m + (1−b1) dg; v ← b2 v + (1−b2) dg²; s ← b3 s + dlr·dg/E0;
num ← b3 num + (E/E0)·dlr·Σ g·(x0 − p); E ← max(E, coef·num/Σ|s|);
u = −dlr·m/(√v + E·eps) − wd·dlr·p.

``step(..., skip=masks)`` (skip_zeros, SPEC §3): where a mask holds, m, v and s keep their
values and the update is 0; Σ|s| is taken over the state as kept (a skipped element adds its
old |s|); the dot product gets nothing there (g = 0); E, num and t advance.
``decayed`` (leaf -> bool, ``weight_decay_mask``): the decay applies only where it holds.
"""

from __future__ import annotations

import math

import torch
from reference import F64, RefOptimizer


class RefProdigy(RefOptimizer):
    def __init__(self, lr=1.0, b1=0.9, b2=0.999, b3=None, eps=1e-8, estim_lr0=1e-6,
                 coef=1.0, weight_decay=0.0, safeguard_warmup=False, decayed=None):
        super().__init__()
        self.lr, self.b1, self.b2 = lr, b1, b2
        self.b3 = math.sqrt(b2) if b3 is None else b3
        self.eps, self.e0, self.coef, self.wd = eps, estim_lr0, coef, weight_decay
        self.safeguard = safeguard_warmup
        self.decayed = decayed  # leaf -> whether the decay applies (weight_decay_mask)
        self.estim, self.num = estim_lr0, 0.0

    def step(self, params: dict, grads: dict, skip: dict | None = None) -> dict:
        self.t += 1
        t, est = self.t, self.estim
        p = {k: v.detach().to(F64) for k, v in params.items()}
        g = {k: grads[k].detach().to(F64) for k in p}
        for k, v in p.items():
            if k not in self.state:
                zero = torch.zeros_like(v)
                self.state[k] = {"m": zero, "v": zero, "s": zero, "x0": v.clone()}
        dlr = est * self.lr * math.sqrt(1 - self.b2 ** t) / (1 - self.b1 ** t)
        dot = sum(float((g[k] * (self.state[k]["x0"] - p[k])).sum()) for k in p)
        for k in p:
            st, dg = self.state[k], est * g[k]
            new = {"m": self.b1 * st["m"] + (1 - self.b1) * dg,
                   "v": self.b2 * st["v"] + (1 - self.b2) * dg * dg,
                   "s": self.b3 * st["s"] + (est if self.safeguard else dlr) * dg / self.e0}
            for name, value in new.items():
                st[name] = value if skip is None else torch.where(skip[k], st[name], value)
        self.num = self.b3 * self.num + (est / self.e0) * dlr * dot
        l1 = sum(float(self.state[k]["s"].abs().sum()) for k in p)
        self.estim = max(est, self.coef * self.num / l1)
        out = {}
        for k in p:
            st = self.state[k]
            wd = self.wd if self.decayed is None or self.decayed[k] else 0.0
            u = -dlr * st["m"] / (st["v"].sqrt() + self.estim * self.eps) - wd * dlr * p[k]
            if skip is not None:
                u = torch.where(skip[k], torch.zeros((), dtype=F64), u)
            self.last_update[k] = u
            out[k] = p[k] + u
        return out


class RefDAdaptAdamW(RefOptimizer):
    """optax.contrib.dadapt_adamw (D-Adaptation, Prodigy's predecessor), from
    optax/contrib/_dadapt_adamw.py: β = √b2, dlr = E·lr·√(1−b2ᵗ)/(1−b1ᵗ);
    A = Σ g·s/(√v + eps) (old s, v); m ← b1 m + (1−b1) dlr g; v ← b2 v + (1−b2) g²;
    s ← β s + (1−β) dlr g; num ← β num + (1−β) dlr A; E ← max(E, num/((1−β) Σ|s|))
    (kept where Σ|s| = 0); u = −wd dlr p − m/(√v + eps). ``skip`` as RefProdigy's."""

    def __init__(self, lr=1.0, b1=0.9, b2=0.999, eps=1e-8, estim_lr0=1e-6, weight_decay=0.0):
        super().__init__()
        self.lr, self.b1, self.b2, self.eps, self.wd = lr, b1, b2, eps, weight_decay
        self.estim, self.num = estim_lr0, 0.0

    def step(self, params: dict, grads: dict, skip: dict | None = None) -> dict:
        self.t += 1
        t, sb2 = self.t, math.sqrt(self.b2)
        p = {k: v.detach().to(F64) for k, v in params.items()}
        g = {k: grads[k].detach().to(F64) for k in p}
        for k, v in p.items():
            if k not in self.state:
                zero = torch.zeros_like(v)
                self.state[k] = {"m": zero, "v": zero, "s": zero}
        dlr = self.estim * self.lr * math.sqrt(1 - self.b2 ** t) / (1 - self.b1 ** t)
        acc = sum(float((g[k] * self.state[k]["s"] / (self.state[k]["v"].sqrt() + self.eps))
                        .sum()) for k in p)
        for k in p:
            st = self.state[k]
            new = {"m": self.b1 * st["m"] + (1 - self.b1) * dlr * g[k],
                   "v": self.b2 * st["v"] + (1 - self.b2) * g[k] ** 2,
                   "s": sb2 * st["s"] + (1 - sb2) * dlr * g[k]}
            for name, value in new.items():
                st[name] = value if skip is None else torch.where(skip[k], st[name], value)
        self.num = sb2 * self.num + (1 - sb2) * dlr * acc
        l1 = sum(float(self.state[k]["s"].abs().sum()) for k in p)
        if l1 > 0:
            self.estim = max(self.estim, self.num / ((1 - sb2) * l1))
        out = {}
        for k in p:
            st = self.state[k]
            u = -self.wd * dlr * p[k] - st["m"] / (st["v"].sqrt() + self.eps)
            if skip is not None:
                u = torch.where(skip[k], torch.zeros((), dtype=F64), u)
            self.last_update[k] = u
            out[k] = p[k] + u
        return out
