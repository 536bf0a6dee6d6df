"""Porting bitsandbytes optimizer state to ftopt and back.

:func:`from_bnb_state_dict` turns the ``state_dict()`` of a bitsandbytes Adam or AdamW
(``Adam``, ``AdamW``, ``Adam8bit``, ``AdamW8bit``, ``PagedAdamW8bit``, their 32-bit
variants, LAMB8bit, which is 8-bit Adam) into the state of ``ftopt.adamw`` (or any chain
with one ``scale_by_adam``), and :func:`to_bnb_state_dict` goes back, for the
bitsandbytes optimizer's ``load_state_dict``. bitsandbytes' Adam decays the weights
decoupled, so ``bnb.optim.Adam8bit(lr, betas, eps, weight_decay=wd)`` is
``ftopt.adamw(lr, b1, b2, eps, weight_decay=wd, state_bits=8)`` whatever its name.

Each param's bitsandbytes state (the quantization keys nested under
``"__bnb_optimizer_quant_state__"``, or flat) maps to ``scale_by_adam``'s slots:

==============================  ===================================================
ftopt (``scale_by_adam``)       bitsandbytes state of each param
==============================  ===================================================
``count``                       ``step`` (the same for every param)
``mu``: codes, absmax           ``state1`` (uint8), ``absmax1``, ``qmap1`` (signed)
``nu``: codes, absmax           ``state2`` (uint8), ``absmax2``, ``qmap2`` (unsigned)
``mu``, ``nu`` as fp32          ``state1``, ``state2`` as fp32 (params under
                                ``min_8bit_size``, or 32-bit optimizers)
==============================  ===================================================

Both libraries quantize blockwise with 256 elements per absmax and bitsandbytes'
dynamic maps, and both keep leaves under 4096 elements in fp32, so codes and absmax
map over byte for byte. Where the layouts differ (a 32-bit ftopt state, another
``block_size`` or ``min_size``, a param bitsandbytes keeps in 32 bits, a ``qmap`` that
is not the default map), the state is dequantized and quantized again, as a fresh
quantization would be.

What cannot be ported raises a ``ValueError`` naming the param index and the reason:

* per-param step counts that differ (ftopt keeps one count per transform: a param
  bitsandbytes stepped less often, or never while others were);
* ``amsgrad`` and ``maximize`` (bitsandbytes' 8-bit Adam refuses them; ftopt's Adam
  has neither);
* update-norm clipping (``max_unorm``: a ``unorm_vec`` state) and percentile clipping
  (``gnorm_vec``, from bitsandbytes before 0.50): ftopt clips with transforms of its
  own (``clip_by_param_norm_ratio``, ``clip_by_global_norm``) that keep no such state;
* non-blockwise ("static") 8-bit states (``max1``/``new_max1``: one scale per tensor);
* AdEMAMix, Lion, SGD, RMSprop and Adagrad states, and any key ftopt has no place for.

``skip_zeros`` and ``min_8bit_size`` are bitsandbytes arguments that its state_dict
does not record: choose them on the ftopt transform. ``params`` is matched to the
bitsandbytes param indices as in :func:`ftopt.from_torch_state_dict` (the order given).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optree
import torch

from ftopt.base import GradientTransformation
from ftopt.quant import dequantize_blockwise, dynamic_map, quantize_blockwise
from ftopt.rules import QuantizedSlot
from ftopt.stages import state_at, with_state_at
from ftopt.torch_port import (
    PortLayout,
    check_group,
    common_step,
    groups_by_index,
    read_hparam,
)

__all__ = ["from_bnb_state_dict", "to_bnb_state_dict"]

#: bitsandbytes nests its quantization keys under this key in ``state_dict()``.
WRAPPED = "__bnb_optimizer_quant_state__"
#: bitsandbytes' block size for 8-bit blockwise optimizer states.
BNB_BLOCK = 256
# ftopt slot -> (bitsandbytes state, absmax, qmap), per stage with per-element state.
_SLOTS = {"scale_by_adam": {"mu": ("state1", "absmax1", "qmap1"),
                            "nu": ("state2", "absmax2", "qmap2")}}
# bitsandbytes state keys without an ftopt place, and why.
_UNPORTABLE_KEYS = {
    "unorm_vec": "update-norm clipping (max_unorm) keeps state ftopt has no place for",
    "gnorm_vec": "percentile clipping keeps a gradient-norm history ftopt has no place for",
    "max1": "non-blockwise 8-bit state (one scale per tensor) is not ftopt's format",
    "max2": "non-blockwise 8-bit state (one scale per tensor) is not ftopt's format",
    "new_max1": "non-blockwise 8-bit state (one scale per tensor) is not ftopt's format",
    "new_max2": "non-blockwise 8-bit state (one scale per tensor) is not ftopt's format",
}


def _entry(raw: Any, index: int, where: str) -> dict:
    """One param's bitsandbytes state, the nested quantization keys lifted out."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: param {index}: expected a dict of state, got "
                         f"{type(raw).__name__}")
    entry = {k: v for k, v in raw.items() if k != WRAPPED}
    entry.update(raw.get(WRAPPED) or {})
    used = {"step"} | {key for keys in _SLOTS["scale_by_adam"].values() for key in keys}
    for key in sorted(set(entry) - used, key=str):
        reason = _UNPORTABLE_KEYS.get(key, "the transform has no state it maps to")
        raise ValueError(f"{where}: param {index}: bitsandbytes state {key!r} cannot be "
                         f"ported ({reason})")
    return entry


