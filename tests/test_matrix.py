"""Matrix stages (ftopt.matrix) and chains that mix them with elementwise rules.

``scale_by_row_norm`` is checked against a float64 reference; chains with matrix stages
anywhere (first, between rules, last, two in a row) run fused in segments (Triton kernels
under the interpreter on CPU) and must match the eager chain, keep skip_zeros' guarantees
bit for bit (with the control: without skip_zeros the same elements move), run every
segment's checks before the first kernel writes anything, and say what they do in
``explain``.
"""

from __future__ import annotations

import pytest
import torch

import ftopt
from ftopt.lowering.plan import plan_chain
from ftopt.matrix import matrix_transform
from ftopt.quantize import quantize_states

SHAPES = {"w": (6, 9), "u": (6, 9), "v": (5, 300), "b": (9,), "s": ()}
# The compiled kernels on a GPU machine, the Triton interpreter on a CPU one.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _tree(gen, zeros: bool = False):
    tree = {k: torch.randn(shape, generator=gen).to(DEVICE) for k, shape in SHAPES.items()}
    if zeros:
        tree["w"][1, 2] = 0.0
        tree["w"][3] = -0.0  # a whole row
        tree["b"][0] = 0.0
        tree["v"][:, 7] = 0.0
    return tree


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.uint8)


def test_row_norm_matches_float64_reference():
    gen = torch.Generator().manual_seed(0)
    u = _tree(gen)
    u["z"] = torch.zeros(3, 4, device=DEVICE)
    out, _ = ftopt.scale_by_row_norm(eps=1e-3).update(u, ftopt.EmptyState())
    for k, x in u.items():
        if x.dim() == 2:
            x64 = x.double()
            want = x64 / (x64.norm(dim=-1, keepdim=True) + 1e-3)
        else:
            want = x.double()
        assert torch.allclose(out[k].double(), want, rtol=1e-6, atol=1e-7), k
    assert torch.equal(out["z"], torch.zeros(3, 4, device=DEVICE))
    out0, _ = ftopt.scale_by_row_norm(eps=0.0).update({"z": torch.zeros(2, 3)},
                                                      ftopt.EmptyState())
    assert torch.equal(out0["z"], torch.zeros(2, 3))  # 0/0 rows stay 0


def test_equal_shapes_are_one_batched_call():
    calls = []
    tx = matrix_transform("double", lambda b: calls.append(tuple(b.shape)) or 2 * b)
    gen = torch.Generator().manual_seed(1)
    tx.update(_tree(gen), ftopt.EmptyState())
    assert sorted(calls) == [(1, 5, 300), (2, 6, 9)]


def test_bad_input_names_the_leaf():
    tx = ftopt.scale_by_row_norm()
    with pytest.raises(TypeError, match=r"\['w'\]"):
        tx.update({"w": torch.ones(2, 3, dtype=torch.int64)}, ftopt.EmptyState())
    with pytest.raises(ValueError, match="eps"):
        ftopt.scale_by_row_norm(eps=-1.0)


CHAINS = {
    "trace,row,lr": lambda skip: ftopt.chain(
        ftopt.trace(0.9), ftopt.scale_by_row_norm(), ftopt.scale_by_learning_rate(0.1),
        *skip),
    "row first": lambda skip: ftopt.chain(
        ftopt.scale_by_row_norm(), ftopt.scale_by_adam(), ftopt.scale_by_learning_rate(0.05),
        *skip),
    "row last": lambda skip: ftopt.chain(
        ftopt.scale_by_adam(), ftopt.scale_by_learning_rate(0.05), ftopt.scale_by_row_norm(),
        *skip),
    "two rows, norm after": lambda skip: ftopt.chain(
        ftopt.trace(0.5, nesterov=True), ftopt.scale_by_row_norm(),
        ftopt.scale_by_row_norm(1e-3), ftopt.clip_by_global_norm(0.5),
        ftopt.scale_by_learning_rate(0.3), *skip),
    # A stage that does not keep zeros: skip_zeros must come from the raw gradient.
    "centre rows last": lambda skip: ftopt.chain(
        ftopt.scale_by_adam(), ftopt.scale_by_learning_rate(0.05), _centre(), *skip),
    "centre rows, trace": lambda skip: ftopt.chain(
        _centre(), ftopt.trace(0.9), ftopt.scale_by_learning_rate(0.05), *skip),
}


