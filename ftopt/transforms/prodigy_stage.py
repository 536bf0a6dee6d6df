"""Prodigy as one stage of torch ops (:mod:`ftopt.matrix`), batched over the leaves of one
dtype and device: the path of :func:`ftopt.transforms.prodigy.scale_by_prodigy` with a
``weight_decay_mask`` (a per-leaf value, which a rule has not). Each line of the math (the
module docstring of :mod:`ftopt.transforms.prodigy`) is one ``torch._foreach_*`` call over
all leaves (the dot product as the L1 norms of its positive and negative parts, the L1 norm
of s one ``_foreach_norm``); E and num stay 0-d tensors on the params' device (no host
read; the first step's bias correction is computed on the host when the count is known
there). On the fused backend the stage's update then goes through the one ``p + u``
kernel. The state is the rule's, :class:`ftopt.transforms.prodigy.ProdigyState`, which
that module hands to the stage (``state_class``: it imports this one)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ftopt import eager
from ftopt import tree as tree_lib
from ftopt._counts import new_count, remember_count
from ftopt.base import GradientTransformation, register_owner
from ftopt.matrix import check_shards, flatten_call
from ftopt.program import skip_update
from ftopt.rule_transform import read_slot, stored_slot, write_slot
from ftopt.rules import QuantConfig, check_param, compute_dtype, state_dtype
from ftopt.validate import check_count, check_leaf, check_slots

__all__ = ["ScaleByProdigy"]

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
    """:func:`scale_by_prodigy` with a ``weight_decay_mask``: one stage of torch ops (see the
    module docstring)."""

    matrix_stage = True
    mask_aware = True
    name = "prodigy"

    full_width_slots = ("params0",)

    def __init__(self, learning_rate, b1, b2, b3, eps, estim_lr0, estim_lr_coef,
                 weight_decay, safeguard_warmup: bool, weight_decay_mask, state_class: type,
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
        self.state_class = state_class
        register_owner(self)

    def with_quant(self, quant: QuantConfig | None,
                   store: torch.dtype | None = None) -> ScaleByProdigy:
        """The same stage with m, v and s stored as ``quantize_states`` says."""
        return ScaleByProdigy(*self.args, self.state_class, quant=quant, store=store)

    def as_transform(self) -> GradientTransformation:
        return GradientTransformation(self.init, self.update)

    def _quant_for(self, p: torch.Tensor) -> QuantConfig | None:
        return self.quant if self.quant is not None and p.numel() >= self.quant.min_size \
            else None

    def check_shards(self, paths, u_flat) -> None:
        """The reductions read whole leaves: their shards may split no dim."""
        check_shards(self.name, "leaf", lambda u: True, paths, u_flat)

    def init(self, params) -> Any:
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
        count = new_count(0, device)
        return self.state_class(**slots, estim_lr=torch.full((), float(self.estim_lr0), dtype=wide,
                                                         device=device),
                            numerator_weighted=torch.zeros((), dtype=wide, device=device),
                            count=count)

    def check_state(self, state: Any, u_flat, p_flat, spec, paths) -> None:
        """Raise (naming the leaf's path) unless ``state`` is a ProdigyState whose slots
        hold one tensor shaped like each leaf, on its device (m, v and s 8-bit where this
        stage makes them so), and whose E and num are 0-d float tensors."""
        if not isinstance(state, self.state_class):
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
        new_est = torch.where(l1 > 0, torch.maximum(est, _as(self.coef, est) * num / l1), est)
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
        return out, self.state_class(**values, estim_lr=new_est.to(est.dtype),
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
    count may be known on the host (:func:`ftopt.eager.known_count`), else device tensors."""
    known = eager.known_count(count)
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
    # A float b made a tensor directly in the wide dtype: through float32 first (the
    # default dtype) 1 − b1ᵗ would be ~1e-7 off the host's value.
    b1, b2 = (b.to(like.device, wide) if isinstance(b, torch.Tensor)
              else torch.tensor(b, dtype=wide, device=like.device) for b in (b1, b2))
    return (torch.sqrt(1 - b2 ** t) / (1 - b1 ** t)).to(like.dtype)
