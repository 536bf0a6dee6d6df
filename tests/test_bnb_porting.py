"""Porting bitsandbytes' Adam state (8-bit blockwise and 32-bit) to ftopt and back.

The bytes map over exactly (codes, absmax, step), both ways; continuing from a ported
state matches continuing the original: after one step within fp32 rounding (both
dequantize the same codes to the same fp32 values and run the same math), after several
steps within the drift of the two libraries' 8-bit rounding (bitsandbytes' CPU encoder
does not always pick the nearest code for values far below the block's absmax); a
round trip through bitsandbytes' format continues as ftopt's own run, bit for bit."""

from __future__ import annotations

import warnings

import optree
import pytest
import torch
from step_checks import ftopt_steps, torch_optimizer_steps

import ftopt
from ftopt.quant import dequantize_blockwise, dynamic_map

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")

pytestmark = pytest.mark.usefixtures("one_thread")

LR, WD, BETAS, EPS = 1e-2, 0.1, (0.9, 0.99), 1e-8
# Not sorted by name: the bitsandbytes index follows the order given. "v" has a partial
# last block; "b" is under min_8bit_size, so both libraries keep its state in fp32.
NAMES = ("w", "v", "b")
SHAPES = ((32, 160), (33, 130), (16,))
WRAPPED = "__bnb_optimizer_quant_state__"


def _setup(seed: int, steps: int):
    gen = torch.Generator().manual_seed(seed)
    params = {n: torch.randn(s, generator=gen) for n, s in zip(NAMES, SHAPES)}
    grads = [{n: torch.randn(s, generator=gen) for n, s in zip(NAMES, SHAPES)}
             for _ in range(steps)]
    return params, grads


def _tx(bits: int = 8):
    return ftopt.adamw(LR, *BETAS, EPS, weight_decay=WD, state_bits=bits)


def _bnb(tensors, bits: int = 8):
    make = bnb.optim.AdamW8bit if bits == 8 else bnb.optim.AdamW32bit
    return make(tensors, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)


def _bnb_steps(opt, tensors, grads):
    torch_optimizer_steps(opt, tensors, NAMES, grads)


def _error(ours: dict, theirs: list) -> float:
    """The largest param difference, relative to the param's largest magnitude."""
    return max(float((ours[n] - t.detach()).abs().max() / t.detach().abs().max())
               for n, t in zip(NAMES, theirs))


def _bnb_run(seed: int, steps: int, bits: int = 8):
    params, grads = _setup(seed, steps)
    tensors = [torch.nn.Parameter(params[n].clone()) for n in NAMES]
    opt = _bnb(tensors, bits)
    return opt, tensors, grads


def test_bnb_bytes_map_over_exactly():
    opt, tensors, grads = _bnb_run(1, 4)
    _bnb_steps(opt, tensors, grads)
    sd = opt.state_dict()
    state = ftopt.from_bnb_state_dict(sd, _tx(), {n: t.detach() for n, t in zip(NAMES, tensors)})
    adam = state[0]
    assert int(adam.count) == 4
    for i, n in enumerate(NAMES[:2]):
        theirs = sd["state"][i][WRAPPED]
        assert torch.equal(adam.mu[n].codes, theirs["state1"])
        assert torch.equal(adam.nu[n].codes, theirs["state2"])
        assert torch.equal(adam.mu[n].absmax, theirs["absmax1"])
        assert torch.equal(adam.nu[n].absmax, theirs["absmax2"])
        assert torch.equal(theirs["qmap1"], dynamic_map(True))  # the maps are one map
        assert adam.mu[n].absmax.abs().sum() > 0
    theirs = sd["state"][2][WRAPPED]
    assert torch.equal(adam.mu["b"], theirs["state1"])
    assert torch.equal(adam.nu["b"], theirs["state2"])
    # And back: the same bytes.
    back = ftopt.to_bnb_state_dict(state, _tx(), {n: t.detach() for n, t in zip(NAMES, tensors)})
    for i in range(3):
        assert back["state"][i]["step"] == 4
        mine, theirs = back["state"][i][WRAPPED], sd["state"][i][WRAPPED]
        assert sorted(mine) == sorted(theirs)
        for key in theirs:
            assert mine[key].dtype == theirs[key].dtype
            assert torch.equal(mine[key], theirs[key]), (i, key)


