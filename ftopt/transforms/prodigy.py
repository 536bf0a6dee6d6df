"""Prodigy (optax.contrib.prodigy): AdamW whose learning rate is a running estimate d of
the distance to the solution, adapted from two global reductions.

Per step, with E the estimate (``estim_lr``), E0 its initial value, t the step after
increment, bc = √(1 − b2ᵗ)/(1 − b1ᵗ) and dlr = E·lr(count)·bc::

    dg = E·g;  m ← b1·m + (1−b1)·dg;  v ← b2·v + (1−b2)·dg²
    s ← b3·s + (dlr·dg)/E0            (safeguard_warmup: (E·dg)/E0)
    num ← b3·num + (E/E0)·dlr·Σ g·(x0 − p)       (a global dot product)
    E ← max(E, coef·num/Σ|s|)                    (a global L1 norm of the new s)
    u ← −dlr·m/(√v + E·eps) − wd·dlr·p           (the new E; wd where the mask holds)

How it runs: the whole transform is one stage with torch ops (a stateful matrix stage,
:mod:`ftopt.matrix`), batched over the leaves of one dtype and device: each line above is
one ``torch._foreach_*`` call over all of them (the dot product as the L1 norms of its
positive and negative parts, the L1 norm of s one ``_foreach_norm``), E and num stay 0-d
tensors of the state on the params' device (no host read; the first step's bias
correction is computed on the host when the count is known there). On the fused backend
the stage's update then goes through the one ``p + u`` kernel. The per-element math
cannot be a fused rule after the reductions: its update needs the new E, a value of this
step that a rule's per-step scalars, computed before the kernel, do not have.

``skip_zeros`` (SPEC §3): where the raw gradient is zero, m, v and s keep their bits and
the update is ``-0.0``; Σ|s| is the norm of the state as kept (a skipped element adds its
old |s|), the dot product gets nothing from it (g = 0); E, num and the count advance.

State storage (``quantize_states``, an alias' ``state_bits=8`` or ``state_dtype``): m, v
and s are stored as every rule's slots are (SPEC §5: 8-bit blockwise codes for leaves of at
least ``min_size`` elements, v with the unsigned map; or bf16/fp16): a step reads them in
the compute dtype, runs the math above (Σ|s| over the new s before it is stored) and stores
each once; with ``skip_zeros`` a block whose gradients are all zero keeps its bytes.
``params0``, a copy of the params, stays in their compute dtype (a rounded copy would bias
Σ g·(x0 − p)), as MADGRAD's x0 does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ftopt import eager
from ftopt import tree as tree_lib
from ftopt._counts import host_count, remember_count
from ftopt.base import GradientTransformation, register_owner, register_state
from ftopt.domains import NONNEG, POSITIVE, UNIT_OPEN, check_hparam
from ftopt.matrix import check_shards, flatten_call
from ftopt.program import skip_update
from ftopt.rule_transform import read_slot, rule_transform, stored_slot, write_slot
from ftopt.rules import QuantConfig, Rule, Slot, check_param, compute_dtype, state_dtype
from ftopt.schedules import ScalarOrSchedule
from ftopt.validate import check_count, check_leaf, check_slots

__all__ = ["ProdigyState", "scale_by_prodigy"]

Float = float | torch.Tensor


@register_state
class ProdigyState(NamedTuple):
    """optax's ``ProdigyState``: per element ``exp_avg`` (m), ``exp_avg_sq`` (v),
    ``grad_sum`` (s) and ``params0`` (x0, a copy of the params at ``init``); 0-d
    ``estim_lr`` (E) and ``numerator_weighted`` (num), fp32 (fp64 for fp64 params);
    ``count`` (0-d int32)."""

    exp_avg: Any
    exp_avg_sq: Any
    grad_sum: Any
    params0: Any
    estim_lr: torch.Tensor
    numerator_weighted: torch.Tensor
    count: torch.Tensor


_SLOTS = ("exp_avg", "exp_avg_sq", "grad_sum", "params0")
# The slots 8-bit and 16-bit storage apply to, each with its map (signed or not); params0,
# a copy of the params, stays in their compute dtype (as MADGRAD's x0, rules.Slot).
_STORED = {"exp_avg": True, "exp_avg_sq": False, "grad_sum": True}


class _Lists:
    """Elementwise ops over lists of tensors: ``torch._foreach_*`` (one call for all
    leaves), or a loop under autograd and ``torch.func``."""

    def __init__(self, mode: str):
        self.foreach = mode == "foreach"

    def mul(self, xs: list, y) -> list:
        """xs·y for a number or 0-d tensor y, or a list y."""
        if self.foreach:
            return list(torch._foreach_mul(xs, y))
        ys = y if isinstance(y, list) else [y] * len(xs)
        return [a * b for a, b in zip(xs, ys)]

    def binary(self, name: str, xs: list, ys: list) -> list:
        if self.foreach:
            return list(getattr(torch, f"_foreach_{name}")(xs, ys))
        fn = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}[name]
        return [fn(a, b) for a, b in zip(xs, ys)]

    def sqrt(self, xs: list) -> list:
        return list(torch._foreach_sqrt(xs)) if self.foreach else [x.sqrt() for x in xs]

    def add_scalar(self, xs: list, y: torch.Tensor) -> list:
        return list(torch._foreach_add(xs, y)) if self.foreach else [x + y for x in xs]

    def total(self, xs: list) -> torch.Tensor:
        """Σ over every element of every tensor."""
        if not self.foreach:
            return torch.stack([x.sum() for x in xs]).sum()
        # No _foreach_sum: the L1 norms of the positive and of the negative parts.
        pos = torch._foreach_norm(torch._foreach_clamp_min(xs, 0.0), 1)
        neg = torch._foreach_norm(torch._foreach_clamp_max(xs, 0.0), 1)
        return torch.stack(pos).sum() - torch.stack(neg).sum()

    def l1(self, xs: list) -> torch.Tensor:
        if not self.foreach:
            return torch.stack([x.abs().sum() for x in xs]).sum()
        return torch.stack(torch._foreach_norm(xs, 1)).sum()


class ScaleByProdigy:
    """The stage of :func:`scale_by_prodigy` (see the module docstring)."""

    matrix_stage = True
    mask_aware = True
    name = "prodigy"

    full_width_slots = ("params0",)

    def __init__(self, learning_rate, b1, b2, b3, eps, estim_lr0, estim_lr_coef,
                 weight_decay, safeguard_warmup: bool, weight_decay_mask,
                 quant: QuantConfig | None = None, store: torch.dtype | None = None):
        self.args = (learning_rate, b1, b2, b3, eps, estim_lr0, estim_lr_coef, weight_decay,
                     safeguard_warmup, weight_decay_mask)
        self.learning_rate, self.b1, self.b2, self.b3 = learning_rate, b1, b2, b3
        self.eps, self.estim_lr0, self.coef = eps, estim_lr0, estim_lr_coef
        self.weight_decay, self.safeguard = weight_decay, safeguard_warmup
        self.mask = weight_decay_mask
        # m, v and s as quantize_states asks (8-bit codes for leaves of >= min_size
        # elements, or 16-bit storage): read, updated in the compute dtype, stored once.
        self.quant, self.store = quant, store
        register_owner(self)

    def with_quant(self, quant: QuantConfig | None,
                   store: torch.dtype | None = None) -> ScaleByProdigy:
        """The same stage with m, v and s stored as ``quantize_states`` says."""
        return ScaleByProdigy(*self.args, quant=quant, store=store)

    def as_transform(self) -> GradientTransformation:
        return GradientTransformation(self.init, self.update)

    def _quant_for(self, p: torch.Tensor) -> QuantConfig | None:
        return self.quant if self.quant is not None and p.numel() >= self.quant.min_size \
            else None

    def check_shards(self, paths, u_flat) -> None:
        """The reductions read whole leaves: their shards may split no dim."""
        check_shards(self.name, "leaf", lambda u: True, paths, u_flat)

    def init(self, params) -> ProdigyState:
        paths, flat, spec = tree_lib.flatten_with_paths(params)
        for path, p in zip(paths, flat):
            check_param(path, p)
        slots = {name: tree_lib.unflatten(spec, [
            stored_slot(torch.zeros_like(p, dtype=state_dtype(p)), signed,
                        self._quant_for(p), self.store) for p in flat])
            for name, signed in _STORED.items()}
        slots["params0"] = tree_lib.unflatten(spec, [p.to(state_dtype(p), copy=True)
                                                     for p in flat])
        device = tree_lib.state_device(flat)
        wide = torch.float64 if flat and all(p.dtype == torch.float64 for p in flat) \
            else torch.float32
        count = torch.zeros((), dtype=torch.int32, device=device)
        remember_count(count, 0)
        return ProdigyState(**slots, estim_lr=torch.full((), float(self.estim_lr0), dtype=wide,
                                                         device=device),
                            numerator_weighted=torch.zeros((), dtype=wide, device=device),
                            count=count)

    def check_state(self, state: Any, u_flat, p_flat, spec, paths) -> None:
        """Raise (naming the leaf's path) unless ``state`` is a ProdigyState whose slots
        hold one tensor shaped like each leaf, on its device (m, v and s 8-bit where this
        stage makes them so), and whose E and num are 0-d float tensors."""
        if not isinstance(state, ProdigyState):
            raise TypeError(f"{self.name}: expected a ProdigyState, got "
                            f"{type(state).__name__}")
        check_count(self.name, state.count)
        for name in ("estim_lr", "numerator_weighted"):
            s = getattr(state, name)
            if not isinstance(s, torch.Tensor) or s.ndim != 0 or not s.is_floating_point():
                raise TypeError(f"{self.name}: state {name} must be a 0-d floating-point "
                                f"tensor, got {getattr(s, 'dtype', type(s).__name__)} "
                                f"{tuple(getattr(s, 'shape', ()))}")
        for name in _SLOTS:
            leaves = tree_lib.flatten_like(spec, getattr(state, name), f"state {name}", paths)
            for i, u in enumerate(u_flat):
                if u is None:
                    continue
                check_leaf(paths[i], u, p_flat[i], True)
                s, where = leaves[i], f"state {name} at {paths[i]}"
                if name in _STORED:
                    check_slots(self, paths[i], u, p_flat[i], {name: s})
                    continue
                if not isinstance(s, torch.Tensor) or not s.is_floating_point():
                    raise TypeError(f"{where}: expected a float tensor, got "
                                    f"{getattr(s, 'dtype', type(s).__name__)}")
                if s.shape != u.shape or s.device != u.device:
                    raise ValueError(f"{where}: expected shape {tuple(u.shape)} on "
                                     f"{u.device}, got {tuple(s.shape)} on {s.device}")

    def update(self, updates, state, params=None, **extra):
        if params is None:
            raise ValueError(f"{self.name}: params are required (u ← ... − wd·dlr·p and "
                             "Σ g·(x0 − p) read them)")
        spec, paths, u_flat, p_flat, zero_flat = flatten_call(updates, params, extra)
        self.check_state(state, u_flat, p_flat, spec, paths)
        self.check_shards(paths, u_flat)
        out, new = self.run_flat(u_flat, zero_flat, state, p_flat, spec, paths, params)
        return tree_lib.unflatten(spec, out), new

    def _decayed(self, spec, paths, params) -> list[bool]:
        """Per leaf, whether the weight decay applies (``weight_decay_mask``)."""
        mask = self.mask
        if mask is None:
            return [True] * len(paths)
        if callable(mask):
            mask = mask(params)
        return [bool(m) for m in tree_lib.flatten_like(spec, mask, "weight_decay_mask",
                                                       paths)]

    def run_flat(self, u_flat, zero_flat, state, p_flat, spec, paths, params=None):
        """The updates and the new state for flat leaves (:mod:`ftopt.matrix`)."""
        stored = {name: list(tree_lib.flatten_like(spec, getattr(state, name),
                                                   f"state {name}", paths))
                  for name in _SLOTS}
        slots = {name: [leaf if u is None or name not in _STORED else
                        read_slot(leaf, _STORED[name], self.quant, u)
                        for leaf, u in zip(leaves, u_flat)]
                 for name, leaves in stored.items()}
        if params is None:
            params = tree_lib.unflatten(spec, p_flat)
        count, t, new_count = _counts(state.count)
        lr = self.learning_rate(count) if callable(self.learning_rate) else self.learning_rate
        est = state.estim_lr
        bc = _bias_correction(self.b1, self.b2, t, est)
        dlr = est * lr * bc
        active = [i for i, u in enumerate(u_flat) if u is not None]
        groups: dict[tuple, list[int]] = {}
        for i in active:
            groups.setdefault((compute_dtype(u_flat[i]), u_flat[i].device), []).append(i)
        dot = torch.zeros((), dtype=est.dtype, device=est.device)
        l1 = torch.zeros((), dtype=est.dtype, device=est.device)
        new_slots = {name: list(leaves) for name, leaves in stored.items()}
        kept = {}
        for (dtype, device), leaves in groups.items():
            part = self._moments(dtype, device, leaves, u_flat, p_flat, slots, zero_flat,
                                 est, dlr)
            for name, signed in _STORED.items():
                for i, value in zip(leaves, part[name]):
                    zero = None if zero_flat is None else zero_flat[i]
                    new_slots[name][i] = write_slot(stored[name][i], value, signed,
                                                    self.quant, zero)
            dot = dot + part["dot"].to(est.device, est.dtype)
            l1 = l1 + part["l1"].to(est.device, est.dtype)
            kept[(dtype, device)] = (part["lists"], part["exp_avg"], part["exp_avg_sq"])
        b3 = _as(self.b3, est)
        num = b3 * state.numerator_weighted + (est / self.estim_lr0) * dlr * dot
        new_est = torch.maximum(est, _as(self.coef, est) * num / l1)
        out = list(u_flat)
        decayed = self._decayed(spec, paths, params) if self.weight_decay is not None else None
        for (dtype, device), leaves in groups.items():
            ops, m, v = kept[(dtype, device)]
            denom = ops.add_scalar(ops.sqrt(v), (new_est * _as(self.eps, new_est)).to(
                device, dtype))
            result = ops.mul(ops.binary("div", m, denom), (-dlr).to(device, dtype))
            wd_leaves = [j for j, i in enumerate(leaves) if decayed is None or decayed[i]]
            if wd_leaves and not _is_zero(self.weight_decay):
                scale = (_as(self.weight_decay, dlr) * dlr).to(device, dtype)
                ps = ops.mul([p_flat[leaves[j]].to(dtype) for j in wd_leaves], scale)
                for j, value in zip(wd_leaves, ops.binary("sub", [result[j] for j in
                                                                  wd_leaves], ps)):
                    result[j] = value
            for j, i in enumerate(leaves):
                zero = None if zero_flat is None else zero_flat[i]
                out[i] = result[j] if zero is None else skip_update(result[j], zero)
        values = {name: tree_lib.unflatten(spec, leaves) for name, leaves in new_slots.items()}
        return out, ProdigyState(**values, estim_lr=new_est.to(est.dtype),
                                 numerator_weighted=num.to(est.dtype), count=new_count)

    def _moments(self, dtype, device, leaves, u_flat, p_flat, slots, zero_flat, est, dlr):
        """One group's new m, v, s and its parts of Σ g·(x0 − p) and Σ|s|."""
        g = [u_flat[i].to(dtype) for i in leaves]
        mode = eager.choose_mode(g + [v for v in (self.b1, self.b2, self.b3)
                                      if isinstance(v, torch.Tensor)])
        ops = _Lists(mode)
        old = {name: [slots[name][i].to(dtype) for i in leaves] for name in _SLOTS}
        b1, b2, b3 = (_as(b, est).to(device, dtype) if isinstance(b, torch.Tensor) else b
                      for b in (self.b1, self.b2, self.b3))
        dg = ops.mul(g, est.to(device, dtype))
        m = ops.binary("add", ops.mul(old["exp_avg"], b1), ops.mul(dg, 1 - b1))
        v = ops.binary("add", ops.mul(old["exp_avg_sq"], b2),
                       ops.mul(ops.mul(dg, dg), 1 - b2))
        step = (est if self.safeguard else dlr).to(device, dtype)
        s = ops.binary("add", ops.mul(old["grad_sum"], b3),
                       ops.mul(ops.mul(dg, step), 1 / self.estim_lr0))
        if zero_flat is not None:  # skipped elements keep their states' bits
            zeros = [zero_flat[i] for i in leaves]
            m, v, s = ([torch.where(z, o, n) for z, o, n in zip(zeros, old[name], new)]
                       for name, new in (("exp_avg", m), ("exp_avg_sq", v), ("grad_sum", s)))
        diff = ops.binary("sub", old["params0"], [p_flat[i].to(dtype) for i in leaves])
        dot = ops.total(ops.binary("mul", g, diff))
        return {"exp_avg": m, "exp_avg_sq": v, "grad_sum": s, "dot": dot, "l1": ops.l1(s),
                "lists": ops}


def _is_zero(value: Any) -> bool:
    return not isinstance(value, torch.Tensor) and float(value) == 0.0


def _as(value: Any, like: torch.Tensor) -> Any:
    return value.to(like.device, like.dtype) if isinstance(value, torch.Tensor) else value


def _counts(count: torch.Tensor) -> tuple[Any, Any, torch.Tensor]:
    """(count for the schedule, t = count + 1, the new count tensor): host ints where the
    count is known on the host, else device tensors (no device read)."""
    known = host_count(count)
    if known is None and count.device.type == "cpu" and not eager.functorch_active():
        known = int(count)
    new_count = count + 1
    if known is None:
        return count, new_count, new_count
    remember_count(new_count, known + 1)
    return known, known + 1, new_count


def _bias_correction(b1: Any, b2: Any, t: Any, like: torch.Tensor) -> Any:
    """√(1 − b2ᵗ)/(1 − b1ᵗ), in float64 on the host (a number) where it can be."""
    if isinstance(t, int) and not isinstance(b1, torch.Tensor) \
            and not isinstance(b2, torch.Tensor):
        return math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    wide = torch.float64 if like.device.type in ("cpu", "cuda") else like.dtype
    t = torch.as_tensor(t, device=like.device).to(wide)
    b1, b2 = (torch.as_tensor(b, device=like.device).to(wide) for b in (b1, b2))
    return (torch.sqrt(1 - b2 ** t) / (1 - b1 ** t)).to(like.dtype)


def _bias_scalars(t, h) -> dict:
    """``lr_bc`` = lr·√(1 − b2ᵗ)/(1 − b1ᵗ), in float64 (a device tensor where the count is
    or a beta is a tensor), ``one_minus_b1``, ``one_minus_b2`` and ``inv_estim_lr0`` = 1/E0."""
    if isinstance(t, torch.Tensor) or any(isinstance(h[k], torch.Tensor)
                                          for k in ("b1", "b2")):
        b1, b2 = (torch.as_tensor(h[k], dtype=torch.float64) for k in ("b1", "b2"))
        bc = torch.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    else:
        bc = math.sqrt(1 - h["b2"] ** t) / (1 - h["b1"] ** t)
    # 1 − b1, 1 − b2 and 1/E0 in float64 here, not in the kernel from fp32 b1, b2 and E0:
    # 1 − fp32(0.999) is 1.3e-5 off (√v 6e-6), 1/fp32(1e-3) rounds to 999.99994 (a bias s
    # and num would carry every step).
    return {"lr_bc": h["learning_rate"] * bc, "one_minus_b1": 1 - h["b1"],
            "one_minus_b2": 1 - h["b2"], "inv_estim_lr0": 1.0 / h["estim_lr0"]}


def _carry(t, h, old) -> tuple[dict, dict]:
    """The old estimate and numerator, read by the body, which computes the new ones."""
    return {"estim_lr": old["estim_lr"], "numerator_weighted": old["numerator_weighted"]}, {}


def _body(safeguard: bool):
    def body(o, x):
        est = x.estim_lr
        dlr = est * x.lr_bc
        dg = est * x.u
        m = x.b1 * x.exp_avg + x.one_minus_b1 * dg
        v = x.b2 * x.exp_avg_sq + x.one_minus_b2 * (dg * dg)
        s = x.b3 * x.grad_sum + (dg * (est if safeguard else dlr)) * x.inv_estim_lr0
        # Σ|s| over the state as kept: a skipped element adds its old |s|.
        kept = s if x.skip is None else o.where(x.skip, x.grad_sum, s)
        dot = o.global_sum(x.u * (x.params0 - x.p))
        l1 = o.global_sum(o.abs(kept))
        num = x.b3 * x.numerator_weighted + (est * x.inv_estim_lr0) * dlr * dot
        new_est = o.maximum(est, x.estim_lr_coef * num / l1)
        u = (dlr * -1.0) * m / (o.sqrt(v) + new_est * x.eps) - x.weight_decay * dlr * x.p
        return u, {"exp_avg": m, "exp_avg_sq": v, "grad_sum": s, "params0": x.params0,
                   "estim_lr": new_est, "numerator_weighted": num}
    return body


def prodigy_rule(learning_rate, b1, b2, b3, eps, estim_lr0: float, estim_lr_coef,
                 weight_decay, safeguard_warmup: bool) -> Rule:
    """Prodigy as one elementwise rule (the module docstring's math): Σ g·(x0 − p) and
    Σ|s| are global sums (``o.global_sum``: the fused reduction pass), E and num running
    scalars the body computes from them (the fused main kernel stores them)."""
    return Rule(
        "scale_by_prodigy", _body(bool(safeguard_warmup)), state_class=ProdigyState,
        slots=(Slot("exp_avg"), Slot("exp_avg_sq", signed=False), Slot("grad_sum"),
               Slot("params0", from_params=True)),
        hparams={"learning_rate": learning_rate, "b1": b1, "b2": b2, "b3": b3, "eps": eps,
                 "estim_lr0": float(estim_lr0), "estim_lr_coef": estim_lr_coef,
                 "weight_decay": weight_decay},
        scalars=_bias_scalars, counted=True, uses_params=True,
        running={"estim_lr": "estim_lr0", "numerator_weighted": 0.0}, advance=_carry)


def scale_by_prodigy(
    learning_rate: ScalarOrSchedule = 1.0,
    betas: tuple[Float, Float] = (0.9, 0.999),
    beta3: Float | None = None,
    eps: Float = 1e-8,
    estim_lr0: float = 1e-6,
    estim_lr_coef: Float = 1.0,
    weight_decay: Float = 0.0,
    safeguard_warmup: bool = False,
    weight_decay_mask: Any | Callable[[Any], Any] | None = None,
) -> GradientTransformation:
    """Prodigy's update (optax.contrib.prodigy's ``update``, the math in the module
    docstring): the updates to add to the params, learning rate and decay included.

    Args:
        learning_rate: a schedule-like multiplier of the estimate (default: 1.0), a float,
            0-d tensor or schedule of the step count.
        betas: (b1, b2) of the underlying AdamW, each in [0, 1) (default: (0.9, 0.999)).
        beta3: decay of s and num, in [0, 1) (default: √b2).
        eps: added to √v, scaled by the estimate, >= 0 (default: 1e-8).
        estim_lr0: the initial estimate, > 0 (default: 1e-6).
        estim_lr_coef: the estimates are multiplied by it, >= 0 (default: 1.0).
        weight_decay: AdamW's decay wd, >= 0, applied as −wd·dlr·p (default: 0.0).
        safeguard_warmup: s accumulates E·dg in place of dlr·dg (default: False).
        weight_decay_mask: a tree of bools like the params (or a function of the params
            returning one): the decay applies where it holds (default: every leaf).
    """
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"prodigy: betas must be a pair (b1, b2), got {betas!r}")
    b1, b2 = betas
    if beta3 is None:
        beta3 = b2 ** 0.5
    if isinstance(estim_lr0, bool) or not isinstance(estim_lr0, (int, float)):
        raise TypeError(f"prodigy: estim_lr0 must be a float > 0, got {estim_lr0!r}")
    for name, value, domain in (("b1", b1, UNIT_OPEN), ("b2", b2, UNIT_OPEN),
                                ("beta3", beta3, UNIT_OPEN), ("eps", eps, NONNEG),
                                ("estim_lr0", estim_lr0, POSITIVE),
                                ("estim_lr_coef", estim_lr_coef, NONNEG),
                                ("weight_decay", weight_decay, NONNEG)):
        check_hparam("prodigy", name, value, domain)
    if not callable(learning_rate):
        check_hparam("prodigy", "learning_rate", learning_rate, NONNEG)
    if weight_decay_mask is None:
        return rule_transform(prodigy_rule(learning_rate, b1, b2, beta3, eps, float(estim_lr0),
                                           estim_lr_coef, weight_decay,
                                           bool(safeguard_warmup)))
    stage = ScaleByProdigy(learning_rate, b1, b2, beta3, eps, float(estim_lr0),
                           estim_lr_coef, weight_decay, bool(safeguard_warmup),
                           weight_decay_mask)
    return GradientTransformation(stage.init, stage.update)
