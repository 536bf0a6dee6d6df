"""``flatten``: a transform run on all leaves concatenated into one vector (optax's).

optax offers it to cut the overhead of many small arrays; ftopt's fused step already runs
every leaf of a group in one launch, so here it is for what it computes: a transform
whose math reads a whole leaf (a per-leaf norm, a trust ratio, ``normalize``) then reads
the whole tree as one. Its inner transform's state is over the flat vector (one leaf of
the total size, in the leaves' promoted dtype). It runs eagerly; the inner transform's
own update may still fuse over the flat vector on a GPU.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from ftopt import tree as tree_lib
from ftopt.base import GradientTransformation, check_transform, register_owner
from ftopt.program import skip_updates

__all__ = ["flatten"]


def _concat(what: str, tree: Any, spec: Any, paths: list[str], like: list) -> torch.Tensor:
    """The leaves of ``tree`` (laid out as ``spec``) where ``like`` has a tensor, each
    flattened, concatenated in leaf order."""
    flat = tree_lib.flatten_like(spec, tree, what, paths)
    parts = []
    for path, x, u in zip(paths, flat, like):
        if u is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what} at {path}: expected a tensor, got {type(x).__name__}")
        if x.shape != u.shape:
            raise ValueError(f"{what} at {path}: shape {tuple(x.shape)} does not match the "
                             f"update's {tuple(u.shape)}")
        if x.layout != torch.strided:
            raise TypeError(f"{what} at {path}: expected a dense tensor, got {x.layout}")
        parts.append(x.reshape(-1))
    if not parts:
        return torch.zeros(0)
    device = parts[0].device
    for path, x in zip([p for p, u in zip(paths, like) if u is not None], parts):
        if x.device != device:
            raise ValueError(f"flatten: {what} at {path} is on {x.device}, the first leaf "
                             f"on {device}: the leaves are concatenated into one tensor")
    return torch.cat(parts)


class Flatten:
    """The object behind :func:`flatten` (see :mod:`ftopt.layouts`)."""

    unfused_reason = ("flatten runs eagerly: its inner transform sees the leaves "
                      "concatenated into one vector")
    mask_aware = True  # (the chain's zero mask, flattened as the updates are)

    def __init__(self, inner: GradientTransformation):
        check_transform(inner, "flatten: inner")
        self.inner = inner
        register_owner(self)

    @staticmethod
    def _layout(tree: Any) -> tuple:
        spec = optree.tree_structure(tree, none_is_leaf=True, namespace="ftopt")
        paths = [tree_lib.path_str(p) for p in optree.tree_paths(
            tree, none_is_leaf=True, namespace="ftopt")]
        return spec, paths, spec.flatten_up_to(tree)

    def init(self, params: Any) -> Any:
        spec, paths, flat = self._layout(params)
        return self.inner.init(_concat("params", params, spec, paths, flat))

    def update(self, updates, state, params=None, **extra):
        spec, paths, u_flat = self._layout(updates)
        for path, u in zip(paths, u_flat):
            if u is not None and not (isinstance(u, torch.Tensor) and u.is_floating_point()):
                got = u.dtype if isinstance(u, torch.Tensor) else type(u).__name__
                raise TypeError(f"update at {path}: expected a floating-point tensor or "
                                f"None, got {got}")
        flat_u = _concat("updates", updates, spec, paths, u_flat)
        flat_p = (None if params is None
                  else _concat("params", params, spec, paths, u_flat))
        mask = extra.get("zero_mask")
        if mask is not None:  # inside a skip_zeros chain
            mask = _concat("zero_mask", mask, spec, paths, u_flat)
            extra = {**extra, "zero_mask": mask}
        out, state = self.inner.update(flat_u, state, flat_p, **extra)
        if mask is not None:
            out = skip_updates(out, mask)
        pieces, start = [], 0
        for u in u_flat:
            if u is None:
                pieces.append(None)
                continue
            pieces.append(out[start:start + u.numel()].view(u.shape))
            start += u.numel()
        return spec.unflatten(pieces), state


def flatten(inner: GradientTransformation) -> GradientTransformation:
    """Runs ``inner`` on the updates (and params, and the ``skip_zeros`` mask) of all
    leaves concatenated into one vector, and splits its updates back into the leaves'
    shapes (optax's ``flatten``): a whole-leaf computation inside ``inner`` (a norm, a
    trust ratio) then spans the whole tree. ``inner``'s state is over that vector. Leaves
    of several dtypes are concatenated in their promoted dtype; all must be on one device.
    """
    obj = Flatten(inner)
    return GradientTransformation(obj.init, obj.update)
