"""A donated fused step does not store a slot its rule returns unchanged (Prodigy's
``params0``, MADGRAD's ``x0``): the kernel writes over its input, which already holds
those bytes. A step that is not donated writes every slot to its new tensors, so its
state never shares the caller's. Checked on the generated source, on the steps (fused
within SPEC §6 of eager, donated bit for bit the non-donated step, 32-bit and 8-bit
states, with and without skip_zeros) and on ``explain``'s bytes, counted by hand."""

from __future__ import annotations

import contextlib
import io
import re

import pytest
import torch

import ftopt
from ftopt import tree as tree_lib
from ftopt.lowering import codegen
from ftopt.lowering.plan import plan_chain
from ftopt.rules import QuantizedSlot

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = {"w": (64, 80), "b": (70,)}  # w: 5120 elements, 8-bit at min_size 4096
F32 = torch.float32

pytestmark = pytest.mark.usefixtures("one_thread")


def _prodigy(bits: int = 32, skip: bool = False):
    return ftopt.prodigy(1.0, betas=(0.8, 0.9), eps=1e-3, estim_lr0=1e-3, weight_decay=0.05,
                         state_bits=bits, skip_zeros=skip)


def _madgrad(bits: int = 32, skip: bool = False):
    return ftopt.madgrad(5e-2, momentum=0.8, state_bits=bits, skip_zeros=skip)


TXS = {"prodigy": (_prodigy, "params0"), "madgrad": (_madgrad, "x0")}


def _source(tx, donate: bool, quant_block: int = 0) -> list[str]:
    traced = plan_chain(tx).traced(donate, "p")
    variant = codegen.Variant(F32, F32, True, True, quant_block)
    return codegen.main_source(traced, variant).splitlines()


@pytest.mark.parametrize("bits", [32, 8])
def test_prodigy_donated_main_kernel_neither_loads_nor_stores_params0(bits):
    """params0 is read by the norm pass (Σ g·(x0 − p)) only: the donated main kernel has
    no access to it; the non-donated one copies it to the new state."""
    block = 256 if bits == 8 else 0
    donated = "\n".join(_source(_prodigy(bits), True, block))
    plain = "\n".join(_source(_prodigy(bits), False, block))
    assert "tl.store(st0_params0_out" in plain and "st0_params0_old = tl.load(" in plain
    assert "st0_params0_out" not in donated and "st0_params0_old" not in donated
    for name in ("exp_avg", "exp_avg_sq", "grad_sum"):  # the other slots are stored
        assert f"st0_{name}_out" in donated, name


def test_madgrad_donated_main_kernel_loads_x0_but_does_not_store_it():
    donated = "\n".join(_source(_madgrad(), True))
    plain = "\n".join(_source(_madgrad(), False))
    assert re.search(r"st\d_x0_old = tl.load\(", donated)  # z = x0 − s/(∛G + eps)
    assert not re.search(r"st\d_x0_out", donated)
    assert re.search(r"tl.store\(st\d_x0_out", plain)


def test_skip_zeros_selects_no_unchanged_slot():
    """With skip_zeros a slot keeps its old value where the gradient is zero: for a slot
    returned unchanged that select is the old value itself, and no store is left."""
    body = "\n".join(_source(_prodigy(skip=True), True)).split("):\n", 1)[1]
    assert "tl.where(zero, st0_params0_old" not in body
    assert not re.search(r"st0_params0_(old|out)", body)
    plain = "\n".join(_source(_madgrad(skip=True), False))
    assert re.search(r"tl.store\(st(\d)_x0_out \+ offs, \(st\1_x0_old\)", plain)


def _params(gen: torch.Generator) -> dict:
    return {k: torch.randn(s, generator=gen).to(DEVICE) for k, s in SHAPES.items()}


def _grads(gen: torch.Generator, zeros: bool) -> dict:
    out = {}
    for k, s in SHAPES.items():
        sign = 1.0 - 2.0 * (torch.arange(torch.Size(s).numel()) % 2).reshape(s)
        g = sign * (0.1 + torch.rand(s, generator=gen))
        if zeros:
            g = torch.where(torch.rand(s, generator=gen) < 0.3, 0.0, g)
        out[k] = g.to(DEVICE)
    return out


def _slot(state, name: str) -> dict:
    """The slot ``name`` of the chain state's stage that has it."""
    (found,) = [getattr(st, name) for st in state if hasattr(st, name)]
    return found


def _tensors(state) -> list[torch.Tensor]:
    return [t for t in tree_lib.leaves(state) if isinstance(t, torch.Tensor)]


def _bits_equal(a, b) -> bool:
    xs, ys = _tensors(a), _tensors(b)
    return len(xs) == len(ys) and all(x.dtype == y.dtype and x.shape == y.shape
                                      and torch.equal(x, y) for x, y in zip(xs, ys))


