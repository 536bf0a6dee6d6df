"""skip_zeros' selects on the stored 16-bit words (``ftopt.lowering.word_selects``): the
select kernels over 16-bit params and states store the loaded word where the gradient is
zero, bit for bit what selecting the widened values stored: zeros, NaN params, states
and gradients, two steps."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import registry
import torch
from step_checks import fresh_generator

import ftopt
from ftopt.lowering import codegen, half_tiles, lanes, launch, word_selects

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
bf16, fp16 = torch.bfloat16, torch.float16


def _clear_launch_caches() -> None:
    for cache in (launch._kernel, launch._constants_cached):
        cache.cache_clear()


@pytest.mark.parametrize("convert,packed", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("opt", ["adam", "lion", "madgrad"])
@pytest.mark.parametrize("p_dtype,state_dtype,rounding", [
    (bf16, bf16, "nearest"), (bf16, fp16, "nearest"), (fp16, bf16, "nearest"),
    (fp16, fp16, "nearest"), (bf16, bf16, "stochastic")])
def test_word_selects_keep_the_bits_of_value_selects(monkeypatch, p_dtype, state_dtype,
                                                     rounding, opt, convert, packed):
    """(Stochastic rounding's kernels, which read the element's index, only with
    "indexed" in ``FTOPT_SELECT_WORDS``; ``packed``: the words picked in pairs,
    ``FTOPT_PACKED_WORDS``.)"""
    monkeypatch.setattr(lanes, "BF16_CONVERT", convert)
    indexed = {"indexed"} if rounding == "stochastic" else set()
    monkeypatch.setattr(word_selects, "PACKED",
                        frozenset({"16-bit states"} | indexed) if packed else frozenset())
    gen = fresh_generator()
    seed = gen.initial_seed()

    def tree() -> dict:
        return {"a": torch.randn(3000, generator=gen).to(DEVICE, p_dtype),
                "b": torch.randn(4096 + 700, generator=gen).to(DEVICE, p_dtype)}

    params, first, grads = tree(), tree(), tree()
    grads["a"][::3] = 0.0
    grads["b"][:1000] = 0.0
    params["a"][3] = float("nan")  # (a NaN param where the gradient is zero, and not)
    params["a"][4] = float("nan")
    first["a"][6] = float("nan")  # (NaN states, kept where the next gradient is zero)
    grads["a"][7] = float("nan")
    sources: list = []
    real = codegen.compile_source

    def spy(source: str, name: str):
        sources.append(source)
        return real(source, name)

    def run(words: frozenset) -> list:
        monkeypatch.setattr(half_tiles, "WORDS", words)
        _clear_launch_caches()
        sources.clear()
        monkeypatch.setattr(codegen, "compile_source", spy)
        if opt == "madgrad":  # (one stage: no select of its own keeps ``zero`` in use)
            tx = ftopt.quantize_states(
                ftopt.chain(ftopt.scale_by_madgrad(1e-2), ftopt.skip_zeros()),
                bits=32, state_dtype=state_dtype, state_rounding=rounding)
        else:
            tx = getattr(ftopt, opt)(1e-2, state_dtype=state_dtype, state_rounding=rounding,
                                     skip_zeros=True)
        s0 = tx.init(params)
        p1, s1 = ftopt.step(tx, params, first, s0, backend="fused")
        p2, s2 = ftopt.step(tx, p1, grads, s1, backend="fused")
        monkeypatch.setattr(codegen, "compile_source", real)
        return ftopt.tree.leaves((p1, s1)), ftopt.tree.leaves((p2, s2))

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1).view(torch.uint8)

    def words_in(sources: list) -> list:
        stored = (r"tl\.where\(zero[^,]*, st\d+_\w+_old_raw|"
                  r"ftopt_keep_\w+\(nz, .*, st\d+_\w+_old_raw, ")
        return [s for s in sources if re.search(stored, s)]

    before = run(frozenset())
    assert sources and not words_in(sources)
    if rounding == "stochastic":
        run(frozenset({"16-bit states"}))
        assert sources and not words_in(sources)
    after = run(frozenset({"16-bit states"} | indexed))
    # (the words took effect, on the states and the param, picked in pairs or not)
    stored = words_in(sources)
    p_word = r"ftopt_keep_\w+16\(nz, .*, p_raw, " if packed else r"tl\.where\(zero \| \("
    assert stored and any(re.search(p_word, s) and "p_raw" in s for s in stored)
    assert all(bool(re.search(r"= ftopt_nonzero_words\(g_raw\)", s)) == packed for s in stored)
    # (the param's value passes through no skip select: its word is stored where zero)
    assert not any("tl.where(zero, neg_zero" in s for s in stored)
    for step_before, step_after in zip(before, after):
        for a, b in zip(step_before, step_after):
            assert a.dtype == b.dtype and torch.equal(bits(a), bits(b)), f"seed {seed}"
    # skip_zeros: the second step keeps the bytes of the first where the gradient is zero
    # (the NaN param at 3, the NaN states at 6 included); the control: params move off it.
    zero = {v.numel(): (v == 0).reshape(-1) for v in grads.values()}
    for k, (x, y) in enumerate(zip(*after)):
        if x.numel() not in zero:
            continue  # (a step count)
        z = zero[x.numel()]
        x, y = x.reshape(-1), y.reshape(-1)
        assert torch.equal(bits(x[z]), bits(y[z])), f"leaf {k}, seed {seed}"
        if k < 2:
            assert not torch.equal(x[~z], y[~z])
    state_a = next(x for x in after[1][2:] if x.numel() == 3000)
    assert torch.isnan(after[1][0][3]) and torch.isnan(state_a[6])

def test_word_selects_leave_other_kernels_alone(monkeypatch):
    """fp32 params, no skip_zeros, or fp32 states: no word select."""
    sources: list = []
    real = codegen.compile_source

    def spy(source: str, name: str):
        sources.append(source)
        return real(source, name)

    monkeypatch.setattr(codegen, "compile_source", spy)
    _clear_launch_caches()
    for p_dtype, kw in ((torch.float32, {"state_dtype": bf16, "skip_zeros": True}),
                        (bf16, {"state_dtype": bf16}), (bf16, {"skip_zeros": True})):
        p = {"w": torch.randn(3000).to(DEVICE, p_dtype)}
        tx = ftopt.adam(1e-2, **kw)
        ftopt.step(tx, p, p, tx.init(p), backend="fused")
    assert sources and not any("_old_raw, b_st" in s or "), p_raw," in s
                               or "ftopt_pick_words" in s for s in sources)
    _clear_launch_caches()


FUSIBLE = registry.names(e for e in registry.eight_bit() if e in registry.fusible())


def _one_stage(name: str) -> ftopt.GradientTransformation:
    """The entry over bf16 states with skip_zeros, as one stage where it is not an alias
    (no learning-rate stage after it: the moved selects may be the only readers of the
    zero mask)."""
    e = registry.BY_NAME[name]
    if e.kind == "alias":
        return registry.standalone(name, state_dtype=bf16, skip_zeros=True)
    hp = e.defaults()
    if e.kind == "combinator" and "inner" not in hp:
        hp["inner"] = [registry.BY_NAME[n].make(**registry.BY_NAME[n].defaults())
                       for n in e.inner]
    return ftopt.quantize_states(ftopt.chain(e.make(**hp), ftopt.skip_zeros()), bits=32,
                                 state_dtype=bf16)


@pytest.mark.parametrize("name", FUSIBLE)
def test_every_entry_steps_as_with_value_selects(monkeypatch, name):
    """Every registry entry with per-element float states, over bf16 params and states
    with skip_zeros: the same bits with the word selects as without, two steps, and the
    params where the gradient is zero kept."""
    gen = fresh_generator()
    seed = gen.initial_seed()

    def tree() -> dict:
        return {"a": torch.randn(3000, generator=gen).to(DEVICE, bf16),
                "b": torch.randn(37, 11, generator=gen).to(DEVICE, bf16)}

    params, first, grads = tree(), tree(), tree()
    grads["a"][::3] = 0.0
    grads["b"][:5] = 0.0

    def run(words: frozenset) -> list:
        monkeypatch.setattr(half_tiles, "WORDS", words)
        _clear_launch_caches()
        tx = _one_stage(name)
        p1, s1 = ftopt.step(tx, params, first, tx.init(params), backend="fused")
        p2, s2 = ftopt.step(tx, p1, grads, s1, backend="fused")
        return [p1, *ftopt.tree.leaves((p2, s2))]

    before, after = run(frozenset()), run(frozenset({"16-bit states"}))
    for a, b in zip(before[1:], after[1:]):
        assert a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                                  b.reshape(-1).view(torch.uint8)), seed
    for k, g in grads.items():
        zero = g == 0
        assert torch.equal(after[0][k][zero].view(torch.int16),
                           after[1 + list(grads).index(k)][zero].view(torch.int16)), seed
    _clear_launch_caches()


@pytest.mark.parametrize("on", [("16-bit states",), ("16-bit states", "indexed")])
def test_indexed_takes_stochastic_roundings_select_kernels(monkeypatch, on):
    """"indexed" in a layout list (``FTOPT_SELECT_VOLATILE``, ``FTOPT_SELECT_WORDS``)
    adds the select kernels of stochastic rounding, which read the element's index; the
    step keeps its bits."""
    sources: list = []
    real = codegen.compile_source

    def spy(source: str, name: str):
        sources.append(source)
        return real(source, name)

    gen = fresh_generator()
    params = {"w": torch.randn(3000, generator=gen).to(DEVICE, bf16)}
    grads = {"w": torch.randn(3000, generator=gen).to(DEVICE, bf16)}
    grads["w"][::4] = 0.0
    out = []
    for volatile, words in ((frozenset(), frozenset()), (frozenset(on), frozenset(on))):
        monkeypatch.setattr(half_tiles, "VOLATILE", {"plain": frozenset(), "select": volatile})
        monkeypatch.setattr(half_tiles, "WORDS", words)
        _clear_launch_caches()
        sources.clear()
        monkeypatch.setattr(codegen, "compile_source", spy)
        tx = ftopt.adam(1e-2, state_dtype=bf16, state_rounding="stochastic", skip_zeros=True)
        p, s = ftopt.step(tx, params, grads, tx.init(params), backend="fused")
        monkeypatch.setattr(codegen, "compile_source", real)
        out.append(ftopt.tree.leaves((p, s)))
    selects = [s for s in sources if "zero = g == 0.0" in s and "keep = " not in s]
    assert selects
    indexed = "indexed" in on
    assert all(("volatile=True" in s) == indexed for s in selects)
    assert all(bool(re.search(r"tl\.where\(zero, st\d+_\w+_old_raw", s)) == indexed
               for s in selects)
    for a, b in zip(*out):
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    _clear_launch_caches()


def _run_ptx(text: str, args: list[int]) -> int:
    """The 32-bit result ``$0`` of the inline PTX ``text`` (``and``, ``add``, ``prmt``,
    ``lop3`` on ``.b32``/``.u32`` registers and immediates) for the operands ``$1``..."""
    regs = {f"${i + 1}": a for i, a in enumerate(args)}
    body = text.replace("{", " ").replace("}", " ")
    for statement in filter(None, (x.strip() for x in body.split(";"))):
        op, _, rest = statement.partition(" ")
        if op.startswith(".reg"):
            continue
        dst, *srcs = [x.strip() for x in rest.split(",")]
        v = [regs[x] if x in regs else int(x, 0) for x in srcs]
        kind = op.split(".")[0]
        if kind == "and":
            out = v[0] & v[1]
        elif kind == "add":
            out = (v[0] + v[1]) & 0xFFFFFFFF
        elif kind == "prmt":  # bytes of {b, a}; a selector nibble's bit 3: the sign byte
            pool = (v[1] << 32) | v[0]
            out = 0
            for i in range(4):
                nib = (v[2] >> (4 * i)) & 0xF
                byte = (pool >> (8 * (nib & 7))) & 0xFF
                out |= ((0xFF if byte & 0x80 else 0) if nib & 8 else byte) << (8 * i)
        elif kind == "lop3":  # bit i of the table at (a << 2 | b << 1 | c)
            out = 0
            for bit in range(32):
                a, b, c = ((x >> bit) & 1 for x in v[:3])
                out |= ((v[3] >> (a << 2 | b << 1 | c)) & 1) << bit
        else:
            raise AssertionError(f"no model of {op}")
        regs[dst] = out
    return regs["$0"]


def _asm(helper: str) -> str:
    """The PTX string of each inline_asm_elementwise call in ``helper``'s source."""
    calls = re.findall(r"inline_asm_elementwise\(\s*((?:\"[^\"]*\"\s*)+)", helper)
    return ["".join(re.findall(r'"([^"]*)"', c)) for c in calls]


