"""optax's tree utilities for target copies of parameters and norms: ``incremental_update``
(Polyak averaging of a target network), ``periodic_update`` (a target refreshed every
``update_period`` steps) and ``global_norm``. Pure functions over pytrees: new trees out,
the inputs untouched; a step count given as a 0-d tensor is decided on its device (no host
read)."""

from __future__ import annotations

from typing import Any

import torch

from ftopt import tree as tree_lib
from ftopt.finite import where_leaf
from ftopt.skip_fns import squared_norm

__all__ = ["incremental_update", "periodic_update", "global_norm"]


def _pairs(what: str, new: Any, old: Any) -> tuple[Any, list[str], list, list]:
    """(structure, paths, new leaves, old leaves) of two trees of one structure whose
    tensors match in shape (``None`` is structure, not a leaf); errors name the path."""
    paths, new_flat, spec = tree_lib.flatten_with_paths(new)
    old_flat = tree_lib.flatten_like(spec, old, "old_tensors", paths, "new_tensors")
    for path, a, b in zip(paths, new_flat, old_flat):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            raise TypeError(f"{what} at {path}: expected tensors in both trees, got "
                            f"{type(a).__name__} and {type(b).__name__}")
        if a.shape != b.shape:
            raise ValueError(f"{what} at {path}: new_tensors has shape {tuple(a.shape)}, "
                             f"old_tensors {tuple(b.shape)}")
    return spec, paths, new_flat, old_flat


def incremental_update(new_tensors: Any, old_tensors: Any,
                       step_size: float | torch.Tensor) -> Any:
    """Polyak averaging, as optax: ``step_size·new + (1 − step_size)·old`` leaf by leaf.

    Floating leaves are computed in fp32 (or the wider of the two dtypes) and returned in
    the old leaf's dtype (the target's: a bf16 target of an fp32 model stays bf16).
    Leaves that are not floating point (a BatchNorm's ``num_batches_tracked``) take the
    new value, as ``torch.optim.swa_utils`` and timm's model EMA do.

    Args:
        new_tensors: the latest values (the online network's parameters).
        old_tensors: the running average (the target's), of the same structure and shapes.
        step_size: the weight of the new values, a finite float or a 0-d tensor.
    """
    if isinstance(step_size, torch.Tensor):
        if step_size.ndim != 0 or not step_size.is_floating_point():
            raise ValueError("incremental_update: step_size must be a float or a 0-d "
                             f"floating tensor, got shape {tuple(step_size.shape)} "
                             f"{step_size.dtype}")
    elif not isinstance(step_size, (int, float)) or not torch.isfinite(
            torch.tensor(float(step_size))):
        raise ValueError(f"incremental_update: step_size must be a finite float, got "
                         f"{step_size!r}")
    spec, _, new_flat, old_flat = _pairs("incremental_update", new_tensors, old_tensors)
    out = []
    for a, b in zip(new_flat, old_flat):
        if not (a.is_floating_point() and b.is_floating_point()):
            out.append(a.to(b.device, b.dtype, copy=True))
            continue
        dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
        w = (step_size.to(b.device, dtype) if isinstance(step_size, torch.Tensor)
             else step_size)
        mixed = a.to(b.device, dtype) * w + b.to(dtype) * (1.0 - w)
        out.append(mixed.to(b.dtype))
    return tree_lib.unflatten(spec, out)


def periodic_update(new_tensors: Any, old_tensors: Any, steps: int | torch.Tensor,
                    update_period: int) -> Any:
    """``new_tensors`` where ``steps % update_period == 0``, else ``old_tensors``, as
    optax (a target network refreshed every ``update_period`` steps).

    With ``steps`` a Python int the choice is made on the host and one of the two trees
    is returned as it is; with a 0-d integer tensor it is made on its device, leaf by leaf
    (``torch.where``, bit-exact either way), and new tensors are returned.

    Args:
        new_tensors: the latest values.
        old_tensors: the current target, of the same structure and shapes.
        steps: the step count, an int or a 0-d integer tensor.
        update_period: how often to refresh, an int >= 1.

    The leaves of the two trees must match in shape and dtype.
    """
    if isinstance(update_period, bool) or not isinstance(update_period, int) \
            or update_period < 1:
        raise ValueError(f"periodic_update: update_period must be an int >= 1, got "
                         f"{update_period!r}")
    spec, paths, new_flat, old_flat = _pairs("periodic_update", new_tensors, old_tensors)
    for path, a, b in zip(paths, new_flat, old_flat):
        if a.dtype != b.dtype:
            raise TypeError(f"periodic_update at {path}: new_tensors is {a.dtype}, "
                            f"old_tensors {b.dtype}; expected the same dtype")
    if isinstance(steps, torch.Tensor):
        if steps.ndim != 0 or steps.is_floating_point() or steps.dtype == torch.bool:
            raise ValueError("periodic_update: steps must be an int or a 0-d integer tensor, "
                             f"got shape {tuple(steps.shape)} {steps.dtype}")
        flag = torch.remainder(steps, update_period) == 0
        return tree_lib.unflatten(spec, [where_leaf(flag, a, b)
                                         for a, b in zip(new_flat, old_flat)])
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise ValueError(f"periodic_update: steps must be an int or a 0-d integer tensor, "
                         f"got {type(steps).__name__}")
    return new_tensors if steps % update_period == 0 else old_tensors


def global_norm(updates: Any) -> torch.Tensor:
    """The L2 norm of every element of every leaf together, as optax: a 0-d tensor on the
    first leaf's device, in fp32 or the widest leaf dtype (no host read; a tree without
    tensors has norm 0)."""
    paths, leaves, _ = tree_lib.flatten_with_paths(updates)
    for path, u in zip(paths, leaves):
        if not (isinstance(u, torch.Tensor) and u.is_floating_point()):
            raise TypeError(f"global_norm at {path}: expected a floating tensor, got "
                            f"{getattr(u, 'dtype', type(u).__name__)}")
    if not leaves:
        return torch.zeros(())
    return squared_norm(leaves).sqrt()