def _close(x: torch.Tensor, y: torch.Tensor, what: str) -> None:
    """SPEC §6 between fused and eager: fp32 relative 1e-6 of the leaf's largest value
    (2e-6: Prodigy's estimate feeds back through its global sums), 8-bit codes one code
    apart, counts equal."""
    assert x.dtype == y.dtype and x.shape == y.shape, what
    if x.dtype == torch.uint8:
        assert int((x.int() - y.int()).abs().max()) <= 1, what
        return
    if not x.dtype.is_floating_point:
        assert torch.equal(x, y), what
        return
    x, y = x.double().cpu(), y.double().cpu()
    err = float((x - y).abs().max() / y.abs().max().clamp_min(1e-30))
    assert err <= 2e-6, f"{what}: relative error {err:.3g}"


@pytest.mark.parametrize("skip", [False, True], ids=["dense", "skip_zeros"])
@pytest.mark.parametrize("bits", [32, 8])
@pytest.mark.parametrize("name", list(TXS))
def test_donated_steps_match_plain_steps_bit_for_bit_and_eager(name, bits, skip):
    make, slot = TXS[name]
    tx = make(bits, skip)
    gen = torch.Generator().manual_seed(5 + bits + skip)
    start = _params(gen)
    pd, pp = ({k: v.clone() for k, v in start.items()} for _ in range(2))
    sd, sp = tx.init(pd), tx.init(pp)
    if bits == 8:
        moment = _slot(sd, "s" if name == "madgrad" else "exp_avg")
        assert isinstance(moment["w"], QuantizedSlot), "not an 8-bit state"
    copy0 = _slot(sd, slot)
    held = {k: v.clone() for k, v in copy0.items()}
    for _ in range(3):
        g = _grads(gen, zeros=skip)
        old_plain = {k: v.clone() for k, v in _slot(sp, slot).items()}
        inputs = _tensors(sp)
        pd, sd = ftopt.step(tx, pd, g, sd, backend="fused", donate=True)
        new_p, new_s = ftopt.step(tx, pp, g, sp, backend="fused")
        # Not donated: the new copy holds the values in tensors of its own.
        for k, v in _slot(new_s, slot).items():
            assert torch.equal(v, old_plain[k]), k
            assert all(v.data_ptr() != t.data_ptr() for t in inputs), k
        eager_p, eager_s = ftopt.step(tx, pp, g, sp, backend="eager")
        for k in SHAPES:
            _close(new_p[k], eager_p[k], f"params {k}")
        fused_leaves, eager_leaves = _tensors(new_s), _tensors(eager_s)
        assert len(fused_leaves) == len(eager_leaves)
        for j, (x, y) in enumerate(zip(fused_leaves, eager_leaves)):
            _close(x, y, f"state leaf {j}")
        pp, sp = new_p, new_s
        assert _bits_equal(pd, pp) and _bits_equal(sd, sp)
    for k, v in _slot(sd, slot).items():  # donated: the same tensors, as they were
        assert v is copy0[k] and torch.equal(v, held[k]), k


def _per_element(text: str) -> tuple[float, float, float]:
    m = re.search(r"main kernel reads ([0-9.]+), writes ([0-9.]+)"
                  r"(?:; norm passes read ([0-9.]+) more)?", text)
    assert m, text
    return float(m.group(1)), float(m.group(2)), float(m.group(3) or 0)


Q = 1 + 4 / 256  # an 8-bit slot: a code and its share of the block's absmax


@pytest.mark.parametrize("name, bits, donate, want", [
    # Prodigy: g, p, m, v, s, params0 read; p, m, v, s, params0 written; the norm pass reads
    # g, p, params0 (Σ g·(x0 − p)) and s (Σ|s|). Donated: params0 only in the norm pass.
    ("prodigy", 32, False, (24, 20, 16)),
    ("prodigy", 32, True, (20, 16, 16)),
    ("prodigy", 8, False, (8 + 3 * Q + 4, 4 + 3 * Q + 4, 12 + Q)),
    ("prodigy", 8, True, (8 + 3 * Q, 4 + 3 * Q, 12 + Q)),
    # MADGRAD: g, p, G, s, x0 read; p, G, s, x0 written (x0 fp32 in 8-bit groups too).
    # Donated: x0 still read (z = x0 − s/(∛G + eps)), not written.
    ("madgrad", 32, False, (20, 16, 0)),
    ("madgrad", 32, True, (20, 12, 0)),
    ("madgrad", 8, False, (12 + 2 * Q, 8 + 2 * Q, 0)),
    ("madgrad", 8, True, (12 + 2 * Q, 4 + 2 * Q, 0)),
])
def test_explain_counts_the_bytes_the_kernels_move(name, bits, donate, want):
    params = {"w": torch.randn(64, 80, generator=torch.Generator().manual_seed(3)).to(DEVICE)}
    with contextlib.redirect_stdout(io.StringIO()):
        text = str(ftopt.explain(TXS[name][0](bits), params, donate=donate,
                                 backend="fused"))
    assert _per_element(text) == pytest.approx(want, abs=1e-3), text
