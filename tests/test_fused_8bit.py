"""The fused backend against the eager one with 8-bit states (under TRITON_INTERPRET=1 on
the CPU): every fusible entry of the test registry with 8-bit states, codes included, and
skip_zeros keeping the bytes of a skipped block. The chains, trees and tolerances are
``tests/test_fused.py``'s. A file of its own: the parallel suite hands out whole files,
and on a GPU each half compiles for minutes, so the two halves run side by side."""

from __future__ import annotations

import pytest
import registry
import torch
from test_fused import CHAINS, QUANT_SHAPES, _rel_err, _tree

import ftopt

pytestmark = pytest.mark.usefixtures("one_thread")

# QUANT_FULL's chains run on test_fused.QUANT_SHAPES for 3 steps; the other registry
# entries on fewer blocks and steps (the interpreter and the eager 8-bit steps cost per
# block and step): min_size 256, a partial last block in each quantized leaf, 2 steps (the
# second reads the first's 8-bit state).
QUANT_FULL = {"adamw", "lion", "sgd[momentum]", "rmsprop", "ademamix", "bnb_lamb"}
QUANT_SMALL = {"small": (3, 5), "big": (12, 130), "odd_big": (517,)}


# Every fusible registry entry with 8-bit states, and a chain of several transforms.
QUANT_NAMES = [*registry.names(e for e in registry.fusible() if e.eight_bit), "bnb_lamb"]


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("name", QUANT_NAMES)
def test_fused_8bit_matches_eager(name, skip):
    """8-bit states: the fused step equals the eager one, codes included."""
    full = name in QUANT_FULL
    shapes, min_size, steps = (QUANT_SHAPES, 4096, 3) if full else (QUANT_SMALL, 256, 2)
    tx = ftopt.quantize_states(CHAINS[name](), bits=8, min_size=min_size)
    if skip:
        tx = ftopt.skip_zeros(tx)
    gen = torch.Generator().manual_seed(9)
    params = _tree(gen, torch.float32, shapes)
    state_e = state_f = tx.init(params)
    params_e = params_f = params
    for _ in range(steps):
        grads = _tree(gen, torch.float32, shapes)
        grads["big"][:7] = 0.0  # two whole blocks and a few elements of a third
        grads["big"][9, :70] = 0.0
        params_e, state_e = ftopt.step(tx, params_e, grads, state_e, backend="eager")
        before = {k: v.clone() for k, v in params_f.items()}
        params_f, state_f = ftopt.step(tx, params_f, grads, state_f, backend="fused")
        if skip:
            z = grads["big"] == 0
            assert torch.equal(params_f["big"][z], before["big"][z])
    # The backends round the state update differently in the last bit (torch.lerp fuses a
    # multiply-add on the CPU); a state that lands next to a code boundary may then take
    # the neighbouring code, moving its element by one quantization step.
    for k in params:
        assert _rel_err(params_f[k], params_e[k]) <= 2e-4, k
    leaves_e, leaves_f = ftopt.tree.leaves(state_e), ftopt.tree.leaves(state_f)
    codes = [(a, b) for a, b in zip(leaves_e, leaves_f) if a.dtype == torch.uint8]
    assert codes and all((a != b).float().mean() < 1e-3 for a, b in codes)


def test_fused_8bit_skipped_blocks_keep_their_bytes():
    tx = ftopt.adam(0.01, skip_zeros=True, state_bits=8)
    gen = torch.Generator().manual_seed(10)
    params = _tree(gen, torch.float32, QUANT_SHAPES)
    state = tx.init(params)
    params, state = ftopt.step(tx, params, _tree(gen, torch.float32, QUANT_SHAPES), state,
                               backend="fused")
    grads = _tree(gen, torch.float32, QUANT_SHAPES)
    grads["big"].view(-1)[256:768] = 0.0  # quantization blocks 1 and 2
    mu_before = state[0].mu["big"]
    mu_codes, mu_absmax = mu_before.codes.clone(), mu_before.absmax.clone()
    _, new_state = ftopt.step(tx, params, grads, state, backend="fused", donate=True)
    mu = new_state[0].mu["big"]
    assert torch.equal(mu.codes.view(-1)[256:768], mu_codes.view(-1)[256:768])
    assert torch.equal(mu.absmax[1:3], mu_absmax[1:3])
    assert not torch.equal(mu.absmax[3:], mu_absmax[3:])  # the control
