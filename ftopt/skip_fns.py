"""optax's predicates for ``MultiSteps(should_skip_update_fn=...)``: skip a call whose
gradients are not all finite, or whose squared global norm is too large. Each returns
``(should_skip, info)``: 0-d tensors on the gradients' device, from torch ops only (no
host read)."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ftopt import tree as tree_lib
from ftopt.domains import check_finite

__all__ = ["ShouldSkipUpdateFunction", "skip_not_finite", "skip_large_updates"]


class ShouldSkipUpdateFunction(Protocol):
    """optax's type of a ``should_skip_update_fn``: ``(updates, gradient_step, params) ->
    (should_skip, info)``, ``should_skip`` a 0-d bool tensor."""

    def __call__(self, updates: Any, gradient_step: Any,
                 params: Any) -> tuple[torch.Tensor, Any]: ...


def _leaves(updates: Any) -> list[torch.Tensor]:
    return [u for u in tree_lib.leaves(updates) if u is not None]


def squared_norm(leaves: list[torch.Tensor]) -> torch.Tensor:
    """Σ u² over ``leaves`` (at least one) as a 0-d tensor on the first one's device, in
    float32 or the widest of their dtypes, from torch ops only (no host read)."""
    dtype = torch.float32
    for u in leaves:
        dtype = torch.promote_types(dtype, u.dtype)
    device = leaves[0].device
    return torch.stack([u.to(dtype).square().sum().to(device) for u in leaves]).sum()


def skip_not_finite(updates: Any, gradient_step: Any = None,
                    params: Any = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Skips where any gradient element is NaN or ±Inf, as optax.

    Returns: ``(should_skip, {"should_skip", "num_not_finite"})``: a 0-d bool and a 0-d
    int64 count of the non-finite elements.
    """
    del gradient_step, params
    leaves = _leaves(updates)
    if not leaves:
        count = torch.zeros((), dtype=torch.int64)
    else:
        count = torch.stack([(~torch.isfinite(u)).sum() for u in leaves]).sum()
    should_skip = count > 0
    return should_skip, {"should_skip": should_skip, "num_not_finite": count}


def skip_large_updates(updates: Any, gradient_step: Any, params: Any,
                       max_squared_norm: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Skips where the squared global norm of the gradients is not below
    ``max_squared_norm`` (NaN too), as optax. Bind the bound first:
    ``functools.partial(skip_large_updates, max_squared_norm=100.0)``.

    The squares are summed in float32 (at least: :func:`squared_norm`). Returns: ``(should_skip,
    {"should_skip", "norm_squared"})``.
    """
    del gradient_step, params
    max_squared_norm = check_finite("skip_large_updates", "max_squared_norm", max_squared_norm)
    leaves = _leaves(updates)
    norm_sq = squared_norm(leaves) if leaves else torch.zeros((), dtype=torch.float32)
    should_skip = ~(norm_sq < max_squared_norm)
    return should_skip, {"should_skip": should_skip, "norm_squared": norm_sq}
