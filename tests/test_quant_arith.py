"""The fused kernel's arithmetic 8-bit encoder gives the table search's codes, bit for bit.

``ftopt.lowering.quant_tables.arithmetic_codes`` mirrors the generated Triton operation for
operation; it is checked against :func:`ftopt.quant.nearest_code` (``searchsorted`` plus
the float32 neighbour comparison) on both maps, exhaustively over every bf16-representable
value in [-1, 1], every code value, every midpoint between neighbouring codes and its two
float32 neighbours, +-0, denormals and +-1, plus fresh random float32 bit patterns. The
first guess may be moved by a quarter of a code either way without changing any code
(the margin that makes a GPU's rounding of the guess irrelevant). Then the generated
kernel itself (through a chain whose new state is the gradient, or its square) is checked
against the eager encoder on the same values, and the former binary search still agrees.
"""

from __future__ import annotations

import pytest
import torch

import ftopt
from ftopt.lowering import quant_tables, quantized
from ftopt.quant import create_dynamic_map, nearest_code, quantize_blockwise

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAPS = {"signed": True, "unsigned": False}


def _bf16_grid() -> torch.Tensor:
    """Every bf16 value in [-1, 1] (as float32), +-0 and the denormals included."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    x = x.view(torch.bfloat16).float()
    return x[x.abs() <= 1.0]


def _hard_values(qmap: torch.Tensor) -> torch.Tensor:
    mids = (qmap[1:] + qmap[:-1]) / 2
    up, down = torch.tensor(2.0), torch.tensor(-2.0)
    specials = torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 1.1754942e-38,
                             -1.1754942e-38, 1.1754944e-38, 3e-39, 1e-7, -1e-7])
    values = [qmap, torch.nextafter(qmap, up), torch.nextafter(qmap, down), mids,
              torch.nextafter(mids, up), torch.nextafter(mids, down), specials]
    # The decade thresholds and their neighbours.
    decades = torch.tensor([10.0 ** k for k in range(-7, 0)])
    for d in (decades, -decades):
        values += [d, torch.nextafter(d, up), torch.nextafter(d, down)]
    return torch.cat(values).clamp(-1.0, 1.0)


def _random_floats(n: int) -> torch.Tensor:
    bits = torch.randint(-(2**31), 2**31, (n,), dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    return x[x.abs() <= 1.0]  # NaN and |x| > 1 never reach the encoder


@pytest.mark.parametrize(("decade", "wobble"),
                         [("compare", 0.0), ("log2", 0.0), ("log2", 1e-4), ("log2", -1e-4),
                          ("poly", 0.0), ("poly", 6e-5), ("poly", -6e-5)])
@pytest.mark.parametrize("slack", [0.0, 0.25, -0.25])
@pytest.mark.parametrize("name", list(MAPS))
def test_arithmetic_equals_table_search(name, slack, decade, wobble):
    signed = MAPS[name]
    qmap = create_dynamic_map(signed)
    v = torch.cat([_bf16_grid(), _hard_values(qmap), _random_floats(200_000)])
    want = nearest_code(v, qmap).long()
    got = quant_tables.arithmetic_codes(v, qmap, signed, slack, decade, wobble)
    bad = (got != want).nonzero().flatten()[:5]
    assert bad.numel() == 0, [(v[i].item(), got[i].item(), want[i].item()) for i in bad]
    # Every code is hit (the values exercise the whole map).
    assert want.unique().numel() == 256


@pytest.mark.parametrize("name", list(MAPS))
def test_the_margin_is_finite(name):
    """The check above can fail: a guess moved by nearly half a code breaks codes near the
    decade boundaries."""
    signed = MAPS[name]
    qmap = create_dynamic_map(signed)
    v = _hard_values(qmap)
    want = nearest_code(v, qmap).long()
    assert (quant_tables.arithmetic_codes(v, qmap, signed, 0.45) != want).any()


@pytest.mark.parametrize("name", list(MAPS))
def test_the_log2_decade_matters(name):
    """A "log2" decade estimate off by a whole decade far from the thresholds breaks codes:
    the check above with a small wobble can fail."""
    signed = MAPS[name]
    qmap = create_dynamic_map(signed)
    v = _hard_values(qmap)
    want = nearest_code(v, qmap).long()
    got = quant_tables.arithmetic_codes(v, qmap, signed, decade="log2", wobble=0.5)
    assert (got != want).any()


def test_poly_log2_is_within_the_margin_on_every_mantissa():
    """The "poly" encoder's log2 estimate errs by at most 1.1e-4 (3.3e-5 decades, below the
    1e-4 decades the codes are checked to tolerate) on every float32 mantissa, at the
    binade's ends included, and is exact at powers of two; a coarser fit would not be."""
    mantissas = torch.arange(2**23, dtype=torch.int32)
    for exponent in (127, 100, 50):  # (1.0, 2**-27, 2**-77: the error depends on t only)
        a = (mantissas | (exponent << 23)).view(torch.float32)
        err = (quant_tables.poly_log2(a).double() - torch.log2(a.double())).abs().max().item()
        assert err <= 1.1e-4, err
    powers = torch.tensor([2.0 ** k for k in range(-99, 1)])
    assert torch.equal(quant_tables.poly_log2(powers), torch.log2(powers))
    assert err * quant_tables.LOG10_2 < 0.4e-4  # (in decades, against the tested 1e-4)


