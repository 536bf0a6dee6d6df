"""Porting optimizer state between ``torch.optim`` and ftopt.

:func:`from_torch_state_dict` turns the ``state_dict()`` of a torch Adam, AdamW, SGD
(momentum), RMSprop or Adagrad into the state of the matching ftopt transform, and
:func:`to_torch_state_dict` goes back. The transform decides the layout; its stages and
torch's state keys correspond as follows:

==============================  ===================================================
ftopt stage (state)             torch state of each param
==============================  ===================================================
``scale_by_adam`` (mu, nu)      ``exp_avg``, ``exp_avg_sq``; ``count`` = ``step``
``trace`` (trace)               ``momentum_buffer`` (SGD; RMSprop: see below)
``scale_by_rms`` (nu)           ``square_avg``
``scale_by_stddev`` (mu, nu)    ``grad_avg``, ``square_avg`` (centered RMSprop)
``scale_by_rss`` (sum)          ``sum``
scheduled learning rate         its ``count`` = ``step``
==============================  ===================================================

The math matches torch where the transform is the one torch runs:

* ``torch.optim.Adam(lr, betas, eps)``: ``ftopt.adam(lr, b1, b2, eps)``;
  ``AdamW(..., weight_decay=wd)``: ``ftopt.adamw(..., weight_decay=wd)``; Adam with an
  L2 ``weight_decay``: ``chain(add_decayed_weights(wd), scale_by_adam(...), lr)``.
* ``SGD(lr, momentum, nesterov=...)``: ``ftopt.sgd(lr, momentum, nesterov)`` (torch's
  first buffer is the gradient, as ftopt's trace from zeros).
* ``RMSprop(lr, alpha, eps)``: ``ftopt.rmsprop(lr, decay=alpha, eps=eps,
  eps_in_sqrt=False)``; with ``momentum``, ftopt's trace follows the learning rate
  (optax's order), so it holds −lr·torch's buffer: exact while the learning rate stays
  what the torch group says. ``RMSprop(..., centered=True)``: ``ftopt.rmsprop(...,
  eps_in_sqrt=False, centered=True)``.
* ``Adagrad(lr, eps, initial_accumulator_value=v)``: ``chain(scale_by_rss(v, eps,
  eps_in_sqrt=False), scale_by_learning_rate(lr))`` (``ftopt.adagrad`` puts eps inside
  the square root, as optax).

What cannot be ported raises a ``ValueError`` naming the param index and the reason:
``amsgrad``, ``maximize``, SGD ``dampening``, Adagrad
``lr_decay``, torch state keys the transform has no place for (NAdam's ``mu_product``,
...), and step counts that differ between the params of a transform (ftopt keeps one
per transform: a param torch never stepped has no state, which is ported as the
transform's initial state only when no step count is involved). ``capturable``,
``foreach`` and ``fused`` only change where torch keeps the tensors: they port.

``params`` is the tree the ftopt state is for; the k-th param of the torch optimizer
(its param index) is the k-th tensor of ``params`` in the order given (dicts in
insertion order, so ``dict(model.named_parameters())`` matches
``model.parameters()``), or the param of that name where the torch state_dict names its
params (``named_parameters()`` given to the torch optimizer) and ``params`` is a dict.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import optree
import torch

from ftopt.base import GradientTransformation, check_transform
from ftopt.quant import dequantize_blockwise, dynamic_map, quantize_blockwise
from ftopt.rules import QuantizedSlot
from ftopt.stages import chain_stages, state_at, with_state_at

__all__ = ["from_torch_state_dict", "to_torch_state_dict"]

# ftopt slot -> torch state key, per stage with per-element state.
_SLOTS = {
    "scale_by_adam": {"mu": "exp_avg", "nu": "exp_avg_sq"},
    "trace": {"trace": "momentum_buffer"},
    "scale_by_rms": {"nu": "square_avg"},
    "scale_by_stddev": {"mu": "grad_avg", "nu": "square_avg"},
    "scale_by_rss": {"sum_of_squares": "sum"},
}
# torch state keys without an ftopt place, and why.
_UNPORTABLE_KEYS = {
    "max_exp_avg_sq": "amsgrad has no ftopt counterpart",
    "mu_product": "NAdam's state has no ftopt counterpart",
    "eta": "ASGD's state has no ftopt counterpart",
    "acc_delta": "Adadelta's state has no ftopt counterpart",
    "prev": "Rprop's state has no ftopt counterpart",
}
# torch group options that change the math, and the value ftopt's math has.
_GROUP_OPTIONS = {"amsgrad": False, "maximize": False, "centered": False, "dampening": 0,
                  "lr_decay": 0}


def _given_order(params: Any) -> list[tuple]:
    """The optree path of each tensor of ``params``, in the order given."""
    out: list[tuple] = []

    def walk(node, path):
        if isinstance(node, torch.Tensor):
            out.append(path)
        elif isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, (*path, k))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, (*path, i))
        elif node is not None:
            raise TypeError(f"params at {list(path)}: expected tensors in dicts, lists and "
                            f"tuples, got {type(node).__name__}")

    walk(params, ())
    return out


class PortLayout:
    """The transform's stages over ``params``: leaves in optree order, and the optree
    leaf index of each torch param index."""

    def __init__(self, tx: GradientTransformation, params: Any, groups: list | None,
                 where: str, known: Mapping = _SLOTS, library: str = "torch.optim"):
        check_transform(tx, f"{where}: argument tx")
        found = chain_stages(tx)
        if found.reason:
            raise ValueError(f"{where}: tx must be a chain of ftopt transforms "
                             f"({found.reason})")
        for stage in found.stages:
            if stage.rule.slots and stage.rule.name not in known:
                raise ValueError(f"{where}: {stage.rule.name} has no {library} "
                                 "counterpart")
        self.stages, self.paths = found.stages, found.state_paths
        self.spec = optree.tree_structure(params, none_is_leaf=False, namespace="ftopt")
        self.leaves = self.spec.flatten_up_to(params)
        optree_paths = optree.tree_paths(params, none_is_leaf=False, namespace="ftopt")
        position = {tuple(p): i for i, p in enumerate(optree_paths)}
        self.order = [position[p] for p in _given_order(params)]
        names = [n for g in groups or () for n in g.get("param_names", ())]
        if isinstance(params, Mapping) and names:
            if len(names) != len(self.leaves) or set(names) != set(params):
                raise ValueError(f"{where}: the torch state_dict names params "
                                 f"{sorted(set(names) ^ set(params))[:5]} that params "
                                 "lacks or does not name")
            self.order = [position[(n,)] for n in names]
        # The learning rate a trace after the learning-rate stage is scaled by.
        names_in_order = [s.rule.name for s in self.stages]
        self.lr_scaled_trace = ("trace" in names_in_order and "scale_by_learning_rate" in
                                names_in_order[:names_in_order.index("trace")])


def groups_by_index(groups: list, n: int, where: str) -> dict[int, dict]:
    by_index = {}
    for g in groups:
        for i in g["params"]:
            by_index[i] = g
    if sorted(by_index) != list(range(n)):
        raise ValueError(f"{where}: the torch param groups hold {len(by_index)} params, "
                         f"params holds {n} tensors (expected indices 0..{n - 1})")
    return by_index


def check_group(group: dict, index: int, where: str, centered: bool = False) -> None:
    """Raises where a torch group option changes the math from ftopt's (``centered``:
    the transform is centered RMSprop, ``scale_by_stddev``)."""
    for option, plain in {**_GROUP_OPTIONS, "centered": centered}.items():
        if option in group and group[option] != plain:
            raise ValueError(f"{where}: param {index}: {option}={group[option]!r} cannot "
                             f"be ported (ftopt's math is {option}={plain!r})")


def _torch_lr(group: dict, index: int, where: str) -> float:
    lr = group.get("lr")
    if isinstance(lr, torch.Tensor):
        lr = float(lr)
    if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr == 0:
        raise ValueError(f"{where}: param {index}: RMSprop's momentum buffer is ported "
                         f"through the group's lr, which is {lr!r}")
    return float(lr)


def from_torch_state_dict(torch_sd: dict, tx: GradientTransformation, params: Any) -> Any:
    """The ftopt state of ``tx`` over ``params`` equal to a torch optimizer's state.

    Args:
        torch_sd: ``torch_optimizer.state_dict()`` of Adam, AdamW, SGD, RMSprop or
            Adagrad (see the module docstring for the matching transforms).
        tx: the ftopt transform to continue with (a chain; 8-bit states are quantized
            from torch's fp32 values).
        params: the params the state is for (the torch optimizer's params, in its order).

    Returns:
        A state like ``tx.init(params)``, on the params' devices.

    Raises:
        ValueError: what cannot be ported, naming the param index and the reason.
    """
    where = "from_torch_state_dict"
    if not isinstance(torch_sd, Mapping) or {"state", "param_groups"} - set(torch_sd):
        raise ValueError(f"{where}: expected a torch optimizer state_dict (a dict with "
                         "'state' and 'param_groups')")
    layout = PortLayout(tx, params, torch_sd["param_groups"], where)
    n = len(layout.leaves)
    groups = groups_by_index(torch_sd["param_groups"], n, where)
    entries = {}
    for index in range(n):
        check_group(groups[index], index, where,
                    centered="scale_by_stddev" in {s.rule.name for s in layout.stages})
        entry = torch_sd["state"].get(index) or {}
        entry = {k: v for k, v in entry.items() if v is not None}
        used = {"step"} | {key for s in layout.stages
                           for key in _SLOTS.get(s.rule.name, {}).values()}
        for key in sorted(set(entry) - used):
            reason = _UNPORTABLE_KEYS.get(key, "the transform has no state it maps to")
            raise ValueError(f"{where}: param {index}: torch state {key!r} cannot be "
                             f"ported ({reason})")
        entries[layout.order[index]] = (index, entry)
    step = common_step(layout, entries, where)
    with torch.no_grad():
        state = tx.init(params)
        for stage, path in zip(layout.stages, layout.paths):
            state = with_state_at(state, path, _port_stage(stage, state_at(state, path),
                                                           layout, entries, groups, step,
                                                           where))
    return state


def common_step(layout: PortLayout, entries: dict, where: str) -> int | None:
    counted = any(s.rule.counted for s in layout.stages)
    steps = {}
    for index, entry in entries.values():
        value = entry.get("step")
        if value is not None:
            steps[index] = float(value)
    if not counted:
        return None
    if not steps:
        if any(entry for _, entry in entries.values()):
            raise ValueError(f"{where}: the torch state holds no step count (SGD), which "
                             "the transform's count (a scheduled learning rate) needs")
        return 0
    first = min(steps)
    for index in range(len(layout.leaves)):
        if steps.get(index, 0.0) != steps[first]:
            raise ValueError(f"{where}: param {index} has step {steps.get(index, 0.0):g}, "
                             f"param {first} has {steps[first]:g}: ftopt keeps one step "
                             "count per transform (a param torch stepped less often "
                             "cannot be ported)")
    value = steps[first]
    if value != int(value) or value < 0:
        raise ValueError(f"{where}: param {first}: step {value} is not a whole number")
    return int(value)


def _port_stage(stage, st, layout: PortLayout, entries: dict, groups: dict, step, where):
    values = {}
    if stage.rule.counted:
        values["count"] = torch.full_like(st.count, step)
    for slot in stage.rule.slots:
        key = _SLOTS[stage.rule.name][slot.name]
        leaves = layout.spec.flatten_up_to(getattr(st, slot.name))
        out = []
        for leaf_index, (leaf, p) in enumerate(zip(leaves, layout.leaves)):
            index, entry = entries[leaf_index]
            src = entry.get(key)
            if src is None:
                out.append(leaf)  # never stepped in torch: the initial state
                continue
            if not isinstance(src, torch.Tensor) or src.shape != p.shape:
                got = tuple(src.shape) if isinstance(src, torch.Tensor) else type(src).__name__
                raise ValueError(f"{where}: param {index}: torch state {key!r} is {got}, "
                                 f"expected shape {tuple(p.shape)}")
            quantized = isinstance(leaf, QuantizedSlot)
            value = src.detach().to(device=p.device,
                                    dtype=torch.float32 if quantized else leaf.dtype)
            if stage.rule.name == "trace" and layout.lr_scaled_trace:
                value = value * -_torch_lr(groups[index], index, where)
            if quantized:
                qmap = dynamic_map(slot.signed, p.device)
                out.append(QuantizedSlot(*quantize_blockwise(value, qmap,
                                                             stage.quant.block_size)))
            else:
                out.append(value.clone())
        values[slot.name] = optree.tree_unflatten(layout.spec, out)
    return type(st)(**values)


def to_torch_state_dict(state: Any, tx: GradientTransformation, params: Any, *,
                        param_groups: list[dict] | None = None,
                        step: int | None = None) -> dict:
    """A torch optimizer state_dict holding ``state`` (the inverse of
    :func:`from_torch_state_dict`), for ``torch_optimizer.load_state_dict``.

    Args:
        state: the state of ``tx`` over ``params``.
        tx: its transform (see the module docstring for the torch optimizers it matches).
        params: the params, in the torch optimizer's order.
        param_groups: torch's param groups to write (``torch_opt.state_dict()
            ["param_groups"]``: torch's ``load_state_dict`` takes the hyperparameters
            from here). Default: one group with the hyperparameters read off ``tx``
            (fixed numbers only; a schedule, or ``nesterov``, needs ``param_groups``).
        step: the ``step`` of params whose transform keeps no count (RMSprop, Adagrad:
            torch's math does not read it). Default: the transform's count, or 0.

    Returns:
        ``{"state": {index: {...}}, "param_groups": [...]}`` with fp32 (dequantized)
        tensors.
    """
    where = "to_torch_state_dict"
    layout = PortLayout(tx, params, param_groups, where)
    n = len(layout.leaves)
    groups = param_groups if param_groups is not None else [_torch_group(layout, n, where)]
    by_index = groups_by_index(groups, n, where)
    counts = [int(state_at(state, path).count) for stage, path in
              zip(layout.stages, layout.paths) if stage.rule.counted]
    if len(set(counts)) > 1:
        raise ValueError(f"{where}: the transform's step counts differ ({counts}); torch "
                         "keeps one per param")
    count = counts[0] if counts else (step if step is not None else 0)
    out: dict[int, dict] = {i: {} for i in range(n)}
    for stage, path in zip(layout.stages, layout.paths):
        st = state_at(state, path)
        for slot in stage.rule.slots:
            key = _SLOTS[stage.rule.name][slot.name]
            leaves = layout.spec.flatten_up_to(getattr(st, slot.name))
            for index in range(n):
                leaf = leaves[layout.order[index]]
                if isinstance(leaf, QuantizedSlot):
                    qmap = dynamic_map(slot.signed, leaf.codes.device)
                    value = dequantize_blockwise(leaf.codes, leaf.absmax, qmap,
                                                 stage.quant.block_size)
                else:
                    value = leaf.detach().clone()
                if stage.rule.name == "trace" and layout.lr_scaled_trace:
                    value = value / -_torch_lr(by_index[index], index, where)
                out[index][key] = value
    if {"scale_by_adam", "scale_by_rms", "scale_by_stddev", "scale_by_rss"} & {
            s.rule.name for s in layout.stages}:
        for entry in out.values():  # torch's Adam, RMSprop and Adagrad keep a step
            entry["step"] = torch.tensor(float(count))
    return {"state": out, "param_groups": [dict(g) for g in groups]}


def read_hparam(layout: PortLayout, rule: str, name: str, where: str):
    for stage in layout.stages:
        if stage.rule.name == rule:
            value = stage.rule.hparams[name]
            if callable(value):
                raise ValueError(f"{where}: {rule}'s {name} is a schedule: pass torch's "
                                 "param_groups")
            return float(value)
    return None


def _torch_group(layout: PortLayout, n: int, where: str) -> dict:
    """Torch hyperparameters read off the transform (see :func:`to_torch_state_dict`)."""
    names = [s.rule.name for s in layout.stages]
    lr = read_hparam(layout, "scale_by_learning_rate", "learning_rate", where)
    wd = read_hparam(layout, "add_decayed_weights", "weight_decay", where) or 0.0
    group: dict[str, Any] = {"lr": lr if lr is not None else 1.0, "weight_decay": wd}
    if "scale_by_adam" in names:
        decoupled = ("add_decayed_weights" in names
                     and names.index("add_decayed_weights") > names.index("scale_by_adam"))
        group.update(betas=(read_hparam(layout, "scale_by_adam", "b1", where),
                            read_hparam(layout, "scale_by_adam", "b2", where)),
                     eps=read_hparam(layout, "scale_by_adam", "eps", where),
                     amsgrad=False, maximize=False, decoupled_weight_decay=decoupled)
    elif "scale_by_rms" in names or "scale_by_stddev" in names:
        rms = "scale_by_rms" if "scale_by_rms" in names else "scale_by_stddev"
        group.update(alpha=read_hparam(layout, rms, "decay", where),
                     eps=read_hparam(layout, rms, "eps", where),
                     momentum=read_hparam(layout, "trace", "decay", where) or 0.0,
                     centered=rms == "scale_by_stddev")
    elif "scale_by_rss" in names:
        group.update(eps=read_hparam(layout, "scale_by_rss", "eps", where), lr_decay=0.0,
                     initial_accumulator_value=read_hparam(layout, "scale_by_rss",
                                                       "initial_accumulator_value", where))
    else:
        group.update(momentum=read_hparam(layout, "trace", "decay", where) or 0.0,
                     dampening=0.0, nesterov=False)
    group["params"] = list(range(n))
    return group
