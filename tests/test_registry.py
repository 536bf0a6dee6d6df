"""The test registry (``tests/registry.py``) covers every export of ``ftopt``.

A new export must land either in the registry (it builds a ``GradientTransformation``) or
in ``registry.NOT_TRANSFORMS``; an export annotated to return a ``GradientTransformation``
cannot hide in the second list. Every entry builds from its own hyperparameter draws, and
its traits match what the built transform does.
"""

from __future__ import annotations

import random
import typing

import pytest
import torch
from fuzz_cases import RandomSource
from registry import BY_NAME, NOT_TRANSFORMS, TRANSFORMS, by_trait

import ftopt
from ftopt.base import GradientTransformation
from ftopt.stages import chain_stages

REGISTERED = {e.exported for e in TRANSFORMS}


def test_every_export_is_classified():
    exported = set(ftopt.__all__)
    missing = exported - REGISTERED - NOT_TRANSFORMS
    assert not missing, f"exports in neither the registry nor NOT_TRANSFORMS: {missing}"
    assert not REGISTERED & NOT_TRANSFORMS, REGISTERED & NOT_TRANSFORMS
    assert not (REGISTERED | NOT_TRANSFORMS) - exported, "stale names in tests/registry.py"


@pytest.mark.parametrize("name", sorted(NOT_TRANSFORMS))
def test_non_transforms_build_no_transform(name):
    obj = getattr(ftopt, name)
    if callable(obj) and not isinstance(obj, type):
        hints = typing.get_type_hints(obj) if hasattr(obj, "__annotations__") else {}
        assert hints.get("return") is not GradientTransformation, \
            f"ftopt.{name} returns a GradientTransformation: add it to tests/registry.py"


def _inner_for(e) -> dict:
    if e.kind != "combinator":
        return {}
    n = 2 if e.name == "partition" else 1
    return {"inner": [ftopt.scale_by_adam() if i == 0 else ftopt.trace(0.5) for i in range(n)]}


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_entries_build_and_traits_hold(name):
    e = BY_NAME[name]
    src = RandomSource(random.Random(name))
    params = {"w": torch.randn(4, 3), "b": torch.randn(5)}
    grads = ftopt.tree.map(torch.randn_like, params)
    for tensors in (False, True):
        tx = e.make(**e.sample(src, tensors=tensors), **_inner_for(e))
        assert isinstance(tx, GradientTransformation)
        state = tx.init(params)
        new_p, new_state = ftopt.step(tx, params, grads, state, backend="eager")
        assert all(torch.isfinite(t).all() for t in ftopt.tree.leaves(new_p))
        if e.kind == "combinator":
            continue
        fields = {f for st in _states(state) for f in type(st)._fields}
        assert set(e.states) <= fields, (e.states, fields)
        has_count = any("count" in type(st)._fields for st in _states(state))
        assert has_count == e.counted, name
        assert (chain_stages(tx).reason is None) == e.fusible, chain_stages(tx).reason
        if e.eight_bit:
            q = ftopt.quantize_states(tx, bits=8, min_size=0)
            codes = [t for t in ftopt.tree.leaves(q.init(params)) if t.dtype == torch.uint8]
            assert codes, f"{name}: quantize_states(bits=8) made no 8-bit state"


def _states(state) -> list:
    """The NamedTuple states inside a state tree."""
    out = []

    def walk(x):
        if hasattr(x, "_fields"):
            out.append(x)
            for v in x:
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
    walk(state)
    return [s for s in out if type(s).__name__ != "QuantizedSlot"]


def test_by_trait():
    assert {e.name for e in by_trait(kind="alias", norms="leaf")} >= {"lamb", "lars"}
    assert all(e.fusible for e in by_trait(fusible=True))
    assert all(e.states for e in by_trait(states=True))
    assert "scale_by_adam" in {e.name for e in by_trait(eight_bit=True, kind="transform")}