def test_packed_picks_ptx_model_over_every_word():
    """The NVIDIA helpers' PTX, run by a model of its instructions: the mask is 0xFFFF
    exactly where a 16-bit float's word is not +-0 (every word, in either half of the
    pair, beside a word of each kind), and the pick is new there, old elsewhere."""
    mask_asm, pick_asm, *_ = _asm(word_selects.HELPERS["ptx"])
    gen = fresh_generator()
    words = list(range(1 << 16))
    others = torch.randint(0, 1 << 16, (len(words),), generator=gen).tolist()
    for i, (w, o) in enumerate(zip(words, others)):
        o = (0, 0x8000, 1, o)[i % 4]  # (beside +0, -0, the smallest denormal, any)
        for lo, hi in ((w, o), (o, w)):
            nz = _run_ptx(mask_asm, [lo | hi << 16])
            want = (0xFFFF if lo & 0x7FFF else 0) | (0xFFFF0000 if hi & 0x7FFF else 0)
            assert nz == want, (hex(lo), hex(hi), hex(nz))
    for _ in range(200):
        nz, new, old = torch.randint(0, 1 << 16, (3, 2), generator=gen).tolist()
        nz = [0xFFFF * (x & 1) for x in nz]
        pack = [a | b << 16 for a, b in (nz, new, old)]
        want = [n if m else o for m, n, o in zip(nz, new, old)]
        assert _run_ptx(pick_asm, pack) == want[0] | want[1] << 16
    # (the model can fail: a mask that forgets the sign bit marks -0 as non-zero)
    wrong = mask_asm.replace("0x7FFF7FFF;", "0xFFFFFFFF;", 1)
    assert _run_ptx(wrong, [0x8000]) != 0


