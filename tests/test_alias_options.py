"""The keyword-only options every alias takes (SPEC §4): ``skip_zeros``, ``state_bits`` and
``state_dtype``, with one signature, one check and one way to finish the chain."""

from __future__ import annotations

import inspect
import typing

import pytest
import torch

import ftopt
from ftopt.alias import chain_alias
from tests.registry import TRANSFORMS

ALIASES = sorted({e.exported for e in TRANSFORMS if e.kind == "alias"})
OPTIONS = [("skip_zeros", False), ("state_bits", 32), ("state_dtype", None)]


@pytest.mark.parametrize("name", ALIASES)
def test_every_alias_takes_the_options(name):
    alias = getattr(ftopt, name)
    params = inspect.signature(alias).parameters
    assert [(n, params[n].default) for n, _ in OPTIONS] == OPTIONS
    # state_dtype may come earlier, as optax's schedule_free_adamw has it
    assert params["skip_zeros"].kind == params["state_bits"].kind == inspect.Parameter.KEYWORD_ONLY
    hints = typing.get_type_hints(alias)
    assert hints["state_dtype"] == (torch.dtype | None)
    assert hints["return"] is ftopt.GradientTransformation


@pytest.mark.parametrize("name", ALIASES)
def test_every_alias_checks_state_bits_by_its_name(name):
    entry = next(e for e in TRANSFORMS if e.exported == name and e.kind == "alias")
    with pytest.raises(ValueError, match=f"^{name}: state_bits must be 8 or 32, got 16"):
        entry.make(**entry.defaults(), state_bits=16)
    with pytest.raises(ValueError, match=f"^{name}: state_dtype"):
        entry.make(**entry.defaults(), state_dtype=torch.int8)


def test_chain_alias_finishes_the_chain():
    @chain_alias
    def plain_sgd(learning_rate: float) -> list[ftopt.GradientTransformation]:
        """Doc."""
        return [ftopt.scale_by_learning_rate(learning_rate)]

    assert plain_sgd.__name__ == "plain_sgd" and plain_sgd.__doc__ == "Doc."
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(5, 3, generator=gen)}
    grads = {"w": torch.randn(5, 3, generator=gen)}
    grads["w"][0] = 0.0
    tx = plain_sgd(0.1, skip_zeros=True, state_bits=8)
    expected = ftopt.quantize_states(
        ftopt.chain(ftopt.scale_by_learning_rate(0.1), ftopt.skip_zeros()), bits=8)
    got, _ = ftopt.step(tx, params, grads, tx.init(params), backend="eager")
    want, _ = ftopt.step(expected, params, grads, expected.init(params), backend="eager")
    torch.testing.assert_close(got["w"], want["w"], rtol=0, atol=0)
    assert torch.equal(got["w"][0], params["w"][0])
    with pytest.raises(ValueError, match="^plain_sgd: state_bits must be 8 or 32"):
        plain_sgd(0.1, state_bits=4)


def test_chain_alias_refuses_a_build_that_names_an_option():
    def clash(learning_rate: float, *, skip_zeros: bool = False) -> list:
        return []

    with pytest.raises(TypeError, match="clash: chain_alias adds \\['skip_zeros'\\]"):
        chain_alias(clash)