def _check_bnb_group(group: dict, index: int, where: str) -> None:
    check_group(group, index, where)
    betas = group.get("betas", ())
    if len(betas) > 2 or group.get("t_alpha") is not None or group.get("t_beta3") is not None:
        raise ValueError(f"{where}: param {index}: an AdEMAMix group (betas {betas!r}) "
                         "cannot be ported to Adam's state")


def from_bnb_state_dict(bnb_sd: dict, tx: GradientTransformation, params: Any) -> Any:
    """The ftopt state of ``tx`` over ``params`` equal to a bitsandbytes Adam's state.

    Args:
        bnb_sd: ``bnb_optimizer.state_dict()`` of a bitsandbytes Adam or AdamW, 8-bit
            blockwise or 32-bit (see the module docstring).
        tx: the ftopt transform to continue with: a chain with one ``scale_by_adam``,
            e.g. ``ftopt.adamw(lr, b1, b2, eps, weight_decay=wd, state_bits=8)``.
        params: the params the state is for (the bitsandbytes optimizer's, in its order).

    Returns:
        A state like ``tx.init(params)``, on the params' devices; 8-bit leaves hold
        bitsandbytes' codes and absmax unchanged.

    Raises:
        ValueError: what cannot be ported, naming the param index and the reason.
    """
    where = "from_bnb_state_dict"
    if not isinstance(bnb_sd, Mapping) or {"state", "param_groups"} - set(bnb_sd):
        raise ValueError(f"{where}: expected a bitsandbytes optimizer state_dict (a dict "
                         "with 'state' and 'param_groups')")
    layout = PortLayout(tx, params, bnb_sd["param_groups"], where, _SLOTS, "bitsandbytes")
    n = len(layout.leaves)
    groups = groups_by_index(bnb_sd["param_groups"], n, where)
    entries = {}
    for index in range(n):
        _check_bnb_group(groups[index], index, where)
        entries[layout.order[index]] = (index, _entry(bnb_sd["state"].get(index), index,
                                                      where))
    _adam_stage(layout, where)
    step = common_step(layout, entries, where)
    with torch.no_grad():
        state = tx.init(params)
        for stage, path in zip(layout.stages, layout.paths):
            state = with_state_at(state, path, _port_stage(stage, state_at(state, path),
                                                           layout, entries, step, where))
    return state


