"""Float64 references of ``ftopt.dog`` and ``ftopt.dowg`` (nothing here imports ftopt),
written from optax/contrib/_dog.py. Both scale the whole tree by one step size:

* DoG: r̄ ← max(r̄, ‖x₀ − p‖), G ← G + ‖u‖², η = r̄/√(G + eps) (the first step's η is
  ``value`` for ``init_step=("learning_rate", value)``; r̄ starts at ``value`` for
  "distance", ``value·(1 + ‖x₀‖)`` for "heuristic", 0 for "learning_rate");
* DoWG: r² ← max(r², ‖x₀ − p‖²), V ← V + r²·‖u‖², η = r²/(√V + eps);

then p ← p − lr·η·u with u = g + wd·p. Norms are over every element of every leaf.
"""

from __future__ import annotations

import math

from reference import F64, RefOptimizer


class _RefDistance(RefOptimizer):
    def __init__(self, lr, weight_decay=0.0):
        super().__init__()
        self.lr, self.wd = lr, weight_decay

    def _norms(self, p, u) -> tuple[float, float]:
        """(‖x₀ − p‖², ‖u‖²) over the tree."""
        dist = sum(float((self.state[k]["init_params"] - p[k]).square().sum()) for k in p)
        return dist, sum(float(u[k].square().sum()) for k in p)

    def eta(self, sq_dist: float, sq_norm: float) -> float:
        raise NotImplementedError

    def step(self, params: dict, grads: dict) -> dict:
        self.t += 1
        p = {k: v.detach().to(F64) for k, v in params.items()}
        for k, v in p.items():
            self.state.setdefault(k, {"init_params": v.clone()})
        u = {k: grads[k].detach().to(F64) + self.wd * p[k] for k in p}
        eta = self.eta(*self._norms(p, u))
        out = {}
        for k in p:
            self.last_update[k] = -self.lr * eta * u[k]
            out[k] = p[k] + self.last_update[k]
        return out


class RefDoG(_RefDistance):
    def __init__(self, lr=1.0, init_step=("heuristic", 1e-6), eps=1e-8, weight_decay=0.0):
        super().__init__(lr, weight_decay)
        self.kind, self.value = init_step
        self.eps, self.max_dist, self.sum_sq = eps, None, 0.0

    def eta(self, sq_dist, sq_norm):
        if self.max_dist is None:  # r_ε, from the params at init
            x0 = math.sqrt(sum(float(s["init_params"].square().sum())
                               for s in self.state.values()))
            self.max_dist = {"distance": self.value, "learning_rate": 0.0,
                             "heuristic": self.value * (1 + x0)}[self.kind]
        self.max_dist = max(self.max_dist, math.sqrt(sq_dist))
        self.sum_sq += sq_norm
        if self.kind == "learning_rate" and self.t == 1:
            return self.value
        return self.max_dist / math.sqrt(self.sum_sq + self.eps)


class RefDoWG(_RefDistance):
    def __init__(self, lr=1.0, init_estim_sq_dist=None, eps=1e-4, weight_decay=0.0):
        super().__init__(lr, weight_decay)
        self.estim = eps if init_estim_sq_dist is None else init_estim_sq_dist
        self.eps, self.weighted = eps, 0.0

    def eta(self, sq_dist, sq_norm):
        self.estim = max(self.estim, sq_dist)
        self.weighted += self.estim * sq_norm
        return self.estim / (math.sqrt(self.weighted) + self.eps)
