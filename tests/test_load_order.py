"""The main kernel of fp32 and 16-bit states issues every load before the arithmetic
(``tiles.LOADS_FIRST``): a state read by a later stage of the chain is not loaded after
the earlier stages' correctly rounded divisions and square roots, whose branches the load
would wait on (H200: optimistic_adam_v2 ran at 0.34 of the copy bandwidth that way).
Checked on the generated source; what the kernels compute is the fused suites' job."""

from __future__ import annotations

import pytest
import torch

import ftopt
from ftopt.lowering import codegen, tiles
from ftopt.lowering.plan import plan_chain

F32, BF16 = torch.float32, torch.bfloat16


def _optimistic_rms(skip: bool = False):
    parts = [ftopt.scale_by_rms(), ftopt.scale_by_optimistic_gradient(),
             ftopt.scale_by_learning_rate(1e-3)]
    return ftopt.chain(*parts, *([ftopt.skip_zeros()] if skip else []))


CHAINS = {
    "optimistic_adam_v2": lambda: ftopt.optimistic_adam_v2(1e-3),
    "rms+optimistic": _optimistic_rms,
    "rms+optimistic, skip_zeros": lambda: _optimistic_rms(True),
    "adam, trace": lambda: ftopt.chain(ftopt.scale_by_adam(), ftopt.trace(0.9),
                                       ftopt.scale_by_learning_rate(1e-3)),
}


def _bodies(tx, donate: bool = True, quant_block: int = 0, slot_dtypes: tuple = ()):
    """The generated main kernel's lines, cut into its bodies (full block, tail, ...) at
    each line that loads the gradient."""
    traced = plan_chain(tx).traced(donate, "p")
    variant = codegen.Variant(F32, F32, True, True, quant_block, slot_dtypes=slot_dtypes)
    bodies: list[list[str]] = []
    for line in codegen.main_source(traced, variant).splitlines():
        if line.lstrip().startswith("g = tl.load("):
            bodies.append([])
        if bodies:
            bodies[-1].append(line)
    return bodies


def _last_state_load_and_first_rounding(body: list[str]) -> tuple[int, int]:
    # (a 16-bit state's word loads as ``{slot}_old_raw``, widened beside as ``{slot}_old``)
    loads = [i for i, x in enumerate(body)
             if ("_old = " in x or "_old_raw = " in x) and "tl.load(" in x]
    math = [i for i, x in enumerate(body) if "tl.div_rn(" in x or "tl.sqrt_rn(" in x]
    assert loads and math, body
    return max(loads), min(math)


@pytest.mark.parametrize("name", list(CHAINS))
@pytest.mark.parametrize("donate", [True, False])
def test_every_state_load_comes_before_the_arithmetic(name, donate, monkeypatch):
    bodies = _bodies(CHAINS[name](), donate)
    assert bodies
    for body in bodies:
        load, math = _last_state_load_and_first_rounding(body)
        assert load < math, "\n".join(body)
    monkeypatch.setattr(tiles, "LOADS_FIRST", False)  # the control: the chain's order
    late = [_last_state_load_and_first_rounding(b) for b in _bodies(CHAINS[name](), donate)]
    assert any(load > math for load, math in late)


def test_16_bit_states_load_first_too():
    tx = ftopt.optimistic_adam_v2(1e-3)
    slots = tuple((f"st{i}_{n}", BF16) for i, n in ((0, "mu"), (0, "nu"),
                                                     (1, "previous_gradient")))
    for body in _bodies(tx, slot_dtypes=slots):
        load, math = _last_state_load_and_first_rounding(body)
        assert load < math
        assert any("<< 16" in x for x in body[:math])  # read exactly as bf16


def test_8_bit_kernels_keep_their_order(monkeypatch):
    """8-bit code loads are placed by ``quantized.hoisted`` (the setting slowed 8-bit
    Adam by 13% on the H200): the setting leaves their source as it is."""
    tx = ftopt.optimistic_adam_v2(1e-3)
    first = _bodies(tx, quant_block=256)
    monkeypatch.setattr(tiles, "LOADS_FIRST", False)
    assert _bodies(tx, quant_block=256) == first
