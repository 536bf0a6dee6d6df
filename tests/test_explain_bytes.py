"""``explain`` reports each group's state bytes per parameter (from ``tx.init`` on meta
tensors) and the bytes a step moves, with the floor time at a given copy bandwidth. The
state bytes are checked against the states a real ``init`` allocates, and against the
formula (slots x bytes per element, 8-bit codes plus one fp32 absmax per block)."""

from __future__ import annotations

import re

import pytest
import torch

import ftopt
from ftopt import tree as tree_lib
from ftopt.lowering.explain import state_bytes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class _Null:
    def write(self, text: str) -> int:
        return len(text)


def _params(gen: torch.Generator) -> dict:
    return {"emb": torch.randn(64, 80, generator=gen),  # 5120 elements: 20 blocks
            "blocks": [{"w": torch.randn(48, 40, generator=gen),
                        "b": torch.randn(40, generator=gen)}],
            "scale": torch.randn((), generator=gen)}


def _per_param(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"state bytes per parameter: ([0-9.]+)", text)]


@pytest.mark.parametrize("name, tx, want", [
    ("sgd", lambda: ftopt.sgd(0.1), 0.0),
    ("sgd momentum", lambda: ftopt.sgd(0.1, momentum=0.9), 4.0),
    ("adamw", lambda: ftopt.adamw(1e-3), 8.0),
    ("adamw bf16 states", lambda: ftopt.adamw(1e-3, state_dtype=torch.bfloat16), 4.0),
    ("ademamix", lambda: ftopt.ademamix(1e-3), 12.0),
])
def test_state_bytes_per_parameter_match_the_formula_and_a_real_init(name, tx, want):
    params = _params(torch.Generator().manual_seed(0))
    tx = tx()
    text = ftopt.explain(tx, params, file=_Null())
    assert _per_param(text) == [pytest.approx(want, abs=1e-3)]
    _, p_flat, spec = tree_lib.flatten_with_paths(params)
    held, shared = state_bytes(tx, params, spec, p_flat)
    real = sum(t.numel() * t.element_size() for t in tree_lib.leaves(tx.init(params))
               if isinstance(t, torch.Tensor))
    assert sum(held) + shared == real
    assert held == [round(want * p.numel()) for p in p_flat]


def test_8bit_states_count_codes_and_one_absmax_per_block():
    params = _params(torch.Generator().manual_seed(1))
    tx = ftopt.adamw(1e-3, state_bits=8)  # min_size 4096: only "emb" is 8-bit
    text = ftopt.explain(tx, params, file=_Null())
    per = dict(zip(re.findall(r"(8-bit|32-bit) states", text), _per_param(text)))
    assert per == {"8-bit": pytest.approx(2 * (1 + 4 / 256), abs=1e-3),
                   "32-bit": pytest.approx(8.0)}
    paths, p_flat, spec = tree_lib.flatten_with_paths(params)
    held, _ = state_bytes(tx, params, spec, p_flat)
    assert held[paths.index("['emb']")] == 2 * (5120 + 4 * 20)


def test_factored_states_count_rows_and_columns():
    w = torch.randn(256, 192)
    tx = ftopt.adafactor(1e-3)
    params = {"w": w, "b": torch.randn(7)}
    paths, p_flat, spec = tree_lib.flatten_with_paths(params)
    held, _ = state_bytes(tx, params, spec, p_flat)
    b, w = held[paths.index("['b']")], held[paths.index("['w']")]
    assert b >= 7 * 4  # unfactored: a full second moment
    assert (256 + 192) * 4 <= w < 256 * 192  # factored: rows and columns only


def test_a_single_tensor_holds_its_own_states():
    p = torch.randn(1000)
    text = ftopt.explain(ftopt.adamw(1e-3), p, file=_Null())
    assert _per_param(text) == [pytest.approx(8.0)]
    assert "4 bytes of state shared" in text  # the step count


