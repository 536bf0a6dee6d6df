"""flatten (ftopt.layouts): an inner transform over all leaves concatenated into one
vector; a per-leaf norm then spans the tree (float64), elementwise math is unchanged (bit
for bit), skip_zeros holds through it, and its inputs are left as they were."""

from __future__ import annotations

import pytest
import torch
from step_checks import bits, cloned, fresh_generator, same_bits

import ftopt

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tree(gen: torch.Generator, device: str = "cpu") -> dict:
    return {"w": torch.randn(4, 6, generator=gen).to(device),
            "b": torch.randn(5, generator=gen).to(device),
            "s": torch.randn((), generator=gen).to(device)}


def _cat(tree: dict) -> torch.Tensor:
    return torch.cat([tree[k].reshape(-1) for k in ("b", "s", "w")])  # (optree's key order)


def test_a_trust_ratio_spans_the_whole_tree():
    """flatten(scale_by_trust_ratio()): u · ‖p‖/‖u‖ with both norms over every leaf,
    against float64; the control: without flatten each leaf has its own ratio."""
    gen = fresh_generator()
    params, grads = _tree(gen), _tree(gen)
    tx = ftopt.flatten(ftopt.scale_by_trust_ratio())
    out, _ = tx.update(grads, tx.init(params), params)
    ratio = _cat(params).double().norm() / _cat(grads).double().norm()
    for k in params:
        assert out[k].shape == grads[k].shape
        torch.testing.assert_close(out[k].double(), grads[k].double() * ratio, rtol=1e-6,
                                   atol=0)
    per_leaf, _ = ftopt.scale_by_trust_ratio().update(grads, (), params)
    assert not torch.allclose(per_leaf["w"], out["w"])


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_elementwise_math_is_unchanged_and_the_state_is_flat(backend):
    """flatten(adam) steps the params as adam does on the same backend, bit for bit, and
    its state is adam's state of the concatenated leaves (the fused backend: adam's own
    update fuses over the flat vector)."""
    gen = fresh_generator()
    device = DEVICE if backend == "fused" else "cpu"
    params = _tree(gen, device)
    grads = [_tree(gen, device) for _ in range(3)]
    flat_tx, tx = ftopt.flatten(ftopt.adam(1e-2)), ftopt.adam(1e-2)
    p1, s1 = params, flat_tx.init(params)
    p2, s2 = params, tx.init(params)
    for g in grads:
        u, s1 = flat_tx.update(g, s1, p1, backend=backend)  # (passed on to adam's update)
        p1 = ftopt.apply_updates(p1, u)
        u, s2 = tx.update(g, s2, p2, backend=backend)
        p2 = ftopt.apply_updates(p2, u)
    assert same_bits(p1, p2)
    mu = ftopt.tree.get(s1, "mu")
    assert mu.shape == (4 * 6 + 5 + 1,)
    assert torch.equal(mu, _cat(ftopt.tree.get(s2, "mu")))


def test_skip_zeros_holds_through_it():
    """In a skip_zeros chain the mask is flattened with the updates: params and the flat
    state keep their bits where the gradient is zero; the control: without skip_zeros
    they change there."""
    gen = fresh_generator()
    params = _tree(gen)
    warm, g = _tree(gen), _tree(gen)
    g["w"][1] = 0.0
    g["b"][::2] = 0.0
    zero = _cat({k: v == 0 for k, v in g.items()})
    for skip in (True, False):
        tx = ftopt.chain(ftopt.flatten(ftopt.adam(1e-2)), *([ftopt.skip_zeros()] * skip))
        p, s = ftopt.step(tx, params, warm, tx.init(params), backend="eager")
        p2, s2 = ftopt.step(tx, p, g, s, backend="eager")
        kept = [torch.equal(bits(_cat(p2))[zero], bits(_cat(p))[zero])]
        for name in ("mu", "nu"):
            a, b = ftopt.tree.get(s, name), ftopt.tree.get(s2, name)
            kept.append(torch.equal(bits(b)[zero], bits(a)[zero]))
        assert all(kept) if skip else not any(kept), skip
        assert not torch.equal(_cat(p2)[~zero], _cat(p)[~zero])


def test_mixed_dtypes_and_none_leaves():
    """bf16 and fp32 leaves are concatenated in fp32; a None gradient leaf stays None and
    takes no part."""
    gen = fresh_generator()
    params = {"a": torch.randn(6, generator=gen).bfloat16(), "b": torch.randn(3, generator=gen)}
    grads = {"a": torch.randn(6, generator=gen).bfloat16(), "b": None}
    tx = ftopt.flatten(ftopt.scale_by_trust_ratio())
    state = tx.init({"a": params["a"]})
    out, _ = tx.update(grads, state, params)
    assert out["b"] is None and out["a"].dtype == torch.float32 and out["a"].shape == (6,)
    ratio = params["a"].double().norm() / grads["a"].double().norm()
    torch.testing.assert_close(out["a"].double(), grads["a"].double() * ratio, rtol=1e-6,
                               atol=0)


def test_inputs_untouched_and_bad_input_named():
    gen = fresh_generator()
    params, grads = _tree(gen), _tree(gen)
    tx = ftopt.flatten(ftopt.adam(1e-2))
    state = tx.init(params)
    before = cloned((params, grads, state))
    tx.update(grads, state, params)
    assert same_bits(before, (params, grads, state))
    bad = {**grads, "w": torch.zeros(4, 6, dtype=torch.int32)}
    with pytest.raises(TypeError, match=r"update at \['w'\]: expected a floating-point tensor"):
        tx.update(bad, state, params)
    wrong = {**params, "w": torch.randn(3, 6)}
    with pytest.raises(ValueError, match=r"params at \['w'\]: shape \(3, 6\) does not match"):
        tx.update(grads, state, wrong)
    elsewhere = {**grads, "w": grads["w"].to("meta")}
    with pytest.raises(ValueError, match=r"updates at \['w'\] is on meta"):
        tx.update(elsewhere, state, params)
    with pytest.raises(TypeError, match="flatten: inner: expected a GradientTransformation"):
        ftopt.flatten(ftopt.adam)
