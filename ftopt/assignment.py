"""The linear assignment problem (optax's ``optax.assignment``): the Hungarian algorithm.

Given an ``n × m`` cost matrix, :func:`hungarian_algorithm` picks ``min(n, m)`` pairs
(row, column), no row and no column twice, of least total cost: shortest augmenting
paths with dual variables (Crouse 2016, the algorithm behind SciPy's
``linear_sum_assignment``), cubic time, run on the host in float64. As optax's, it returns
``(i, j)``: the row indices ascending and their columns, so the cost is
``cost_matrix[i, j].sum()``. Where several assignments cost the same, any of them may be
returned.
"""

from __future__ import annotations

import math

import torch

__all__ = ["hungarian_algorithm", "base_hungarian_algorithm"]


def _augment(cost: list[list[float]], u: list[float], v: list[float], path: list[int],
             row4col: list[int], col4row: list[int], current: int) -> None:
    """One row joins the matching along a shortest augmenting path (updates the duals
    ``u``, ``v`` and the matching in place)."""
    m = len(v)
    shortest = [math.inf] * m
    remaining = list(range(m))[::-1]
    rows_seen, cols_seen = [current], []
    min_value, i, sink = 0.0, current, -1
    while sink == -1:
        index, lowest = -1, math.inf
        for it, j in enumerate(remaining):
            r = min_value + cost[i][j] - u[i] - v[j]
            if r < shortest[j]:
                path[j], shortest[j] = i, r
            if shortest[j] < lowest or (shortest[j] == lowest and row4col[j] == -1):
                lowest, index = shortest[j], it
        min_value = lowest
        if min_value == math.inf:
            raise ValueError("hungarian_algorithm: the cost matrix is infeasible (a row "
                             "can reach no column at a finite cost)")
        j = remaining[index]
        if row4col[j] == -1:
            sink = j
        else:
            i = row4col[j]
            rows_seen.append(i)
        cols_seen.append(j)
        remaining[index] = remaining[-1]
        remaining.pop()
    u[current] += min_value
    for i in rows_seen[1:]:
        u[i] += min_value - shortest[col4row[i]]
    for j in cols_seen:
        v[j] -= min_value - shortest[j]
    j = sink
    while True:
        i = path[j]
        row4col[j] = i
        col4row[i], j = j, col4row[i]
        if i == current:
            break


def hungarian_algorithm(cost_matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A least-cost assignment of rows to columns (optax's).

    Args:
        cost_matrix: a 2-D real tensor; ``inf`` forbids a pair, NaN is refused.

    Returns:
        ``(i, j)``: int64 tensors of ``min(n, m)`` row and column indices, ``i``
        ascending, on the matrix's device.
    """
    if not isinstance(cost_matrix, torch.Tensor) or cost_matrix.dim() != 2:
        got = (f"shape {tuple(cost_matrix.shape)}" if isinstance(cost_matrix, torch.Tensor)
               else type(cost_matrix).__name__)
        raise ValueError(f"hungarian_algorithm: expected a 2-D tensor, got {got}")
    if cost_matrix.is_complex() or cost_matrix.dtype == torch.bool:
        raise TypeError(f"hungarian_algorithm: expected real costs, got {cost_matrix.dtype}")
    device = cost_matrix.device
    costs = cost_matrix.detach().to(torch.float64)
    if bool(torch.isnan(costs).any()):
        raise ValueError("hungarian_algorithm: the cost matrix holds NaN")
    transpose = costs.shape[1] < costs.shape[0]
    if transpose:
        costs = costs.T
    n, m = costs.shape
    if n == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return empty, empty.clone()
    cost = costs.cpu().tolist()
    u, v = [0.0] * n, [0.0] * m
    path, row4col, col4row = [-1] * m, [-1] * m, [-1] * n
    for row in range(n):
        _augment(cost, u, v, path, row4col, col4row, row)
    cols = torch.tensor(col4row, dtype=torch.int64, device=device)
    if transpose:  # (rows of the transpose are the matrix's columns)
        order = torch.argsort(cols)
        return cols[order], order
    return torch.arange(n, device=device), cols


base_hungarian_algorithm = hungarian_algorithm
