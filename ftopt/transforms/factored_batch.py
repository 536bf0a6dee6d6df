"""Adafactor's factored second moments, batched over equal-shaped leaves, on whole leaves
or on shards (see :mod:`ftopt.transforms.factored`).

With ``g² = u² + epsilon`` and ``(d1, d0)`` the factored dims: ``v_row`` is a mean of g²
over ``d0``, ``v_col`` one over ``d1``, and the update divides by ``v_row`` over its own
mean over ``d1``. Each mean is a sum over the local shard, then (a sum over a dim the
shards split) a sum over the ranks, then a division by the full tensor's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ftopt import dispatch, shards

__all__ = ["FactoredLayout", "FactoredBatch", "sum_over_ranks", "stat_zeros", "mix"]


class FactoredLayout(NamedTuple):
    """A factored leaf: ``dims = (d1, d0)`` of its full shape, ``n1`` and ``n0`` their
    full sizes, and ``split``: on shards, 0 or 1 where the shards split ``d0`` or ``d1``
    (the statistics reduced over it are summed over the ranks), else ``None`` (every
    statistic is the rank's own)."""

    dims: tuple[int, int]
    split: int | None
    n1: int
    n0: int


class FactoredBatch:
    """Equal-shaped factored leaves (leaf indices ``idx``, stacked: the batch dim first).

    ``row_sum`` = Σ_{d0} g², ``col_sum`` = Σ_{d1} g² and ``row_total`` = Σ_{d1} of the
    new ``v_row`` are sums over the local shard; :meth:`partials` are those that must be
    summed over the ranks, :meth:`set_sums` takes them back, :meth:`finish` divides by
    the full sizes."""

    def __init__(self, idx: list[int], g: torch.Tensor, v_row: torch.Tensor,
                 v_col: torch.Tensor, beta: Any, layout: FactoredLayout, epsilon: float):
        self.idx, self.g, self.v_row, self.v_col = idx, g, v_row, v_col
        self.beta, self.layout = beta, layout
        d1, d0 = layout.dims
        self.d1, self.d0 = d1 + 1, d0 + 1
        self.row_d1 = d1 + 1 - (d1 > d0)  # where d1 is in v_row's shape
        g2 = g * g + epsilon
        self.row_sum, self.col_sum = g2.sum(dim=self.d0), g2.sum(dim=self.d1)
        if layout.split != 0:  # the row sums are whole here: the row statistic too
            self._rows()

    def _rows(self) -> None:
        self.new_row = mix(self.v_row, self.row_sum / self.layout.n0, self.beta)
        self.row_total = self.new_row.sum(dim=self.row_d1, keepdim=True)

    def partials(self) -> list[torch.Tensor]:
        split = self.layout.split
        return ([] if split is None else [self.row_sum] if split == 0
                else [self.col_sum, self.row_total])

    def set_sums(self, sums: list[torch.Tensor]) -> None:
        if self.layout.split == 0:
            self.row_sum = sums[0]
            self._rows()
        else:
            self.col_sum, self.row_total = sums

    def finish(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The updates and the new ``v_row`` and ``v_col``."""
        n1 = self.layout.n1
        new_col = mix(self.v_col, self.col_sum / n1, self.beta)
        row_factor = (self.new_row / (self.row_total / n1)).rsqrt()
        update = self.g * row_factor.unsqueeze(self.d0) * new_col.rsqrt().unsqueeze(self.d1)
        return update, self.new_row, new_col


def sum_over_ranks(batches: list[FactoredBatch], paths: Sequence[str]) -> None:
    """The partial sums of every batch, summed over the ranks in one buffer (leaves in
    their tree order, the same on every rank; nothing where no leaf is split)."""
    per_leaf: dict[int, list[torch.Tensor]] = {}
    for batch in batches:
        parts = batch.partials()
        for j, i in enumerate(batch.idx if parts else ()):
            per_leaf[i] = [part[j].reshape(-1) for part in parts]
    if not per_leaf:
        return
    order = sorted(per_leaf)
    flat = [t for i in order for t in per_leaf[i]]
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in flat) else torch.float32
    total = shards.reduce_sums(torch.cat([t.to(dtype) for t in flat]),
                               [paths[i] for i in order],
                               [sum(t.numel() for t in per_leaf[i]) for i in order])
    pieces = iter(total.split([t.numel() for t in flat]))
    summed = {i: [next(pieces) for _ in per_leaf[i]] for i in order}
    for batch in batches:
        parts = batch.partials()
        if parts:
            batch.set_sums([torch.stack([summed[i][k] for i in batch.idx]).view_as(part)
                            .to(part.dtype) for k, part in enumerate(parts)])


def stat_zeros(p: torch.Tensor, dim: int, dtype: torch.dtype, split: frozenset[int]
               ) -> torch.Tensor:
    """The zero statistic of ``p`` reduced over ``dim``; on a split DTensor, a DTensor
    laid out to the shards (:func:`ftopt.distributed.reduced_zeros`)."""
    if split:
        return dispatch.backend("distributed").reduced_zeros(p, dim, dtype)
    shape = tuple(n for k, n in enumerate(p.shape) if k != dim)
    return torch.zeros(shape, dtype=dtype, device=p.device)


def mix(old: torch.Tensor, new: torch.Tensor, beta: Any) -> torch.Tensor:
    """beta·old + (1 − beta)·new, beta a float or a 0-d tensor (1 − beta taken in beta's
    dtype, float64 on the device as on the host, then rounded: the same bits either way)."""
    rest = 1.0 - beta
    if isinstance(beta, torch.Tensor):
        beta, rest = beta.to(old.dtype), rest.to(old.dtype)
    return beta * old + rest * new