def _fused_codes(values: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(fused codes, eager codes) of a state that one step sets to ``values``.

    Signed: ``trace(0)`` stores the gradient. Unsigned: ``scale_by_rms(0)`` stores its square,
    so the gradient is ``sqrt(values)`` and the eager side encodes ``g * g``.
    """
    if signed:
        tx, grads = ftopt.trace(0.0), values
    else:
        tx, grads = ftopt.scale_by_rms(0.0), values.sqrt()
    tx = ftopt.quantize_states(tx, bits=8, min_size=0)
    params = {"w": torch.zeros_like(grads)}
    _, state = ftopt.step(tx, params, {"w": grads}, tx.init(params), backend="fused")
    slot = state.trace["w"] if signed else state.nu["w"]
    stored = grads if signed else grads * grads
    eager, _ = quantize_blockwise(stored, create_dynamic_map(signed).to(DEVICE))
    return slot.codes, eager


def _kernel_values(signed: bool) -> torch.Tensor:
    """The hard values, bf16 grid and random floats, 1.0 leading each 256-block so that
    every block's absmax is 1 and the kernel encodes the values themselves."""
    qmap = create_dynamic_map(signed)
    v = torch.cat([_hard_values(qmap), _bf16_grid(), _random_floats(20_000)])
    if not signed:
        v = v.abs()
    v = v[torch.randperm(v.numel())]
    blocks = -(-v.numel() // 255)
    body = torch.zeros(blocks * 255)
    body[: v.numel()] = v
    out = torch.cat([torch.ones(blocks, 1), body.view(blocks, 255)], dim=1)
    return out.view(-1)[: v.numel() + blocks].to(DEVICE)


@pytest.mark.parametrize("encoder", quantized.ENCODERS)
@pytest.mark.parametrize("name", list(MAPS))
def test_kernel_encodes_like_eager(name, encoder, monkeypatch):
    monkeypatch.setattr(quantized, "ENCODER", encoder)
    signed = MAPS[name]
    values = _kernel_values(signed)
    if encoder == "search":
        values = values[:4096]  # the former encoder: a smaller check
    fused, eager = _fused_codes(values, signed)
    assert torch.equal(fused, eager)
    assert fused.unique().numel() > 200 if encoder != "search" else True


def _scaled_values(signed: bool, blocks: int = 96) -> torch.Tensor:
    """Blocks led by a random absmax ``m`` (denormal to 1e38) whose other values are
    ``RN(b m)`` for random code boundaries ``b`` and their float32 neighbours up to two
    ulps away: their quotients by ``m`` straddle the boundaries, so a quotient rounded
    otherwise than ``x / m`` changes a code. Some blocks also hold NaN, and +-inf in the
    signed map (the unsigned chain's square of an infinite gradient is NaN, not inf)."""
    gen = torch.Generator().manual_seed(7)
    qmap = create_dynamic_map(signed)
    b = quant_tables.boundaries(qmap)
    exps = torch.randint(-140, 127, (blocks,), generator=gen).double()
    m = (torch.rand(blocks, generator=gen, dtype=torch.float64) + 1.0) * 2.0 ** exps
    m = m.float().clamp_min(1e-44)
    picks = b[torch.randint(0, 255, (blocks, 51), generator=gen)]
    x = (picks.double() * m.double()[:, None]).float()
    up, down = torch.tensor(float("inf")), torch.tensor(-float("inf"))
    near = [x, torch.nextafter(x, up), torch.nextafter(x, down),
            torch.nextafter(torch.nextafter(x, up), up),
            torch.nextafter(torch.nextafter(x, down), down)]
    body = torch.cat(near, dim=1)[:, :255]
    if not signed:
        body = body.abs()
    body[::11, 5] = float("nan")
    if signed:
        body[::7, 3] = float("inf")
        body[::5, 9] = -float("inf")
    out = torch.cat([m[:, None], body.clamp(-m[:, None], None).where(
        body.isnan() | body.isinf(), body.clamp(-m[:, None], m[:, None]))], dim=1)
    return out.reshape(-1).to(DEVICE)


@pytest.mark.parametrize("encoder", quantized.ENCODERS)
@pytest.mark.parametrize("name", list(MAPS))
def test_kernel_divides_like_eager(name, encoder, monkeypatch):
    """The kernel's quotients by the block's absmax round as torch's division (checked
    through the codes, at values whose quotients straddle code boundaries)."""
    monkeypatch.setattr(quantized, "ENCODER", encoder)
    signed = MAPS[name]
    values = _scaled_values(signed)
    fused, eager = _fused_codes(values, signed)
    assert torch.equal(fused, eager)


@pytest.mark.parametrize("encoder", ["poly-rcp", "lg2-rcp"])
@pytest.mark.parametrize("name", list(MAPS))
def test_one_block_programs_encode_like_eager(name, encoder, monkeypatch):
    """Programs of one 256-element block (the GPU tile) quantize their tile flat, not as a
    (blocks, block) view: the same codes and absmax as eager, at boundary-straddling
    quotients and at the hard values, with and without skip_zeros' kept blocks; blocks
    with NaN or +-inf take the path that clamps (the others the all-finite one)."""
    from ftopt.lowering import tiles

    monkeypatch.setattr(tiles, "QUANT_TILE", (256, 1))
    monkeypatch.setattr(quantized, "ENCODER", encoder)
    signed = MAPS[name]
    values = torch.cat([_scaled_values(signed, blocks=24), _kernel_values(signed)[:256 * 24]])
    blocks = values[: values.numel() // 256 * 256].view(-1, 256)
    finite = blocks.isfinite().all(dim=1)
    assert finite.any() and not finite.all()  # both paths of the one-block encoder
    fused, eager = _fused_codes(values, signed)
    assert torch.equal(fused, eager)
    # skip_zeros: blocks whose gradients are all zero keep their codes and absmax.
    tx = ftopt.quantize_states(ftopt.chain(ftopt.trace(0.5), ftopt.skip_zeros()), bits=8,
                               min_size=0)
    gen = torch.Generator().manual_seed(3)
    params = {"w": torch.zeros(256 * 6).to(DEVICE)}
    state = tx.init(params)
    g1 = {"w": torch.randn(256 * 6, generator=gen).to(DEVICE)}
    _, state = ftopt.step(tx, params, g1, state, backend="fused")
    g2 = {"w": torch.randn(256 * 6, generator=gen).to(DEVICE)}
    g2["w"][256:512] = 0.0  # block 1: all zero
    g2["w"][1024:1030] = 0.0  # block 4: partly zero
    _, fused_state = ftopt.step(tx, params, g2, state, backend="fused")
    _, eager_state = ftopt.step(tx, params, g2, state, backend="eager")
    f, e = fused_state[0].trace["w"], eager_state[0].trace["w"]
    old = state[0].trace["w"]
    assert torch.equal(f.codes, e.codes) and torch.equal(f.absmax, e.absmax)
    assert torch.equal(f.codes[256:512], old.codes[256:512])
    assert f.absmax[1] == old.absmax[1] and not torch.equal(f.codes[:256], old.codes[:256])


def test_generated_source_has_one_gather_per_encode():
    """The arithmetic encoder loads the table once per element, "log2" and "poly" also the
    decade's two constants (one cache line); the search ten times. (In each of the two
    versions of the lines: a program of one block, and of several.)"""
    for encoder, loads in (("arithmetic", 1), ("log2", 3), ("log2-rcp", 3), ("poly", 3),
                           ("poly-rcp", 3), ("lg2", 3), ("lg2-rcp", 3), ("search", 10)):
        lines = quantized.store_lines("st0_mu", "st0_mu_old", "x", True, None, False, encoder)
        split = lines.index("else:")
        assert lines[0] == "if BLOCK == QBLOCK:"
        for part in (lines[1:split], lines[split + 1:]):
            assert sum(line.count("tl.load(qmap_signed_ptr") for line in part) == loads


@pytest.mark.parametrize("name", list(MAPS))
def test_boundaries_are_exactly_where_the_upper_code_gets_nearer(name):
    """``boundaries[lo]`` is the first float32 at which the table search's rule
    ``qmap[lo+1] - v < v - qmap[lo]`` holds: it holds there and at the next float32 up,
    and not at the float32 below; the kernel table holds the map, then them."""
    qmap = create_dynamic_map(MAPS[name])
    b = quant_tables.boundaries(qmap)
    q0, q1 = qmap[:-1], qmap[1:]

    def rule(v):
        return (q1 - v) < (v - q0)

    inf = torch.tensor(float("inf"))
    assert torch.isfinite(b).all()
    assert rule(b).all() and rule(torch.nextafter(b, inf)).all()
    assert not rule(torch.nextafter(b, -inf)).any()
    assert ((q0 < b) & (b <= q1)).all()
    table = quant_tables.kernel_table(qmap)
    assert table.shape == (528,) and torch.equal(table[:256], qmap)
    assert torch.equal(table[256:511], b) and table[511] == inf
    _, a_consts, c_consts = quant_tables.guess_constants(MAPS[name])
    assert table[512:519].tolist() == a_consts and table[520:527].tolist() == c_consts


def test_one_block_encoder_takes_the_absmax_from_bits_when_all_finite():
    """The one-block lines of the "-rcp" encoders: an integer max of the magnitudes' bits,
    and the clamping and NaN zeroing only on the branch for non-finite blocks."""
    lines = quantized.store_lines("st0_mu", "st0_mu_old", "x", True, None, False, "lg2-rcp")
    single = lines[1:lines.index("else:")]
    top = next(i for i, line in enumerate(single) if "_top = tl.max(" in line)
    branch = single.index("    if q_st0_mu_top < 2139095040:")
    otherwise = single.index("    else:", branch)
    clamps = [i for i, line in enumerate(single) if "tl.minimum(tl.maximum(q_st0_mu_x" in line]
    assert top < branch < otherwise and clamps and all(i > otherwise for i in clamps)


def test_lg2_decade_is_the_gpu_logarithm_or_numpy_s(monkeypatch):
    """"lg2" kernels call a helper: ``lg2.approx`` (libdevice's ``fast_log2f``) on a GPU,
    numpy's log2 under the interpreter (which runs no libdevice)."""
    from ftopt.lowering import codegen, plan, tiles

    traced = plan.plan_chain(ftopt.adam(1e-3)).traced(False)
    variant = codegen.Variant(torch.float32, torch.float32, False, True, 256,
                              encoder="lg2-rcp")
    for interpreting, call in ((True, "tl.log2("), (False, "libdevice.fast_log2f(")):
        monkeypatch.setattr(tiles, "INTERPRETING", interpreting)
        source = codegen.main_source(traced, variant)
        assert "ftopt_lg2(q_st0_mu_a)" in source and call in source