def _is_nan(word: int, kind: str) -> bool:
    return (word & 0x7FFF) > (0x7C00 if kind == "fp16" else 0x7F80)


@pytest.mark.parametrize("kind", ["state_bf16", "bf16", "fp16"])
def test_packed_keeps_ptx_model(kind):
    """The NVIDIA helpers that pick a stored pair and keep a NaN's bits, run by the model
    of their PTX, against the rule they replace (``ftopt.numerics.keep_nan_bits``): where
    the gradient is zero the old word; a NaN over a NaN the old word; a bf16 state's NaN
    over a number 0x7FC0; else the new word. Every pair of words of each kind (zeros,
    infinities, NaNs at the edges of their range, numbers), in either half, and random
    words."""
    asm = _asm(word_selects._KEEPS["ptx"][f"ftopt_keep_{kind}"])[0]
    half = "fp16" if kind == "fp16" else "bf16"
    inf = 0x7C00 if half == "fp16" else 0x7F80
    special = [0, 0x8000, 1, 0x3C00, 0xBF80, 0x7BFF, 0x7F7F, inf, inf | 0x8000, inf + 1,
               (inf + 1) | 0x8000, 0x7FC0, 0x7E00, 0x7FFF, 0xFFFF, 0x7C01, 0x7F81]
    gen = fresh_generator()
    rand = torch.randint(0, 1 << 16, (400,), generator=gen).tolist()

    def want(nz: int, new: int, old: int) -> int:
        if not nz:
            return old
        if _is_nan(new, half):
            return old if _is_nan(old, half) else (0x7FC0 if kind == "state_bf16" else new)
        return new

    cases = [(nz, a, b) for nz in (0, 0xFFFF) for a in special for b in special]
    cases += [(0xFFFF * (r & 1), r, q) for r, q in zip(rand, rand[1:] + rand[:1])]
    for i, (nz, new, old) in enumerate(cases):
        o_nz, o_new, o_old = cases[(i * 7 + 3) % len(cases)]  # (the other half)
        got = _run_ptx(asm, [nz | o_nz << 16, new | o_new << 16, old | o_old << 16])
        assert got == want(nz, new, old) | want(o_nz, o_new, o_old) << 16, (
            kind, hex(nz), hex(new), hex(old), hex(got))
    # (the model can fail: a NaN test one above the infinity marks it as a NaN)
    wrong = asm.replace("0x007F007F" if half == "bf16" else "0x03FF03FF",
                        "0x00800080" if half == "bf16" else "0x04000400")
    assert _run_ptx(wrong, [0xFFFF, inf, 0x7FC0]) != _run_ptx(asm, [0xFFFF, inf, 0x7FC0])


