"""A state as a flat ``{param name: {slot: tensor}}`` dict, for Distributed Checkpoint.

``torch.distributed.checkpoint`` (DCP) saves and loads dicts of tensors and DTensors:
each rank writes its shards, and a load reads into the tensors of the dict it is given,
in place, from whatever sharding the checkpoint was written with. An ftopt state is a
tree of NamedTuples; :func:`state_dict` shows it the way torch's
``get_optimizer_state_dict`` shows a ``torch.optim`` state: one dict per param, keyed by
the param's name (its path in ``params``, dot-joined: ``dict(model.named_parameters())``
keeps the module's names), holding the state's own tensors (DTensors where the params
are), with the step count (one replicated tensor) in every param's dict. So::

    sd = ftopt.state_dict(state, tx, params)
    dcp.save(sd, checkpoint_id=path)
    ...
    state = tx.init(params)                         # on any number of ranks
    sd = ftopt.state_dict(state, tx, params)
    dcp.load(sd, checkpoint_id=path)                # writes into state's tensors
    state = ftopt.load_state_dict(state, tx, params, sd)

8-bit slots are two entries, ``<slot>.codes`` and ``<slot>.absmax``; the absmax is shown
in the shape :func:`ftopt.quant.absmax_layout` gives (``(rows, blocks per row)`` where
rows are whole blocks), the same with and without sharding, so a checkpoint written on
two ranks loads on one, and the other way round.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optree
import torch

from ftopt.base import GradientTransformation, check_transform
from ftopt.param_state import param_views
from ftopt.quant import absmax_layout
from ftopt.shards import is_dtensor

__all__ = ["state_dict", "load_state_dict"]


def _names(params: Any) -> list[str]:
    paths = optree.tree_paths(params, none_is_leaf=False, namespace="ftopt")
    return [".".join(str(k) for k in path) or "<root>" for path in paths]


def _entries(state: Any, params: Any) -> dict[str, dict[str, torch.Tensor]]:
    views, _ = param_views(state, params)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, view in zip(_names(params), views):
        entry = {}
        for slot, t in view.items():
            if slot.endswith(".absmax") and not is_dtensor(t):
                codes = view[slot[:-len("absmax")] + "codes"]
                t = t.view(_absmax_shape(codes.shape, t.numel()))
            entry[slot] = t
        out[name] = entry
    return out


def _absmax_shape(shape: torch.Size, blocks: int) -> tuple[int, ...]:
    """:func:`absmax_layout` of a leaf of ``shape`` with ``blocks`` absmax entries."""
    rows = shape[0] if len(shape) >= 2 else 0
    if rows and blocks % rows == 0 and blocks:
        row = shape.numel() // rows
        per_row = blocks // rows
        block = row // per_row if row % per_row == 0 else 0
        if block and block & (block - 1) == 0:  # (block sizes are powers of two)
            layout = absmax_layout(shape, block)
            if layout == (rows, per_row):
                return layout
    return (blocks,)


def state_dict(state: Any, tx: GradientTransformation, params: Any) -> dict[str, Any]:
    """``{param name: {slot: tensor}}`` over the state's own tensors (see the module doc).

    Args:
        state: the state of ``tx`` for ``params``.
        tx: the transform (checked to be one).
        params: the params tree the state was made for (a dict of named params, as
            ``dict(model.named_parameters())``, gives the module's names).

    Returns:
        A dict DCP can save, or load into (in place, into ``state``).
    """
    check_transform(tx, "state_dict: argument tx")
    return _entries(state, params)


def load_state_dict(state: Any, tx: GradientTransformation, params: Any,
                    saved: Mapping[str, Any]) -> Any:
    """Copy ``saved`` (a :func:`state_dict`, e.g. filled by ``dcp.load``) into ``state``
    and return it. Every entry is checked (names, slots, shapes) before anything is
    written; entries that already are the state's tensors (after ``dcp.load`` into
    ``state_dict(state, ...)``) are left as they are."""
    check_transform(tx, "load_state_dict: argument tx")
    expected = _entries(state, params)
    if not isinstance(saved, Mapping):
        raise TypeError(f"load_state_dict: expected a dict, got {type(saved).__name__}")
    missing = sorted(set(expected) - set(saved))
    extra = sorted(set(saved) - set(expected))
    if missing or extra:
        raise ValueError(f"load_state_dict: the params do not match: missing {missing}, "
                         f"unexpected {extra}")
    copies = []
    for name, entry in expected.items():
        given = saved[name]
        if not isinstance(given, Mapping) or set(given) != set(entry):
            got = sorted(given) if isinstance(given, Mapping) else type(given).__name__
            raise ValueError(f"load_state_dict: state of {name!r}: expected slots "
                             f"{sorted(entry)}, got {got}")
        for slot, dst in entry.items():
            src = given[slot]
            if not isinstance(src, torch.Tensor):
                raise TypeError(f"load_state_dict: {slot!r} of {name!r}: expected a "
                                f"tensor, got {type(src).__name__}")
            if src.shape != dst.shape:
                raise ValueError(f"load_state_dict: {slot!r} of {name!r}: shape "
                                 f"{tuple(src.shape)}, expected {tuple(dst.shape)}")
            if src.dtype != dst.dtype and not (src.is_floating_point()
                                               and dst.is_floating_point()):
                raise TypeError(f"load_state_dict: {slot!r} of {name!r}: dtype "
                                f"{src.dtype}, expected {dst.dtype}")
            if src is not dst:
                copies.append((dst, src))
    with torch.no_grad():
        for dst, src in copies:
            dst.copy_(src)
    return state

