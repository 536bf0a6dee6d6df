"""``ftopt.assignment`` (optax's ``optax.assignment``): the Hungarian algorithm against
brute force over every assignment, optax's docstring examples, forbidden pairs and the
refusals."""

from __future__ import annotations

import itertools

import pytest
import torch
from step_checks import fresh_generator

import ftopt
from ftopt.assignment import base_hungarian_algorithm, hungarian_algorithm


def _brute(c: torch.Tensor) -> float:
    n, m = c.shape
    if n <= m:
        return min(sum(float(c[r, p[r]]) for r in range(n))
                   for p in itertools.permutations(range(m), n))
    return min(sum(float(c[p[k], k]) for k in range(m))
               for p in itertools.permutations(range(n), m))


def test_optax_s_examples():
    c = torch.tensor([[8, 4, 7], [5, 2, 3], [9, 6, 7], [9, 4, 8]])
    i, j = hungarian_algorithm(c)
    assert int(c[i, j].sum()) == 15 and i.tolist() == [0, 1, 3] and j.tolist() == [0, 2, 1]
    c = torch.tensor([[90, 80, 75, 70], [35, 85, 55, 65], [125, 95, 90, 95],
                      [45, 110, 95, 115], [50, 100, 90, 100]])
    i, j = base_hungarian_algorithm(c)
    assert int(c[i, j].sum()) == 265 and i.tolist() == [0, 1, 2, 3]
    assert j.tolist() == [3, 2, 1, 0]


def test_least_cost_against_brute_force():
    """300 matrices up to 6 × 6, wide and tall, with many ties (small integer costs) a
    third of the time: an assignment of min(n, m) distinct rows and columns, ``i``
    ascending, costing what the best of all assignments costs."""
    gen = fresh_generator()
    for trial in range(300):
        n, m = (int(x) for x in torch.randint(1, 7, (2,), generator=gen))
        c = (torch.randint(0, 3, (n, m), generator=gen).double() if trial % 3 == 0
             else torch.randn(n, m, generator=gen, dtype=torch.float64))
        i, j = hungarian_algorithm(c)
        assert i.dtype == j.dtype == torch.int64 and len(i) == len(j) == min(n, m)
        assert len(set(i.tolist())) == len(i) and len(set(j.tolist())) == len(j)
        assert i.tolist() == sorted(i.tolist())
        assert abs(float(c[i, j].sum()) - _brute(c)) < 1e-9, (c, i, j)


def test_forbidden_pairs_and_refusals():
    inf = float("inf")
    c = torch.tensor([[inf, 1.0], [2.0, inf]])
    i, j = hungarian_algorithm(c)
    assert i.tolist() == [0, 1] and j.tolist() == [1, 0]
    with pytest.raises(ValueError, match="infeasible"):
        hungarian_algorithm(torch.tensor([[inf, inf], [1.0, 2.0]]))
    with pytest.raises(ValueError, match="NaN"):
        hungarian_algorithm(torch.tensor([[float("nan"), 1.0]]))
    with pytest.raises(ValueError, match="expected a 2-D tensor"):
        hungarian_algorithm(torch.ones(3))
    i, j = hungarian_algorithm(torch.ones(0, 4))
    assert i.numel() == 0 and j.numel() == 0
    assert ftopt.assignment.hungarian_algorithm is hungarian_algorithm
