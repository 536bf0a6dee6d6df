"""The bad-input table: every row is one wrong input, run through every entry point.

Each row builds ``(tx, params, grads, state, kwargs)`` and names the error type and the
substrings its message must hold (the pytree path or the argument that is wrong). Every
row runs through ``step`` (eager, fused, auto; ``donate=False`` and ``True``) and
``tx.update`` (eager, fused, auto), unless the row says why an entry point does not apply
(a fused-only refusal, for instance, is a valid input for the eager backend). Each call
must raise and leave every input tensor bit-identical: params, grads and state leaves
(8-bit codes and absmax included) keep their dtype, shape, version counter and bytes.
Rows whose ``build`` itself must raise (a bad argument to a combinator) are checked by
:func:`test_construction`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import bad_input_rows_more  # noqa: F401 - registers the rest of the rows
import pytest
import torch
from bad_input_rows import DEVICE, ROWS, Row

import ftopt

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")

ENTRIES = ("step-eager", "step-fused", "step-auto", "update-eager", "update-fused",
           "update-auto")


def _bits(x: torch.Tensor) -> torch.Tensor:
    x = x.detach()
    if x.layout != torch.strided:
        x = x.to_dense()
    return x.contiguous().reshape(-1).view(torch.uint8)


@dataclass
class _Leaf:
    tensor: torch.Tensor
    clone: torch.Tensor | None
    version: int
    meta: tuple


class Snapshot:
    """Copies of every tensor in the given trees, to check that a call changed none."""

    def __init__(self, *trees):
        self.items = []
        for tree in trees:
            for x in ftopt.tree.leaves(tree):
                if isinstance(x, torch.Tensor):
                    # A meta tensor has no data: its metadata is all there is to compare.
                    clone = None if x.device.type == "meta" else x.detach().clone()
                    self.items.append(_Leaf(x, clone, x._version,
                                            (x.dtype, x.shape, x.device, x.layout,
                                             x.stride() if x.layout == torch.strided
                                             else None)))

    def check(self) -> None:
        for leaf in self.items:
            x = leaf.tensor
            assert x._version == leaf.version, "an input tensor was written in place"
            assert (x.dtype, x.shape, x.device, x.layout,
                    x.stride() if x.layout == torch.strided else None) == leaf.meta
            if leaf.clone is not None:
                assert torch.equal(_bits(x), _bits(leaf.clone)), "an input tensor changed"


def _call(entry: str, tx, params, grads, state, kwargs: dict, donate: bool):
    kind, backend = entry.split("-")
    kwargs = dict(kwargs)
    backend = kwargs.pop("backend", backend)
    if kind == "step":
        return ftopt.step(tx, params, grads, state, donate=donate, backend=backend, **kwargs)
    upd_params = kwargs.pop("params", params)
    return tx.update(grads, state, upd_params, backend=backend, **kwargs)


def _cases(kind: str) -> list:
    return [pytest.param(row, entry, id=f"{row.name}-{entry}") for row in ROWS
            if row.build_error is None for entry in ENTRIES
            if entry.startswith(kind) and entry not in row.skip]


def _check_message(row: Row, err: BaseException) -> None:
    msg = str(err)
    for fragment in row.fragments:
        assert fragment in msg, f"{fragment!r} not in error message: {msg!r}"
    assert len(msg) < 600, f"error message too long: {msg!r}"


def _built(row: Row, entry: str):
    """The row's inputs; for a fused entry on a GPU machine, CPU tensors move to the GPU
    (``backend="fused"`` refuses CPU tensors there, before the error the row is about),
    unless the row places a tensor on ``meta`` itself (its device is the point)."""
    tx, params, grads, state, kwargs = row.build()
    if DEVICE == "cpu" or not entry.endswith("fused"):
        return tx, params, grads, state, kwargs
    leaves = [x for x in ftopt.tree.leaves((params, grads, state))
              if isinstance(x, torch.Tensor)]
    if any(x.device.type == "meta" for x in leaves):
        return tx, params, grads, state, kwargs
    move = lambda x: x.to(DEVICE) if isinstance(x, torch.Tensor) else x  # noqa: E731
    params, grads, state = (ftopt.tree.map(move, t) for t in (params, grads, state))
    return tx, params, grads, state, kwargs


@pytest.mark.parametrize("row,entry", _cases("step"))
def test_step(row: Row, entry: str):
    for donate in row.donate:
        tx, params, grads, state, kwargs = _built(row, entry)
        snap = Snapshot(params, grads, state)
        with pytest.raises(row.error) as info:
            _call(entry, tx, params, grads, state, kwargs, donate)
        _check_message(row, info.value)
        snap.check()


@pytest.mark.parametrize("row,entry", _cases("update"))
def test_update(row: Row, entry: str):
    tx, params, grads, state, kwargs = _built(row, entry)
    snap = Snapshot(params, grads, state)
    with pytest.raises(row.error) as info:
        _call(entry, tx, params, grads, state, kwargs, False)
    _check_message(row, info.value)
    snap.check()


@pytest.mark.parametrize("row", [r for r in ROWS if r.build_error is not None],
                         ids=lambda r: r.name)
def test_construction(row: Row):
    with pytest.raises(row.build_error) as info:
        row.build()
    _check_message(row, info.value)


def test_table_size_and_coverage():
    """At least 40 rows; every row runs somewhere, and every skip says why."""
    assert len(ROWS) >= 40
    assert len({r.name for r in ROWS}) == len(ROWS)
    for row in ROWS:
        if row.build_error is None:
            assert set(row.skip) <= set(ENTRIES), row.name
            assert set(ENTRIES) - set(row.skip), f"{row.name} runs nowhere"
            assert all(row.skip.values()), f"{row.name}: a skip without a reason"
            assert row.fragments, row.name


def test_explain_names_the_refused_leaf():
    gen = torch.Generator().manual_seed(5)
    params = {"a": torch.randn(3, generator=gen), "w": torch.randn(3, 2, generator=gen)}
    grads = {"a": torch.randn(3, generator=gen), "w": torch.randn(2, 3, generator=gen).t()}
    params, grads = ftopt.tree.map(lambda x: x.to(DEVICE), (params, grads))
    text = ftopt.explain(ftopt.adam(1e-2), params, grads, backend="fused", file=_Null())
    assert "path: eager (grad at ['w'] is not contiguous)" in text
    wide = {"a": params["a"], "w": params["w"].double()}
    text = ftopt.explain(ftopt.adam(1e-2), wide, backend="fused", file=_Null())
    assert "param at ['w']: dtype torch.float64 is not fp32/fp16/bf16" in text


class _Null:
    def write(self, _):
        pass

    def flush(self):
        pass


def test_checked_before_the_cached_fused_paths():
    """After a fused step has cached its tables, inputs that do not fit them (an 8-bit
    state, sparse or misplaced gradients) still get the full checks and their errors."""
    gen = torch.Generator().manual_seed(6)
    tx = ftopt.adam(1e-2)
    params = {"w": torch.randn(64, 64, generator=gen).to(DEVICE)}
    grads = {"w": torch.randn(64, 64, generator=gen).to(DEVICE)}
    state = tx.init(params)
    ftopt.step(tx, params, grads, state, backend="fused")  # caches the functional tables
    eight = ftopt.adam(1e-2, state_bits=8).init(params)
    bad: list[tuple[Callable, type, str]] = [
        (lambda: ftopt.step(tx, params, grads, eight, backend="fused"), ValueError,
         "state mu at ['w']: an 8-bit state (QuantizedSlot)"),
        (lambda: ftopt.step(tx, params, {"w": grads["w"].to_sparse()}, state,
                            backend="fused"), TypeError, "to_dense()"),
        (lambda: ftopt.step(tx, params, {"w": grads["w"].to_sparse_csr()}, state,
                            donate=True, backend="fused"), TypeError, "to_dense()"),
        (lambda: ftopt.step(tx, params, {"w": grads["w"].to("meta")}, state,
                            backend="fused"), ValueError, "grad at ['w']: on meta"),
    ]
    for fn, error, fragment in bad:
        snap = Snapshot(params, grads, state, eight)
        with pytest.raises(error) as info:
            fn()
        assert fragment in str(info.value)
        snap.check()


@pytest.mark.parametrize("case", ["sparse_update", "sparse_param", "update_on_meta"])
def test_apply_updates_names_the_leaf(case):
    gen = torch.Generator().manual_seed(7)
    params = {"b": torch.randn(2, generator=gen), "w": torch.randn(3, 2, generator=gen)}
    updates = {"b": torch.randn(2, generator=gen), "w": torch.randn(3, 2, generator=gen)}
    error, fragments = {
        "sparse_update": (TypeError, ["apply_updates at ['w']", "update is a sparse",
                                      ".to_dense()"]),
        "sparse_param": (TypeError, ["apply_updates at ['w']", "param is a sparse"]),
        "update_on_meta": (ValueError, ["apply_updates at ['w']", "on meta",
                                        "param's device cpu"]),
    }[case]
    if case == "sparse_update":
        updates["w"] = updates["w"].to_sparse()
    elif case == "sparse_param":
        params["w"] = params["w"].to_sparse()
    else:
        updates["w"] = updates["w"].to("meta")
    snap = Snapshot(params, updates)
    with pytest.raises(error) as info:
        ftopt.apply_updates(params, updates)
    for fragment in fragments:
        assert fragment in str(info.value)
    snap.check()