def test_bytes_moved_and_floor_time_of_a_fused_step():
    gen = torch.Generator().manual_seed(2)
    params = {"a": torch.randn(300, generator=gen).to(DEVICE),
              "b": torch.randn(7, 11, generator=gen).to(DEVICE)}
    text = ftopt.explain(ftopt.adamw(1e-3), params, donate=True, backend="fused",
                         bandwidth=2000, file=_Null())
    numel = 300 + 77
    moved = int(re.search(r"bytes moved per step: (\d+)", text).group(1))
    assert moved == 28 * numel  # p, g, mu, nu read; p, mu, nu written; fp32
    ms = float(re.search(r"floor time at 2000 GB/s: ([0-9.e-]+) ms", text).group(1))
    assert ms == pytest.approx(moved / 2000e9 * 1e3, rel=1e-3)


def test_an_eager_group_reports_the_least_bytes_a_step_moves():
    params = {"w": torch.randn(50, 20)}
    text = ftopt.explain(ftopt.adamw(1e-3), params, backend="eager", file=_Null())
    assert "bytes moved per step: at least 28000" in text


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "fast"])
def test_a_bad_bandwidth_is_refused(bad):
    with pytest.raises(ValueError, match="bandwidth must be a positive number of GB/s"):
        ftopt.explain(ftopt.adamw(1e-3), {"w": torch.randn(3)}, bandwidth=bad, file=_Null())


@pytest.mark.parametrize("tx, want", [
    # NovoGrad's nu is one fp32 per leaf: no bytes per element. Main kernel: g, p, m read;
    # p, m written; the norm pass reads g (its per-leaf ‖g‖²).
    (lambda: ftopt.novograd(1e-3), "main kernel reads 12, writes 8; norm passes read 4 more"),
    # 8-bit LAMB: the trust ratio's pass reads g, p and both moments as codes plus their
    # share of the block's absmax (1 + 4/256 each), as the main kernel does.
    (lambda: ftopt.lamb(1e-3, state_bits=8),
     "main kernel reads 10.031, writes 6.031; norm passes read 10.031 more"),
])
def test_bytes_per_element_count_slots_at_their_stored_size(tx, want):
    params = {"w": torch.randn(64, 80, generator=torch.Generator().manual_seed(4)).to(DEVICE)}
    text = ftopt.explain(tx(), params, donate=True, backend="fused", file=_Null())
    assert f"bytes per element: {want}" in text, text


def test_explain_names_the_skip_mode_and_fast_math(monkeypatch):
    """A donated skip_zeros step names its layout's skip mode, and what the chain falls
    back to where its kernels cannot take it; fast-math layouts say so."""
    from ftopt.lowering import tiles

    monkeypatch.setattr(tiles, "SKIP_MODES", {"fp32": "in_place", "16-bit": "stores",
                                              "16-bit states": "chunks", "8-bit": "stores"})
    monkeypatch.setattr(tiles, "FAST_MATH", frozenset({"16-bit states"}))
    w = torch.randn(5000).to(DEVICE)
    cases = [
        (ftopt.adam(1e-3, skip_zeros=True), w, "mode 'in_place' of the 'fp32' layout ("),
        (ftopt.lamb(1e-3, skip_zeros=True), w, "here 'select'"),
        (ftopt.adam(1e-3, skip_zeros=True), w.bfloat16(), "mode 'stores' of the '16-bit'"),
        (ftopt.adam(1e-3, skip_zeros=True, state_dtype=torch.bfloat16), w,
         "mode 'chunks' of the '16-bit states' layout ("),
        (ftopt.adam(1e-3, skip_zeros=True, state_bits=8), w, "mode 'stores' of the '8-bit'"),
    ]
    for tx, x, want in cases:
        text = ftopt.explain(tx, {"w": x}, donate=True, backend="fused", file=_Null())
        assert want in text, text
        assert ("approximate" in text) == ("16-bit states" in want), text
    text = ftopt.explain(ftopt.adam(1e-3, skip_zeros=True), {"w": w}, backend="fused",
                         file=_Null())
    assert "skip_zeros (donated)" not in text