_COMPILE = """
import importlib.util, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
spec = importlib.util.spec_from_file_location("ftopt_packed", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
out = []
for block, warps in ((512, 2), (64, 2)):
    src = triton.compiler.ASTSource(
        fn=module.ftopt_main, constexprs={"BLOCK": block},
        signature={"g_ptr": "*bf16", "a_ptr": "*u16", "b_ptr": "*u16", "BLOCK": "constexpr"})
    sass = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps}).asm["sass"]
    out.append(re.findall(r"\\b(LOP3|PRMT|SEL|FSEL|ISETP|FSETP|HSETP2)\\b", sass))
print(json.dumps(out))
"""


def test_packed_picks_compile_for_an_nvidia_gpu(tmp_path):
    """The NVIDIA helpers through Triton's whole pipeline and ptxas for sm_90 (in a
    process where Triton is not interpreted), at 8 and at 1 element a thread: ``lop3``
    and byte permutes, no compare or select an element."""
    path = tmp_path / "ftopt_packed.py"
    path.write_text(
        "import triton\nimport triton.language as tl\n\n\n" + word_selects.HELPERS["ptx"]
        + "\n\n@triton.jit\ndef ftopt_main(g_ptr, a_ptr, b_ptr, BLOCK: tl.constexpr):\n"
        "    offs = tl.arange(0, BLOCK)\n"
        "    nz = ftopt_nonzero_words(tl.load(g_ptr + offs))\n"
        "    b = tl.load(b_ptr + offs)\n"
        "    a = ftopt_pick_words(nz, b, tl.load(a_ptr + offs))\n"
        "    x = b.to(tl.bfloat16, bitcast=True).to(tl.float32)\n"
        "    a = ftopt_keep_state_bf16(nz, b, a, x, x)\n"
        "    a = ftopt_keep_bf16(nz, b, a, x, x)\n"
        "    a = ftopt_keep_fp16(nz, b, a, x, x)\n"
        "    tl.store(a_ptr + offs, a)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE, str(path)], text=True,
                          capture_output=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for ops in json.loads(done.stdout):
        assert "LOP3" in ops and "PRMT" in ops, ops
        assert not {"SEL", "FSEL", "FSETP", "HSETP2"} & set(ops), ops
