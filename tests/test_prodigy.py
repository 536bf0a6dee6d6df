"""Prodigy's state storage: ``state_bits=8`` and ``state_dtype`` store m, v and s (SPEC §5
for the 8-bit codes, one rounding per store for bf16/fp16), params0 stays in the params'
dtype; a step is the 32-bit step from the state as read, stored as asked, on the eager and
the fused backend alike; a checkpoint continues bit-identically; a state of the wrong
format is refused naming its path. (The registry's 8-bit and state_dtype suites run it too,
params0 as a ``wide_states`` slot; these tests pin the step from the state as read.)
"""

from __future__ import annotations

import io

import optree
import pytest
import torch

import ftopt
from ftopt.quant import dequantize_blockwise, dynamic_map, quantize_blockwise
from ftopt.rules import QuantizedSlot

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = {"w": (64, 80), "b": (70,)}  # w: 5120 elements, 8-bit; b: below min_size
SIGNED = {"exp_avg": True, "exp_avg_sq": False, "grad_sum": True}
HP = dict(learning_rate=5.0, betas=(0.8, 0.9), eps=1e-3, estim_lr0=1e-3, weight_decay=0.05)

pytestmark = pytest.mark.usefixtures("one_thread")


def _tree(gen: torch.Generator) -> dict:
    return {k: torch.randn(s, generator=gen).to(DEVICE) for k, s in SHAPES.items()}


def _grads(params: dict, gen: torch.Generator) -> dict:
    """Each element's sign the same at every step, so that the estimate grows."""
    out = {}
    for k, p in params.items():
        sign = 1.0 - 2.0 * (torch.arange(p.numel()) % 2).reshape(p.shape)
        out[k] = (sign * (0.1 + torch.rand(p.shape, generator=gen))).to(DEVICE)
    return out


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({torch.float32: torch.int32, torch.bfloat16: torch.int16,
                   torch.float16: torch.int16}.get(x.dtype, x.dtype))


def _equal(a, b) -> bool:
    fa, sa = optree.tree_flatten(a, namespace="ftopt")
    fb, sb = optree.tree_flatten(b, namespace="ftopt")
    return sa == sb and all(x.dtype == y.dtype and torch.equal(_bits(x), _bits(y))
                            for x, y in zip(fa, fb))


def _read(state, block: int = 256):
    """The 32-bit state a step reads: codes dequantized, 16-bit storage upcast."""
    (st,) = state

    def read(name, leaf):
        if isinstance(leaf, QuantizedSlot):
            return dequantize_blockwise(leaf.codes, leaf.absmax,
                                        dynamic_map(SIGNED[name], leaf.codes.device), block)
        return leaf.float()

    slots = {name: {k: read(name, x) for k, x in getattr(st, name).items()} for name in SIGNED}
    return (st._replace(**slots),)


def _stored(new32, like):
    """``new32`` stored as ``like`` is: re-encoded per block, or rounded to its dtype."""
    (st,), (old,) = new32, like

    def store(name, x, prev):
        if isinstance(prev, QuantizedSlot):
            return QuantizedSlot(*quantize_blockwise(x, dynamic_map(SIGNED[name], x.device)))
        return x.to(prev.dtype)

    slots = {name: {k: store(name, x, getattr(old, name)[k])
                    for k, x in getattr(st, name).items()} for name in SIGNED}
    return (st._replace(**slots),)


STORAGE = [pytest.param(dict(state_bits=8), id="8bit"),
           pytest.param(dict(state_dtype=torch.bfloat16), id="bf16"),
           pytest.param(dict(state_dtype=torch.float16), id="fp16")]