def test_explain_counts_the_deferred_launch(monkeypatch):
    """"split+defer" takes a second launch in a donated step (not in a chain whose
    kernels cannot return early, which falls back to "select")."""
    from ftopt.lowering import tiles

    monkeypatch.setitem(tiles.SKIP_MODES, "8-bit", "split+defer")
    w = {"w": torch.randn(5000).to(DEVICE)}
    adam = ftopt.adam(1e-3, skip_zeros=True, state_bits=8)
    text = ftopt.explain(adam, w, donate=True, backend="fused", file=_Null())
    assert "kernel launches per step: 2 (0 norm pass(es) + 1 main + 1 for skipped" in text
    assert "one more launch runs the programs with some zero gradients" in text, text
    assert f"or 'split+select' while more than {tiles.DEFER_SELECT_ABOVE:g}" in text, text
    text = ftopt.explain(adam, w, backend="fused", file=_Null())
    assert "kernel launches per step: 1 (0 norm pass(es) + 1 main)" in text, text
    novograd = ftopt.novograd(1e-2, skip_zeros=True, state_bits=8)  # (per-leaf values)
    text = ftopt.explain(novograd, w, donate=True, backend="fused", file=_Null())
    assert "here 'select'" in text and "one more launch" not in text, text
    assert "+ 1 for skipped" not in text, text


def test_explain_names_the_span(monkeypatch):
    """A layout whose "split" programs check several blocks at once (``tiles.SPANS``)
    says how many; one whose chain cannot return early (no "split") does not."""
    from ftopt.lowering import streams, tiles

    monkeypatch.setitem(tiles.SKIP_MODES, "16-bit", "split+in_place")
    monkeypatch.setattr(tiles, "SPANS", {"16-bit": 4})
    w = {"w": torch.randn(5000).to(DEVICE, torch.bfloat16)}
    text = ftopt.explain(ftopt.adam(1e-3, skip_zeros=True), w, donate=True,
                         backend="fused", file=_Null())
    assert "a program checks 4 blocks' gradients at once" in text, text
    assert "'select' while the blocks with some and with only zero gradients" in text, text
    text = ftopt.explain(ftopt.novograd(1e-2, skip_zeros=True), w, donate=True,
                         backend="fused", file=_Null())  # (per-leaf values: no "split")
    assert "here 'select'" in text and "blocks' gradients at once" not in text, text
    assert "with only zero gradients" not in text, text
    monkeypatch.setattr(tiles, "SPANS", {})
    text = ftopt.explain(ftopt.adam(1e-3, skip_zeros=True), w, donate=True,
                         backend="fused", file=_Null())
    assert "blocks' gradients at once" not in text, text
    # One block a program: the spanned alternate of tiles.SPAN_ALTERNATES, if any.
    assert "all zero" not in text, text
    monkeypatch.setattr(tiles, "SPAN_ALTERNATES", {"16-bit": 8})
    text = ftopt.explain(ftopt.adam(1e-3, skip_zeros=True), w, donate=True,
                         backend="fused", file=_Null())
    assert f"programs of 8 blocks while over {tiles.SPAN_ABOVE:g} are all zero" in text, text
    assert "or of 8 for the leaves that each are" in text, text  # (tiles.CARVE_SPANS)
    monkeypatch.setattr(tiles, "CARVE_SPANS", {"16-bit": 2})
    text = ftopt.explain(ftopt.adam(1e-3, skip_zeros=True), w, donate=True,
                         backend="fused", file=_Null())
    assert "or of 2 for the leaves that each are" in text, text
    assert "on a second stream beside the others' kernels" in text, text
    monkeypatch.setattr(streams, "ON", False)  # (FTOPT_CARVE_STREAM=0)
    text = ftopt.explain(ftopt.adam(1e-3, skip_zeros=True), w, donate=True,
                         backend="fused", file=_Null())
    assert "or of 2 for the leaves that each are" in text, text
    assert "second stream" not in text, text
