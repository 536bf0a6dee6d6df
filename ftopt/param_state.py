"""An ftopt state tree seen per parameter, as ``torch.optim`` keeps state.

:class:`ftopt.Optimizer` holds one ftopt state tree per param group and shows it to torch
(``optimizer.state[p]``, ``state_dict()``) as one dict per parameter: ``{slot name:
tensor}``. The tensors are the tree's own leaves (a donated step updates them in place),
so the dicts stay current without copies.

Slot names come from where a slot lives in the state tree: the path of field names,
indices and keys, shortened to the shortest dotted suffix that is still unique in the
group (``adamw``: ``mu``, ``nu``; a ``named_chain``: ``adam.mu``). An 8-bit slot is two
entries, ``<slot>.codes`` (uint8) and ``<slot>.absmax`` (fp32); a slot holding a list
of tensors per param (SM3's accumulators, one per dim) is one entry each,
``<slot>.0``, ``<slot>.1``, ... A tensor shared by all params (a step count) is in every
param's dict, under ``step`` when it is the only one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ftopt import tree as tree_lib
from ftopt.rules import QuantizedSlot

__all__ = ["param_views", "plan_load"]


def _walk(node: Any, path: tuple, params: Any, spec, shared: list, per: list) -> None:
    if node is None:
        return
    if isinstance(node, torch.Tensor):
        shared.append((path, node))
        return
    if _shaped_like(node, params):
        per.append((path, spec.flatten_up_to(node)))
        return
    if hasattr(node, "_fields"):
        children = [(f, getattr(node, f)) for f in node._fields]
    elif isinstance(node, (tuple, list)):
        children = [(str(i), x) for i, x in enumerate(node)]
    elif isinstance(node, Mapping):
        children = [(str(k), x) for k, x in node.items()]
    else:
        where = ".".join(path) or "<root>"
        raise TypeError(f"state at {where}: a {type(node).__name__} cannot be kept in a "
                        "torch state_dict (expected tensors, tuples, lists and dicts)")
    for key, child in children:
        _walk(child, (*path, key), params, spec, shared, per)


def _shaped_like(node: Any, params: Any) -> bool:
    if type(node) is not type(params) or len(node) != len(params):
        return False
    return not isinstance(params, dict) or node.keys() == params.keys()


def _short_names(paths: list[tuple]) -> list[str]:
    """The shortest dotted suffix of each path that no other path ends with."""
    names = []
    for path in paths:
        for n in range(1, len(path) + 1):
            suffix = path[-n:]
            if n == len(path) or sum(p[-n:] == suffix for p in paths) == 1:
                names.append(".".join(suffix) if suffix else "<root>")
                break
        else:
            names.append("<root>")
    return names


def param_views(state: Any, params: Any) -> tuple[list[dict[str, torch.Tensor]], set[str]]:
    """One ``{slot name: tensor}`` dict per leaf of ``params`` (a flat list or dict of
    tensors, in optree order), holding ``state``'s own tensors (see the module doc); and
    the names of the tensors shared by all params."""
    spec = tree_lib.structure(params)
    shared: list = []
    per: list = []
    _walk(state, (), params, spec, shared, per)
    names = _short_names([p for p, _ in shared] + [p for p, _ in per])
    shared_names = ["step"] if len(shared) == 1 else names[:len(shared)]
    views: list[dict[str, torch.Tensor]] = [
        dict(zip(shared_names, [t for _, t in shared])) for _ in range(spec.num_leaves)]
    for name, (path, leaves) in zip(names[len(shared):], per):
        for i, leaf in enumerate(leaves):
            if leaf is None:
                continue
            if isinstance(leaf, QuantizedSlot):
                views[i][f"{name}.codes"] = leaf.codes
                views[i][f"{name}.absmax"] = leaf.absmax
            elif isinstance(leaf, torch.Tensor):
                views[i][name] = leaf
            elif isinstance(leaf, (list, tuple)) and all(
                    isinstance(x, torch.Tensor) for x in leaf):  # (SM3's: one per dim)
                for k, x in enumerate(leaf):
                    views[i][f"{name}.{k}"] = x
            else:
                raise TypeError(f"state at {'.'.join(path)}[{i}]: a {type(leaf).__name__} "
                                "cannot be kept in a torch state_dict")
    return views, set(shared_names)


def _check_value(where: str, dst: torch.Tensor, src: Any) -> None:
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"{where}: expected a tensor, got {type(src).__name__}")
    if src.shape != dst.shape:
        raise ValueError(f"{where}: shape {tuple(src.shape)} does not match the expected "
                         f"{tuple(dst.shape)}")
    if dst.is_floating_point():
        if not src.is_floating_point():
            raise TypeError(f"{where}: expected a floating-point tensor, got {src.dtype}")
    elif dst.dtype == torch.uint8:
        if src.dtype != torch.uint8:
            raise TypeError(f"{where}: expected uint8 codes of an 8-bit state, got "
                            f"{src.dtype}")
    elif dst.dtype == torch.bool:  # (apply_if_finite's last_finite)
        if src.dtype != torch.bool:
            raise TypeError(f"{where}: expected a bool flag, got {src.dtype}")
    else:  # a step count: torch keeps it as a float tensor
        if src.is_complex() or src.dtype == torch.bool:
            raise TypeError(f"{where}: expected a number, got {src.dtype}")
        value = src.detach().to("cpu", torch.float64)
        if not bool(torch.all(value == value.round())) or bool(torch.any(value < 0)):
            raise ValueError(f"{where}: a step count must be a whole number >= 0, got "
                             f"{value.tolist()}")


def plan_load(views: list[dict[str, torch.Tensor]], shared: set[str], saved: list[Any],
              indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``(destination, source)`` copies that load ``saved`` (the checkpoint's dict of
    each param, or ``None`` where it holds none) into ``views`` (from a fresh state; the
    ``shared`` names hold one tensor for all params), after checking every entry.
    ``indices``: the params' indices in the state_dict, for the errors. Nothing is
    written here."""
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    shared_seen: dict[str, tuple[int, torch.Tensor]] = {}
    for view, entry, index in zip(views, saved, indices):
        if entry is None:
            continue
        if not isinstance(entry, Mapping):
            raise TypeError(f"state of param {index}: expected a dict of tensors, got "
                            f"{type(entry).__name__}")
        missing = sorted(set(view) - set(entry))
        extra = sorted(set(entry) - set(view))
        if missing or extra:
            raise ValueError(
                f"state of param {index} does not match the optimizer's: missing "
                f"{missing}, unexpected {extra} (expected {sorted(view)}; a checkpoint of "
                "another optimizer, or of 8-bit states loaded into 32-bit ones?)")
        for name, dst in view.items():
            src = entry[name]
            _check_value(f"state {name!r} of param {index}", dst, src)
            if name in shared:  # one value for all params
                first = shared_seen.get(name)
                if first is None:
                    shared_seen[name] = (index, src)
                    copies.append((dst, src))
                elif not torch.equal(first[1].detach().cpu().double(),
                                     src.detach().cpu().double()):
                    raise ValueError(
                        f"state {name!r} of param {index} ({src.tolist()}) differs from "
                        f"param {first[0]}'s ({first[1].tolist()}): ftopt keeps one per "
                        "param group")
                continue
            copies.append((dst, src))
    return copies