def _centre():
    return matrix_transform("centre_rows", lambda b: b - b.mean(dim=-1, keepdim=True) + 0.01)


def _run(tx, backend: str, donate: bool, steps: int = 4, zeros: bool = True):
    gen = torch.Generator().manual_seed(2)
    params = _tree(gen)
    state = tx.init(params)
    for _ in range(steps):
        grads = _tree(gen, zeros)
        params, state = ftopt.step(tx, params, grads, state, backend=backend, donate=donate)
    return params, state


def _close(a, b, rtol=2e-5, atol=1e-6):
    for x, y in zip(ftopt.tree.leaves(a), ftopt.tree.leaves(b)):
        assert torch.allclose(x.float(), y.float(), rtol=rtol, atol=atol), (x, y)


@pytest.mark.parametrize("name", list(CHAINS))
@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("skip", [False, True])
def test_segments_fused_match_eager(name, donate, skip):
    tx = CHAINS[name]([ftopt.skip_zeros()] if skip else [])
    assert plan_chain(tx).segments is not None
    fused = _run(tx, "fused", donate)
    eager = _run(tx, "eager", donate)
    _close(fused, eager)


@pytest.mark.parametrize("name", list(CHAINS))
@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_segments_skip_zeros_bit_identical(name, backend):
    """Warm up, then one step with zeros: skipped elements of the params keep their bits;
    without skip_zeros (the control) they move. (States: the next test.)"""
    results = {}
    for skip in (False, True):
        tx = CHAINS[name]([ftopt.skip_zeros()] if skip else [])
        params = _tree(torch.Generator().manual_seed(4))
        state = tx.init(params)
        warm = torch.Generator().manual_seed(5)
        for _ in range(2):
            params, state = ftopt.step(tx, params, _tree(warm), state, backend=backend)
        grads = _tree(torch.Generator().manual_seed(6), zeros=True)
        before = ({k: v.clone() for k, v in params.items()},
                  [t.clone() for t in ftopt.tree.leaves(state)])
        new_p, new_s = ftopt.step(tx, params, grads, state, backend=backend)
        results[skip] = (before, new_p, new_s, grads)
    (before, new_p, new_s, grads) = results[True]
    moved_control = False
    for k, g in grads.items():
        zero = g == 0
        assert torch.equal(_bits(new_p[k])[zero], _bits(before[0][k])[zero]), k
        control = results[False]
        moved_control |= bool((control[1][k][zero] != control[0][0][k][zero]).any())
    assert moved_control, "the control case left every zero-gradient element in place"


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_segments_skip_zeros_keep_states(backend):
    """The states of a segment after a matrix stage keep their bits where the raw
    gradient is zero, though that segment's input (the matrix stage's output) is not zero
    there; the control moves them."""
    out = {}
    for skip in (False, True):
        tx = ftopt.chain(ftopt.scale_by_row_norm(), ftopt.trace(0.9),
                         ftopt.scale_by_learning_rate(0.1),
                         *([ftopt.skip_zeros()] if skip else []))
        params = _tree(torch.Generator().manual_seed(7))
        state = tx.init(params)
        params, state = ftopt.step(tx, params, _tree(torch.Generator().manual_seed(8)),
                                   state, backend=backend)
        old = {k: v.clone() for k, v in state[1].trace.items()}
        grads = _tree(torch.Generator().manual_seed(9), zeros=True)
        _, new_state = ftopt.step(tx, params, grads, state, backend=backend)
        out[skip] = (old, new_state[1].trace, grads)
    old, new, grads = out[True]
    for k, g in grads.items():
        zero = g == 0
        assert torch.equal(_bits(new[k])[zero], _bits(old[k])[zero]), k
    old_c, new_c, _ = out[False]
    assert any(bool((new_c[k][g == 0] != old_c[k][g == 0]).any()) for k, g in grads.items())