@pytest.mark.parametrize("storage", STORAGE)
def test_layout_and_one_step(storage):
    gen = torch.Generator().manual_seed(7)
    tx = ftopt.prodigy(**HP, **storage)
    params = _tree(gen)
    state = tx.init(params)
    (st,) = state
    for k in SHAPES:
        assert st.params0[k].dtype == torch.float32 and torch.equal(st.params0[k], params[k])
        for name in SIGNED:
            leaf = getattr(st, name)[k]
            if "state_bits" in storage:
                assert isinstance(leaf, QuantizedSlot) == (k == "w"), (name, k)
            else:
                assert leaf.dtype == storage["state_dtype"], (name, k)
    for _ in range(3):
        params, state = ftopt.step(tx, params, _grads(params, gen), state, backend="eager")
    assert float(state[0].estim_lr) > HP["estim_lr0"]  # the estimate moved

    grads = _grads(params, gen)
    new_p, new_s = ftopt.step(tx, params, grads, state, backend="eager")
    # The 32-bit step from the state as read, then stored as asked.
    ref_p, ref_s = ftopt.step(ftopt.prodigy(**HP), params, grads, _read(state),
                              backend="eager")
    assert _equal(new_p, ref_p)
    assert _equal(new_s, _stored(ref_s, state))
    # The fused backend (one rule: reduction pass and main kernel) within SPEC §6: its fp32
    # arithmetic rounds differently (fp32 hyperparameters, 1 - b1 in fp32), so not bit for bit.
    fused_p, fused_s = ftopt.step(tx, params, grads, state, backend="fused")
    _assert_contract(fused_p, new_p, fused_s, new_s)


def _assert_contract(fused_p, eager_p, fused_s, eager_s) -> None:
    """Fused vs eager from the same inputs, SPEC §6: fp32 relative 1e-6 (of the leaf's
    largest magnitude); 16-bit states one ulp of their dtype; 8-bit codes at most one code
    apart, absmax relative 1e-6; E, num and the count as fp32 values."""
    for k in SHAPES:
        _close(fused_p[k], eager_p[k], 1e-6, f"params {k}")
    (f,), (e,) = fused_s, eager_s
    assert torch.equal(f.count, e.count)
    for name in ("estim_lr", "numerator_weighted"):
        _close(getattr(f, name), getattr(e, name), 1e-6, name)
    for name in (*SIGNED, "params0"):
        for k in SHAPES:
            x, y = getattr(f, name)[k], getattr(e, name)[k]
            assert type(x) is type(y), (name, k)
            if isinstance(x, QuantizedSlot):
                _close(x.absmax, y.absmax, 1e-6, f"{name} {k} absmax")
                assert int((x.codes.int() - y.codes.int()).abs().max()) <= 1, (name, k)
            elif x.dtype in (torch.bfloat16, torch.float16):
                assert x.dtype == y.dtype, (name, k)
                tol = torch.finfo(x.dtype).eps * y.float().abs() + 1e-6 * y.float().abs().max()
                assert bool(((x.float() - y.float()).abs() <= tol).all()), (name, k)
            else:
                _close(x, y, 1e-6, f"{name} {k}")


def _close(x: torch.Tensor, y: torch.Tensor, rtol: float, what: str) -> None:
    assert x.dtype == y.dtype and x.shape == y.shape, what
    err = float((x.double() - y.double()).abs().max() / y.double().abs().max().clamp_min(1e-30))
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol}"


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_8bit_checkpoint_continues_bit_identically(backend):
    gen = torch.Generator().manual_seed(8)
    tx = ftopt.prodigy(**HP, state_bits=8)
    params = _tree(gen)
    state = tx.init(params)
    params, state = ftopt.step(tx, params, _grads(params, gen), state, backend=backend)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert _equal(loaded, state)
    grads = _grads(params, gen)
    assert _equal(ftopt.step(tx, params, grads, loaded, backend=backend),
                  ftopt.step(tx, params, grads, state, backend=backend))


def test_a_state_of_the_other_format_is_refused():
    gen = torch.Generator().manual_seed(9)
    params = _tree(gen)
    grads = _grads(params, gen)
    state32 = ftopt.prodigy(**HP).init(params)
    state8 = ftopt.prodigy(**HP, state_bits=8).init(params)
    before = optree.tree_map(torch.clone, (params, state32), namespace="ftopt")
    with pytest.raises(ValueError, match=r"state exp_avg at \['w'\].*32-bit state"):
        ftopt.prodigy(**HP, state_bits=8).update(grads, state32, params)
    with pytest.raises(ValueError, match=r"state exp_avg at \['w'\].*8-bit state"):
        ftopt.prodigy(**HP).update(grads, state8, params)
    assert _equal(before, (params, state32))