@pytest.mark.parametrize("bits", [8, 32])
def test_from_bnb_continues_as_bnb(bits):
    opt, tensors, grads = _bnb_run(2, 12, bits)
    _bnb_steps(opt, tensors, grads[:4])
    tx = _tx(bits)
    here = {n: t.detach().clone() for n, t in zip(NAMES, tensors)}
    state = ftopt.from_bnb_state_dict(opt.state_dict(), tx, here)
    one, state_one = ftopt_steps(tx, here, state, grads[4:5])
    _bnb_steps(opt, tensors, grads[4:5])
    assert _error(one, tensors) < 1e-6  # fp32 rounding of the same math
    more, _ = ftopt_steps(tx, one, state_one, grads[5:])
    _bnb_steps(opt, tensors, grads[5:])
    drift = _error(more, tensors)
    assert drift < (3e-3 if bits == 8 else 1e-5)
    # The control: a fresh state does not continue as bitsandbytes.
    fresh, _ = ftopt_steps(tx, here, tx.init(here), grads[4:])
    assert _error(fresh, tensors) > 20 * max(drift, 1e-4)


@pytest.mark.parametrize("bits", [8, 32])
def test_to_bnb_continues_as_ftopt(bits):
    params, grads = _setup(3, 12)
    tx = _tx(bits)
    params, state = ftopt_steps(tx, params, tx.init(params), grads[:4])
    tensors = [torch.nn.Parameter(params[n].clone()) for n in NAMES]
    opt = _bnb(tensors, bits)
    opt.load_state_dict(ftopt.to_bnb_state_dict(state, tx, params))
    _bnb_steps(opt, tensors, grads[4:5])
    one, state = ftopt_steps(tx, params, state, grads[4:5])
    assert _error(one, tensors) < 1e-6
    _bnb_steps(opt, tensors, grads[5:])
    more, _ = ftopt_steps(tx, one, state, grads[5:])
    assert _error(more, tensors) < (3e-3 if bits == 8 else 1e-5)
    assert opt.state[tensors[0]]["step"] == 12


def test_round_trip_continues_bit_for_bit():
    params, grads = _setup(4, 8)
    tx = _tx()
    params, state = ftopt_steps(tx, params, tx.init(params), grads[:3])
    back = ftopt.from_bnb_state_dict(ftopt.to_bnb_state_dict(state, tx, params), tx, params)
    ours, s1 = ftopt_steps(tx, params, state, grads[3:])
    ported, s2 = ftopt_steps(tx, params, back, grads[3:])
    for n in NAMES:
        assert torch.equal(ours[n], ported[n])
    left, right = (optree.tree_leaves(s, namespace="ftopt") for s in (s1, s2))
    assert len(left) == len(right) == 11  # count, 2 x (2 x (codes, absmax) + fp32)
    for a, b in zip(left, right):
        assert torch.equal(a, b)