def test_segments_with_8_bit_states_match_eager():
    tx = quantize_states(CHAINS["trace,row,lr"]([ftopt.skip_zeros()]), bits=8, min_size=256)
    fused = _run(tx, "fused", donate=True)
    eager = _run(tx, "eager", donate=True)
    for x, y in zip(ftopt.tree.leaves(fused[1]), ftopt.tree.leaves(eager[1])):
        if x.dtype == torch.uint8:
            assert (x.int() - y.int()).abs().max() <= 1
        else:
            assert torch.allclose(x.float(), y.float(), rtol=1e-5, atol=1e-6)
    _close(fused[0], eager[0], rtol=1e-4, atol=1e-5)


def test_segments_update_matches_eager():
    tx = CHAINS["two rows, norm after"]([ftopt.skip_zeros()])
    gen = torch.Generator().manual_seed(10)
    params, grads = _tree(gen), _tree(gen, zeros=True)
    state = tx.init(params)
    u_f, s_f = tx.update(grads, state, params, backend="fused")
    u_e, s_e = tx.update(grads, state, params, backend="eager")
    _close(u_f, u_e)
    _close(s_f, s_e)


def test_a_refusal_in_a_later_segment_writes_nothing():
    """Every segment is checked before the first kernel runs: a bad state of the segment
    after the matrix stage raises, and the params and the first segment's state are as
    they were (donated)."""
    tx2 = ftopt.chain(ftopt.trace(0.9), ftopt.scale_by_row_norm(), ftopt.trace(0.5),
                      ftopt.scale_by_learning_rate(0.1))
    gen = torch.Generator().manual_seed(11)
    params = _tree(gen)
    state = tx2.init(params)
    bad = state[2]._replace(trace={**state[2].trace, "w": torch.zeros(3, 3, device=DEVICE)})
    state = (state[0], state[1], bad, state[3])
    snapshot = ({k: v.clone() for k, v in params.items()},
                {k: v.clone() for k, v in state[0].trace.items()})
    with pytest.raises(ValueError, match=r"\['w'\]"):
        ftopt.step(tx2, params, _tree(gen), state, backend="fused", donate=True)
    for k in params:
        assert torch.equal(params[k], snapshot[0][k])
        assert torch.equal(state[0].trace[k], snapshot[1][k])


def test_explain_lists_the_segments():
    tx = CHAINS["trace,row,lr"]([])
    text = ftopt.explain(tx, _tree(torch.Generator().manual_seed(12)), backend="fused",
                         file=open("/dev/null", "w"))
    assert ("segments: [trace] fused -> scale_by_row_norm (matrix stage" in text
            and "[scale_by_learning_rate] fused" in text)
    assert "kernel launches per step: 2" in text


def test_matrix_stage_reads_is_checked():
    with pytest.raises(ValueError, match=r"my_stage: reads must be one of \['leaf', 'rows'\]"):
        matrix_transform("my_stage", lambda b: b, reads="cols")


def test_matrix_stage_leaves_reach_the_next_kernels_aligned(monkeypatch):
    """A matrix stage's leaves are views of its batch (the second of two 15-element
    leaves starts 60 bytes in); the fused segment after it gets them at 16-byte aligned
    addresses, with or without skip_zeros, so both steps run the same kernel variant (an
    unaligned one adds its reductions in another order on a GPU: H200 fuzz, seed 20
    example 1804, the plain step one ulp from the skip_zeros step off the zeros)."""
    from ftopt.lowering import launch

    seen = []
    variant = launch.GroupLaunch.variant

    def spy(self, scalars):
        out = variant(self, scalars)
        seen.append(out.aligned)
        return out

    monkeypatch.setattr(launch.GroupLaunch, "variant", spy)
    gen = torch.Generator().manual_seed(4)
    params = {k: torch.randn(s, generator=gen).to(DEVICE)
              for k, s in (("a", (3, 5)), ("b", (3, 5)), ("c", (1,)))}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    grads["c"].zero_()
    chain = ftopt.chain(ftopt.scale_by_row_norm(), ftopt.clip_by_block_rms(0.1),
                        ftopt.centralize(), ftopt.scale(-0.5))
    out = {}
    for name, tx in (("plain", chain), ("skip", ftopt.skip_zeros(chain))):
        seen.clear()
        out[name] = ftopt.step(tx, params, grads, tx.init(params), backend="fused")[0]
        assert seen and all(seen), (name, seen)
    for k in ("a", "b"):
        assert torch.equal(_bits(out["plain"][k]), _bits(out["skip"][k]))
