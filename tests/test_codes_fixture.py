"""Old 8-bit checkpoints keep continuing: codes recorded by an earlier encoder.

``tests/data/codes_v1.pt`` was written by the table-search encoders (eager
``searchsorted`` and the fused kernel's binary search over the map): the eager codes of
fixed values under both maps, and an 8-bit Adam state (a 520-element leaf: three blocks,
the last partial) after two fused steps with the codes the third fused step gave. Every
encoder must reproduce them exactly. (On a GPU the compiled state update may round its
last bit differently from the interpreter's, fused multiply-adds, so a state next to a code
boundary may take the neighbouring code: there the step test allows 1 code in 500.)
"""

from __future__ import annotations

import os

import pytest
import torch

import ftopt
from ftopt.quant import create_dynamic_map, quantize_blockwise
from ftopt.rules import QuantizedSlot

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FIXTURE = os.path.join(os.path.dirname(__file__), "data", "codes_v1.pt")


@pytest.fixture(scope="module")
def fixture() -> dict:
    data = torch.load(FIXTURE, weights_only=True)
    return {k: v.to(DEVICE) for k, v in data.items()}


def test_fixture_covers_every_decade_and_the_special_values(fixture):
    x = fixture["x"]
    finite = x[torch.isfinite(x) & (x != 0)].abs()
    assert finite.min() < 1e-7 and finite.max() == 1.0
    assert x.isnan().any() and x.isinf().any() and (x == 0).any()
    for key in ("codes_signed", "codes_unsigned"):  # many distinct codes, both halves
        assert fixture[key].unique().numel() > 150


@pytest.mark.parametrize("signed", [True, False])
def test_eager_encoder_reproduces_recorded_codes(fixture, signed):
    x = fixture["x"] if signed else fixture["x"].abs()
    qmap = create_dynamic_map(signed).to(DEVICE)
    codes, absmax = quantize_blockwise(x, qmap)
    name = "signed" if signed else "unsigned"
    assert torch.equal(codes, fixture[f"codes_{name}"])
    assert torch.equal(absmax, fixture[f"absmax_{name}"])


@pytest.mark.parametrize("backend", ["fused", "eager"])
def test_recorded_8bit_adam_state_continues_to_the_recorded_codes(fixture, backend):
    tx = ftopt.quantize_states(ftopt.adam(1e-2), bits=8, min_size=256)
    params = {"w": fixture["p"]}
    state = tx.init(params)
    adam = state[0]._replace(
        count=fixture["count"],
        mu={"w": QuantizedSlot(fixture["mu_codes"], fixture["mu_absmax"])},
        nu={"w": QuantizedSlot(fixture["nu_codes"], fixture["nu_absmax"])})
    state = (adam, *state[1:])
    _, new = ftopt.step(tx, params, {"w": fixture["g"]}, state, backend=backend)
    for slot in ("mu", "nu"):
        got = getattr(new[0], slot)["w"]
        if DEVICE == "cpu":
            assert torch.equal(got.absmax, fixture[f"new_{slot}_absmax"]), slot
        differ = (got.codes != fixture[f"new_{slot}_codes"]).sum().item()
        assert differ <= (0 if DEVICE == "cpu" else got.codes.numel() // 500), slot
        # Not a trivial continuation: the step moved the codes.
        assert not torch.equal(got.codes, fixture[f"{slot}_codes"]), slot