def _port_stage(stage, st, layout: PortLayout, entries: dict, step, where: str):
    values = {}
    if stage.rule.counted:
        values["count"] = torch.full_like(st.count, step)
    for slot in stage.rule.slots:
        leaves = layout.spec.flatten_up_to(getattr(st, slot.name))
        out = []
        for leaf_index, (leaf, p) in enumerate(zip(leaves, layout.leaves)):
            index, entry = entries[leaf_index]
            keys = _SLOTS[stage.rule.name][slot.name]
            if entry.get(keys[0]) is None:
                held = [k[0] for k in _SLOTS[stage.rule.name].values() if k[0] in entry]
                if held:
                    raise ValueError(f"{where}: param {index}: bitsandbytes state holds "
                                     f"{held} but no {keys[0]!r}: a one-state optimizer "
                                     "(Lion, SGD, RMSprop, Adagrad), not Adam")
                out.append(leaf)  # never stepped in bitsandbytes: the initial state
                continue
            block = stage.quant.block_size if stage.quant is not None else None
            out.append(_port_leaf(entry, keys, leaf, p, slot.signed, block, index, where))
        values[slot.name] = optree.tree_unflatten(layout.spec, out)
    return type(st)(**values)


def _port_leaf(entry: dict, keys: tuple, leaf, p: torch.Tensor, signed: bool,
               block: int | None, index: int, where: str):
    name, absmax_name, qmap_name = keys
    src = entry[name]
    if not isinstance(src, torch.Tensor) or src.shape != p.shape:
        got = tuple(src.shape) if isinstance(src, torch.Tensor) else type(src).__name__
        raise ValueError(f"{where}: param {index}: bitsandbytes state {name!r} is {got}, "
                         f"expected shape {tuple(p.shape)} (an Adam state)")
    ours = dynamic_map(signed, p.device)
    if src.dtype == torch.uint8:
        absmax, qmap = entry.get(absmax_name), entry.get(qmap_name)
        blocks = -(-src.numel() // BNB_BLOCK)
        if not isinstance(absmax, torch.Tensor) or absmax.numel() != blocks:
            raise ValueError(f"{where}: param {index}: 8-bit state {name!r} needs "
                             f"{absmax_name!r} with {blocks} blocks of {BNB_BLOCK}")
        if not isinstance(qmap, torch.Tensor) or qmap.numel() != 256:
            raise ValueError(f"{where}: param {index}: 8-bit state {name!r} needs "
                             f"{qmap_name!r}, a 256-entry map")
        codes = src.detach().to(p.device)
        absmax = absmax.detach().to(device=p.device, dtype=torch.float32)
        qmap = qmap.detach().to(device=p.device, dtype=torch.float32)
        same = isinstance(leaf, QuantizedSlot) and block == BNB_BLOCK and torch.equal(qmap, ours)
        if same:  # the same format: the bytes map over
            return QuantizedSlot(codes.clone(), absmax.clone().view(leaf.absmax.shape))
        value = dequantize_blockwise(codes, absmax.reshape(-1), qmap, BNB_BLOCK)
    elif src.is_floating_point():
        value = src.detach().to(device=p.device, dtype=torch.float32)
    else:
        raise ValueError(f"{where}: param {index}: bitsandbytes state {name!r} has dtype "
                         f"{src.dtype}, expected uint8 or a float dtype")
    if isinstance(leaf, QuantizedSlot):
        codes, absmax = quantize_blockwise(value, ours, block)
        return QuantizedSlot(codes, absmax.view(leaf.absmax.shape))
    return value.to(leaf.dtype).clone()


def to_bnb_state_dict(state: Any, tx: GradientTransformation, params: Any, *,
                      param_groups: list[dict] | None = None) -> dict:
    """A bitsandbytes optimizer state_dict holding ``state`` (the inverse of
    :func:`from_bnb_state_dict`), for ``bnb_optimizer.load_state_dict``.

    Args:
        state: the state of ``tx`` over ``params``.
        tx: its transform, a chain with one ``scale_by_adam``.
        params: the params, in the bitsandbytes optimizer's order.
        param_groups: the param groups to write (``bnb_opt.state_dict()["param_groups"]``;
            bitsandbytes' ``load_state_dict`` takes the hyperparameters from here).
            Default: one group with the hyperparameters read off ``tx`` (fixed numbers
            only; a schedule needs ``param_groups``).

    Returns:
        ``{"state": {index: {"step": int, "__bnb_optimizer_quant_state__": {...}}},
        "param_groups": [...]}``: 8-bit leaves with block size 256 as their codes and
        absmax unchanged; other 8-bit leaves quantized again in blocks of 256; fp32
        leaves as fp32 ``state1``/``state2``.
    """
    where = "to_bnb_state_dict"
    layout = PortLayout(tx, params, param_groups, where, _SLOTS, "bitsandbytes")
    n = len(layout.leaves)
    groups = param_groups if param_groups is not None else [_bnb_group(layout, n, where)]
    groups_by_index(groups, n, where)
    stage, path = _adam_stage(layout, where)
    st = state_at(state, path)
    out: dict[int, dict] = {i: {"step": int(st.count)} for i in range(n)}
    for slot in stage.rule.slots:
        name, absmax_name, qmap_name = _SLOTS["scale_by_adam"][slot.name]
        leaves = layout.spec.flatten_up_to(getattr(st, slot.name))
        for index in range(n):
            leaf = leaves[layout.order[index]]
            wrapped = out[index].setdefault(WRAPPED, {})
            if not isinstance(leaf, QuantizedSlot):
                wrapped[name] = leaf.detach().to(torch.float32).clone()
                continue
            qmap = dynamic_map(slot.signed, leaf.codes.device)
            codes, absmax = leaf.codes, leaf.absmax.reshape(-1)
            if stage.quant.block_size != BNB_BLOCK:
                value = dequantize_blockwise(codes, absmax, qmap, stage.quant.block_size)
                codes, absmax = quantize_blockwise(value, qmap, BNB_BLOCK)
            wrapped.update({name: codes.detach().clone(), absmax_name: absmax.detach().clone(),
                            qmap_name: qmap.clone()})
    return {"state": out, "param_groups": [dict(g) for g in groups]}


def _adam_stage(layout: PortLayout, where: str) -> tuple:
    """The one ``scale_by_adam`` stage of the transform, and its state path."""
    adam = [(s, path) for s, path in zip(layout.stages, layout.paths)
            if s.rule.name == "scale_by_adam"]
    if len(adam) != 1:
        raise ValueError(f"{where}: tx must hold one scale_by_adam (bitsandbytes' Adam), "
                         f"found {len(adam)}")
    return adam[0]


def _bnb_group(layout: PortLayout, n: int, where: str) -> dict[str, Any]:
    """bitsandbytes hyperparameters read off the transform (see :func:`to_bnb_state_dict`)."""
    names = [s.rule.name for s in layout.stages]
    if ("add_decayed_weights" in names and "scale_by_adam" in names
            and names.index("add_decayed_weights") < names.index("scale_by_adam")):
        raise ValueError(f"{where}: the weight decay comes before scale_by_adam (L2); "
                         "bitsandbytes' Adam decays decoupled, as ftopt.adamw")
    lr = read_hparam(layout, "scale_by_learning_rate", "learning_rate", where)
    return {"lr": lr if lr is not None else 1.0,
            "betas": (read_hparam(layout, "scale_by_adam", "b1", where),
                      read_hparam(layout, "scale_by_adam", "b2", where)),
            "eps": read_hparam(layout, "scale_by_adam", "eps", where),
            "weight_decay": read_hparam(layout, "add_decayed_weights", "weight_decay",
                                        where) or 0.0,
            "alpha": 0.0, "t_alpha": None, "t_beta3": None, "params": list(range(n))}
