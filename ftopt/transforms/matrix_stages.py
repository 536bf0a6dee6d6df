"""Matrix stages (see :mod:`ftopt.matrix`): ``scale_by_row_norm``."""

from __future__ import annotations

import torch

from ftopt.base import GradientTransformation
from ftopt.domains import NONNEG, check_finite
from ftopt.matrix import matrix_transform


def scale_by_row_norm(eps: float = 1e-8) -> GradientTransformation:
    """Each row of a 2-D leaf over its L2 norm: ``u[i, :] ← u[i, :] / (‖u[i, :]‖ + eps)``.

    Leaves that are not 2-D pass through. Equal-shaped leaves are computed in one batched
    call; in a chain the elementwise stages around it stay fused (:mod:`ftopt.matrix`).
    On DTensor leaves, rows must be whole on each rank: ``Shard(0)`` (FSDP2) or
    ``Replicate``; another split raises, naming the leaf.

    Args:
        eps: added to each row's norm, >= 0 (default: 1e-8). A zero row stays zero.
    """
    eps = check_finite("scale_by_row_norm", "eps", eps, NONNEG)

    def fn(batch: torch.Tensor) -> torch.Tensor:
        denom = torch.linalg.vector_norm(batch, dim=-1, keepdim=True) + eps
        return batch / torch.where(denom == 0, 1.0, denom)  # a zero row (eps 0) stays 0

    return matrix_transform("scale_by_row_norm", fn, reads="rows")