def test_other_layouts_port_through_fp32_values():
    """A 32-bit ftopt state from 8-bit bitsandbytes state holds bitsandbytes'
    dequantized values; an 8-bit ftopt state from 32-bit bitsandbytes state is their
    quantization; another ftopt block size is re-quantized both ways."""
    opt, tensors, grads = _bnb_run(5, 3)
    _bnb_steps(opt, tensors, grads)
    sd = opt.state_dict()
    here = {n: t.detach() for n, t in zip(NAMES, tensors)}
    wide = ftopt.from_bnb_state_dict(sd, _tx(32), here)[0]
    q = sd["state"][0][WRAPPED]
    assert torch.equal(wide.mu["w"], dequantize_blockwise(q["state1"], q["absmax1"],
                                                          q["qmap1"]))
    assert torch.equal(wide.nu["w"], dequantize_blockwise(q["state2"], q["absmax2"],
                                                          q["qmap2"]))
    small = ftopt.quantize_states(ftopt.adamw(LR, *BETAS, EPS, weight_decay=WD),
                                  block_size=128)
    narrow = ftopt.from_bnb_state_dict(sd, small, here)
    assert narrow[0].mu["w"].absmax.numel() == 40
    again = ftopt.to_bnb_state_dict(narrow, small, here)["state"][0][WRAPPED]
    assert again["absmax1"].shape == q["absmax1"].shape
    value = dequantize_blockwise(again["state1"], again["absmax1"], q["qmap1"])
    exact = dequantize_blockwise(q["state1"], q["absmax1"], q["qmap1"])
    assert (value - exact).abs().max() <= 0.02 * exact.abs().max()


def test_what_cannot_be_ported_names_the_param_and_the_reason():
    opt, tensors, grads = _bnb_run(6, 3)
    _bnb_steps(opt, tensors, grads[:2])
    tensors[1].grad = None
    opt.step()  # param 1 is not stepped: its step count lags
    params = {n: t.detach() for n, t in zip(NAMES, tensors)}
    with pytest.raises(ValueError, match="param 1 has step 2, param 0 has 3"):
        ftopt.from_bnb_state_dict(opt.state_dict(), _tx(), params)
    opt, tensors, grads = _bnb_run(6, 1)
    _bnb_steps(opt, tensors, grads)
    cases = [("unorm_vec", "max_unorm"), ("gnorm_vec", "percentile clipping"),
             ("new_max1", "non-blockwise 8-bit")]
    for key, reason in cases:
        sd = opt.state_dict()
        sd["state"][0][WRAPPED][key] = torch.zeros(1)
        with pytest.raises(ValueError, match=f"param 0: bitsandbytes state '{key}'.*{reason}"):
            ftopt.from_bnb_state_dict(sd, _tx(), params)
    with pytest.raises(ValueError, match="scale_by_lion has no bitsandbytes counterpart"):
        ftopt.from_bnb_state_dict(opt.state_dict(), ftopt.lion(LR), params)
    with pytest.raises(ValueError, match="one scale_by_adam.*found 0"):
        ftopt.from_bnb_state_dict(opt.state_dict(), ftopt.sgd(LR), params)
    sd = opt.state_dict()
    sd["param_groups"][0]["betas"] = (0.9, 0.999, 0.9999)
    with pytest.raises(ValueError, match="param 0: an AdEMAMix group"):
        ftopt.from_bnb_state_dict(sd, _tx(), params)
    sd = opt.state_dict()
    sd["param_groups"][0]["amsgrad"] = True
    with pytest.raises(ValueError, match="param 0: amsgrad=True cannot be ported"):
        ftopt.from_bnb_state_dict(sd, _tx(), params)
    ademamix = bnb.optim.AdEMAMix8bit(tensors, lr=LR, t_alpha=None, t_beta3=None)
    _bnb_steps(ademamix, tensors, grads)
    sd = ademamix.state_dict()
    sd["param_groups"][0]["betas"] = BETAS  # past the group check: the state's shape
    with pytest.raises(ValueError, match=r"param 2: bitsandbytes state 'state1' is \(2, 16\)"):
        ftopt.from_bnb_state_dict(sd, _tx(), params)
    lion = bnb.optim.Lion8bit(tensors, lr=LR)
    _bnb_steps(lion, tensors, grads)
    with pytest.raises(ValueError, match=r"param \d: .*\['state1'\] but no 'state2'.*Lion"):
        ftopt.from_bnb_state_dict(lion.state_dict(), _tx(), params)
    with pytest.raises(ValueError, match="L2"):
        l2 = ftopt.chain(ftopt.add_decayed_weights(WD), ftopt.scale_by_adam(),
                         ftopt.scale_by_learning_rate(LR))
        ftopt.to_bnb_state_dict(l2.init(params), l2, params)
