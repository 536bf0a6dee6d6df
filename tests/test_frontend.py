"""Every generated kernel passes Triton's own front end, not only its interpreter.

The interpreter runs a kernel as Python: it accepts code that Triton's compiler refuses
(a name bound to a half block in one branch of a runtime ``if`` and to a whole block in
the other, a constexpr branch that does not type-check). Here each kernel a fused step
launches under the interpreter is compiled again to Triton IR for an NVIDIA target, with
the GPU's tiles as its constexprs, on the CPU (no GPU, no ptxas: the front end only). The
steps cover every fusible registry entry (fp32), the layouts (16-bit params and states,
8-bit with each skip_zeros mode), donated steps, norms and noise.
"""

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
from test_fused import CHAINS, _tree

import ftopt
from ftopt.lowering import launch, tiles
from ftopt.lowering.plan import plan_chain

pytestmark = [pytest.mark.skipif(not tiles.INTERPRETING, reason="the interpreter's launches "
                                 "are what is recorded; a GPU compiles every kernel anyway"),
              pytest.mark.usefixtures("one_thread")]

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
           torch.float64: "fp64", torch.int64: "i64", torch.int32: "i32",
           torch.uint8: "u8", torch.int8: "i8", torch.uint16: "u16", torch.bool: "i1"}


def _record(run) -> list:
    """The (file of the kernel's source, name, args, constants) of every generated kernel
    ``run()`` launches."""
    seen = []
    real = launch._launch

    def spy(kernel, grid, args, constants, device, key=()):
        fn = getattr(kernel, "fn", kernel)
        path = getattr(getattr(fn, "__code__", None), "co_filename", "")
        if os.path.basename(path).startswith("ftopt_"):
            seen.append((path, fn.__name__, list(args), dict(constants)))
        return real(kernel, grid, args, constants, device, key)

    launch._launch = spy
    try:
        run()
    finally:
        launch._launch = real
    return seen


def _signature(names: list[str], args: list, constants: dict) -> tuple[dict, dict]:
    sig, const = {}, {}
    values = dict(zip([n for n in names if n not in constants], args))
    for i, name in enumerate(names):
        if name in constants:
            sig[name] = "constexpr"
            const[(i,)] = constants[name]
            continue
        v = values[name]
        if isinstance(v, torch.Tensor):
            sig[name] = "*" + _DTYPES[v.dtype]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i64" if abs(v) >= 2**31 else "i32"
        else:
            sig[name] = "fp32"
    return sig, const


def _gpu_constants(constants: dict) -> list:
    """The constexprs with the GPU's tile as ``BLOCK`` (``tiles``' GPU defaults: one
    8-bit block a program, else 512)."""
    constants = dict(constants)
    if "QBLOCK" in constants:
        constants["BLOCK"] = max(256, constants["QBLOCK"])
    elif "BLOCK" in constants:
        constants["BLOCK"] = 512
    return sorted(constants.items())


def _compile_all(kernels: dict) -> list[str]:
    """Triton's front end over ``kernels`` in a process where Triton is not interpreted
    (tests/frontend_compile.py); the failures, each with its kernel's name and file."""
    jobs = []
    for (path, name, _), (names, args, constants) in kernels.items():
        sig, _ = _signature(names, args, constants)
        jobs.append({"path": path, "name": name, "signature": sig,
                     "constexprs": [(k, v) for k, v in _gpu_constants(constants)
                                    if k in names]})
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "frontend_compile.py")
    done = subprocess.run([sys.executable, script], input=json.dumps(jobs), text=True,
                          capture_output=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    errors = json.loads(done.stdout)
    return [f"{job['name']} of {job['path']}: {err}" for job, err in zip(jobs, errors)
            if err is not None]


def _steps(tx, dtype=torch.float32, donate=(False, True), zero=True):
    def run():
        gen = torch.Generator().manual_seed(0)
        shapes = {"a": (7, 5), "b": (300,), "c": (5000,)}
        params = _tree(gen, dtype, shapes)
        state = tx.init(params)
        grads = _tree(gen, dtype, shapes)
        if zero:
            grads["c"][:2000] = 0.0
        for d in donate:
            p = {k: v.clone() for k, v in params.items()}
            s = ftopt.tree.map(lambda t: t.clone(), state)
            ftopt.step(tx, p, grads, s, backend="fused", donate=d)
            ftopt.step(tx, p, grads, s, backend="fused", donate=d)
    return run


def _kernels(runs) -> dict:
    found = {}
    for run in runs:
        for path, name, args, constants in _record(run):
            key = (path, name, tuple(sorted(constants.items())))
            names = launch_arg_names(path, name)
            found.setdefault(key, (names, args, constants))
    return found


def launch_arg_names(path: str, name: str) -> list[str]:
    """The parameter names of kernel ``name`` in the generated source at ``path``."""
    source = open(path).read()
    head = source[source.index(f"def {name}("):]
    params = head[head.index("(") + 1:head.index("):")]
    return [p.split(":")[0].strip() for p in params.split(",") if p.strip()]


LAYOUTS = {
    "bf16 params": (torch.bfloat16, {}),
    "bf16 states": (torch.bfloat16, {"state_dtype": torch.bfloat16}),
    "bf16 states, stochastic": (torch.float32, {"state_dtype": torch.bfloat16,
                                                "state_rounding": "stochastic"}),
    "fp16 states": (torch.float32, {"state_dtype": torch.float16}),
    "8-bit": (torch.float32, {"state_bits": 8}),
}
MODES = ["in_place", "select", "stores", "tiles", "chunks", "split+defer"]
OTHERS = [lambda: ftopt.noisy_sgd(1e-2),
          lambda: ftopt.chain(ftopt.clip_by_global_norm(1.0), ftopt.adamw(1e-2)),
          lambda: ftopt.lamb(1e-2, state_bits=8),
          lambda: ftopt.novograd(1e-2, skip_zeros=True),
          lambda: ftopt.prodigy(1.0, state_bits=8),
          lambda: ftopt.schedule_free_adamw(1e-2, state_bits=8),
          lambda: ftopt.lion(1e-3, state_dtype=torch.bfloat16, state_rounding="stochastic")]


def _layout_run(layout: str, mode: str):
    dtype, kw = LAYOUTS[layout]
    key = ("8-bit" if "state_bits" in kw else "16-bit states" if "state_dtype" in kw
           else "16-bit")

    def run():
        old = tiles.SKIP_MODES[key]
        tiles.SKIP_MODES[key] = mode
        try:
            _steps(ftopt.adam(1e-2, skip_zeros=True, **kw), dtype)()
        finally:
            tiles.SKIP_MODES[key] = old
    return run


def _span_run(layout: str):
    """Adam with skip_zeros on ``layout``, the programs of its "split" main kernel four
    blocks each (``tiles.SPANS``)."""
    dtype, kw = LAYOUTS[layout]
    key = ("8-bit" if "state_bits" in kw else "16-bit states" if "state_dtype" in kw
           else "16-bit")

    def run():
        old = dict(tiles.SPANS), tiles.SKIP_MODES[key]
        tiles.SPANS[key] = 4
        tiles.SKIP_MODES[key] = "split+defer" if key == "8-bit" else "split+in_place"
        try:
            _steps(ftopt.adam(1e-2, skip_zeros=True, **kw), dtype)()
        finally:
            tiles.SPANS.clear()
            tiles.SPANS.update(old[0])
            tiles.SKIP_MODES[key] = old[1]
    return run


def test_every_generated_kernel_passes_the_front_end():
    """Every fusible registry entry (fp32, donated), Adam on each layout with each
    skip_zeros mode (and in-place programs of several blocks), norms, noise and running
    scalars: each kernel they launch compiles to Triton IR with the GPU's tiles."""
    runs = [_steps(CHAINS[e.name](), donate=(True,), zero=False)
            for e in registry.fusible()]
    runs += [_layout_run(layout, mode) for layout in LAYOUTS for mode in MODES]
    runs += [_span_run(layout) for layout in ("bf16 params", "bf16 states", "8-bit")]
    runs += [_steps(make()) for make in OTHERS]
    kernels = _kernels(runs)
    assert len(kernels) > 50
    failures = _compile_all(kernels)
    assert not failures, "\n\n".join(failures)


def test_the_front_end_refuses_what_the_interpreter_runs(tmp_path):
    """The check can fail: a helper binding one name to a half block in one branch of a
    runtime ``if`` and to a whole block in the other runs in the interpreter and is
    refused by Triton's compiler."""
    path = tmp_path / "ftopt_bad.py"
    path.write_text(
        "import triton\nimport triton.language as tl\n\n\n"
        "@triton.jit\ndef ftopt_main(x_ptr, n, BLOCK: tl.constexpr):\n"
        "    offs = tl.arange(0, BLOCK)\n"
        "    if n > 0:\n"
        "        half = tl.arange(0, BLOCK // 2).to(tl.float32)\n"
        "        value = tl.interleave(half, half)\n"
        "    else:\n"
        "        half = offs.to(tl.float32)\n"
        "        value = half\n"
        "    tl.store(x_ptr + offs, value)\n")
    x = torch.zeros(8)
    failures = _compile_all({(str(path), "ftopt_main", ()): (
        ["x_ptr", "n", "BLOCK"], [x, 3], {"BLOCK": 8})})
    assert len(failures) == 1 and "half" in failures[0]


@pytest.mark.parametrize("convert", [False, True])
def test_the_bf16_store_passes_the_front_end(tmp_path, convert):
    """The bf16 state store's lines (rounding to nearest even by integer operations, or
    by the conversion instruction) compile, in full and masked blocks."""
    from ftopt.lowering import lanes

    body = ["offs = tl.arange(0, BLOCK)", "x = tl.load(x_ptr + offs)"]
    body += lanes.bf16_store_lines("y_ptr", "m", "x * 2.0", "", convert=convert)
    body += lanes.bf16_store_lines("y_ptr", "v", "x", ", mask=offs < n", "x", convert)
    # (the NaN's old bits from the loaded 16-bit word)
    body += lanes.half_load_lines("z", "tl.load(y_ptr + offs)", torch.bfloat16, True)
    body += lanes.bf16_store_lines("y_ptr", "w", "z * x", ", mask=offs < n", "z", convert,
                                   raw=True)
    path = tmp_path / "ftopt_bf16.py"
    path.write_text("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
                    "def ftopt_main(x_ptr, y_ptr, n, BLOCK: tl.constexpr):\n"
                    + "".join(f"    {line}\n" for line in body))
    x, y = torch.zeros(8), torch.zeros(8, dtype=torch.uint16)
    failures = _compile_all({(str(path), "ftopt_main", ()): (
        ["x_ptr", "y_ptr", "n", "BLOCK"], [x, y, 3], {"BLOCK": 512})})
    assert not failures, failures


def test_the_reduction_sums_pass_the_front_end():
    """The fixed kernels of the reduction passes (a leaf's partials; a global column over
    the leaves' rows, in the leaves' order) compile for a GPU."""
    from ftopt.lowering import reductions

    path = reductions.__file__
    f32, i64 = torch.zeros(8), torch.zeros(8, dtype=torch.int64)
    failures = _compile_all({
        (path, "_global_sums", ()): (
            ["rows_ptr", "row_of_ptr", "cols_ptr", "out_ptr", "N_LEAVES", "N_RED",
             "R_BLOCK"], [f32, i64, i64, f32], {"N_LEAVES": 5, "N_RED": 4, "R_BLOCK": 1024}),
        (path, "_leaf_sums", ()): (
            ["partials_ptr", "first_block_ptr", "num_blocks_ptr", "cols_ptr", "out_ptr",
             "N_PART", "OUT_STRIDE", "R_BLOCK"], [f32, i64, i64, i64, f32],
            {"N_PART": 3, "OUT_STRIDE": 4, "R_BLOCK": 4096})})
    assert not failures, failures


def test_reduction_and_noise_kernels_get_the_heavy_tile(monkeypatch):
    """Kernels with per-program work beyond their elements (a reduction pass and the main
    kernel reading its per-leaf results; noise) run tiles.HEAVY_TILE, the others
    tiles.BLOCK: the work table and every launch of a step agree on it."""
    from ftopt.lowering import tiles

    heavy = (1024, 4) if tiles.BLOCK != 1024 else (2048, 4)
    monkeypatch.setattr(tiles, "HEAVY_TILE", heavy)
    for tx, want in ((ftopt.fromage(1e-2), heavy[0]), (ftopt.noisy_sgd(1e-2), heavy[0]),
                     (ftopt.adam(1e-3), tiles.BLOCK)):
        blocks = {c["BLOCK"] for _, _, c in _kernels([_steps(tx, donate=(True,))]).values()
                  if "BLOCK" in c}
        assert blocks == {want}, (tx, blocks)
    # (the same steps against eager at this tile: FTOPT_HEAVY_TILE in the GPU runs and
    # test_norm_optimizers / test_noise under FTOPT_HEAVY_TILE=1024x4)
    gen = torch.Generator().manual_seed(1)
    p = {"a": torch.randn(3000, generator=gen), "b": torch.randn(7, 5, generator=gen)}
    g = {k: torch.randn(v.shape, generator=gen) for k, v in p.items()}
    for tx in (ftopt.fromage(1e-2), ftopt.lars(1e-2), ftopt.noisy_sgd(1e-2)):
        fused, _ = ftopt.step(tx, p, g, tx.init(p), backend="fused")
        eager, _ = ftopt.step(tx, p, g, tx.init(p), backend="eager")
        for k in p:
            torch.testing.assert_close(fused[k], eager[k], rtol=1e-6, atol=1e-7)


def test_8bit_reduction_passes_get_the_heavy_tile_over_a_table_of_their_own(monkeypatch):
    """An 8-bit group's reduction pass runs tiles.HEAVY_TILE, over a work table of its
    own, where that tile holds whole 8-bit blocks and is larger than the group's (one
    8-bit block a program on a GPU); its main kernel keeps the 8-bit tile. The steps
    equal eager's, and the steps with one tile for both within a norm's rounding."""
    if not {"FTOPT_HEAVY_TILE", "FTOPT_QUANT_TILE", "FTOPT_BLOCK"} & set(os.environ):
        # (the interpreter's defaults, as a GPU's: every run of the suite takes this path)
        assert tiles.HEAVY_TILE[0] > tiles.QUANT_TILE[0]
    quant, heavy = (1024, 4), (4096, 4)
    monkeypatch.setattr(tiles, "QUANT_TILE", quant)

    def fresh():
        launch._constants_cached.cache_clear()
        launch._kernel.cache_clear()

    def run(tx, p, g):
        fresh()
        s = tx.init(p)
        out = []
        for backend in ("fused", "eager"):
            q, t = {k: v.clone() for k, v in p.items()}, ftopt.tree.map(torch.clone, s)
            for _ in range(3):
                q, t = ftopt.step(tx, q, g, t, backend=backend, donate=backend == "fused")
            out.append(q)
        groups = plan_chain(tx).prepared.groups
        return out, [gr.reduce_work is not None for gr in groups if gr.quant_block]

    gen = fresh_generator()
    p = {"big": torch.randn(4 * 4096 + 1000, generator=gen),
         "odd": torch.randn(4096 + 256 + 3, generator=gen),
         "small": torch.randn(7, 5, generator=gen)}
    g = {k: torch.randn(v.shape, generator=gen) for k, v in p.items()}
    g["big"][:3000] = 0.0
    try:
        for make in (lambda: ftopt.lamb(1e-2, state_bits=8),
                     lambda: ftopt.novograd(1e-2, state_bits=8, skip_zeros=True),
                     lambda: ftopt.lars(1e-2, state_bits=8)):
            monkeypatch.setattr(tiles, "HEAVY_TILE", heavy)
            fresh()
            blocks = {}
            for (_, name, _), (_, _, c) in _kernels([_steps(make(), donate=(True,))]).items():
                if "QBLOCK" in c:
                    blocks.setdefault(name, set()).add(c["BLOCK"])
            assert blocks == {"ftopt_reduce_1": {heavy[0]}, "ftopt_main": {quant[0]}}, blocks
            (fused, eager), own = run(make(), p, g)
            assert own == [True]
            monkeypatch.setattr(tiles, "HEAVY_TILE", quant)  # (the control: one table)
            (same, _), own = run(make(), p, g)
            assert own == [False]
            for k in p:
                torch.testing.assert_close(fused[k], eager[k], rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(fused[k], same[k], rtol=1e-6, atol=1e-7)
    finally:
        fresh()


def test_plain_kernels_of_a_layout_get_its_plain_tile(monkeypatch):
    """half_tiles.PLAIN gives the kernels without skip_zeros of a layout their own tile
    with 16-bit params and gradients (16-bit states: 512x2 on a GPU); skip_zeros kernels,
    fp32 params or gradients and other layouts keep theirs (half_tiles.SELECT, where
    set, gives the select kernels').
    At that tile the step equals the step at tiles.BLOCK bit for bit (and eager's within
    a bf16 rounding), and so does skip_zeros' step off the zeros."""
    from ftopt.lowering import half_tiles, tiles

    plain = (1024, 2) if tiles.BLOCK != 1024 else (2048, 2)
    monkeypatch.setattr(half_tiles, "PLAIN", {"16-bit states": (*plain, 0)})
    monkeypatch.setattr(half_tiles, "SELECT", {})
    states = {"state_dtype": torch.bfloat16}
    for tx, dtype, want in ((ftopt.adam(1e-3, **states), torch.bfloat16, {plain[0]}),
                            (ftopt.adam(1e-3, **states), torch.float32, {tiles.BLOCK}),
                            (ftopt.adam(1e-3), torch.bfloat16, {tiles.BLOCK}),
                            (ftopt.adam(1e-3, skip_zeros=True, **states), torch.bfloat16,
                             None)):
        kernels = _kernels([_steps(tx, dtype, donate=(True,))])
        found = {(c["BLOCK"], c.get("num_warps")) for _, _, c in kernels.values()
                 if "BLOCK" in c}
        if want is None:
            assert plain not in found, found
        else:
            assert {b for b, _ in found} == want, (tx, found)
            assert plain in found or want == {tiles.BLOCK}
    # bf16 params with fp32 gradients: the defaults (fp32 loads fill 128 bits at 4 a thread)
    tx = ftopt.adam(1e-3, **states)
    p16 = {"a": torch.randn(5000).bfloat16()}

    def mixed():
        ftopt.step(tx, p16, {"a": torch.randn(5000)}, tx.init(p16), backend="fused")
    assert {c["BLOCK"] for _, _, _, c in _record(mixed) if "BLOCK" in c} == {tiles.BLOCK}
    gen = torch.Generator().manual_seed(3)
    p = {"a": torch.randn(3000, generator=gen).bfloat16(),
         "b": torch.randn(7, 5, generator=gen).bfloat16()}
    g = {k: torch.randn(v.shape, generator=gen).bfloat16() for k, v in p.items()}
    g["a"][::3] = 0.0
    g["b"][1] = 0.0
    tx, skip = ftopt.adam(1e-2, **states), ftopt.adam(1e-2, skip_zeros=True, **states)
    state = tx.init(p)
    first = {k: v + 1.0 for k, v in g.items()}  # (m, v != 0 where g is zero next)
    state = ftopt.step(tx, p, first, state)[1]
    skip_state = ftopt.step(skip, p, first, skip.init(p))[1]
    fused, fused_state = ftopt.step(tx, p, g, state, backend="fused")
    eager, _ = ftopt.step(tx, p, g, state, backend="eager")
    skipped, _ = ftopt.step(skip, p, g, skip_state, backend="fused")
    monkeypatch.setattr(half_tiles, "PLAIN", {})
    block, block_state = ftopt.step(tx, p, g, state, backend="fused")
    for k in p:
        assert torch.equal(fused[k], block[k]), k
        torch.testing.assert_close(fused[k].float(), eager[k].float(), rtol=2**-7, atol=0)
        on = g[k] != 0
        assert torch.equal(skipped[k][on], fused[k][on]), k
        assert torch.equal(skipped[k][~on], p[k][~on]), k
        assert not torch.equal(fused[k][~on], p[k][~on]), k  # the control
    for a, b in zip(ftopt.tree.leaves(fused_state), ftopt.tree.leaves(block_state)):
        assert torch.equal(a, b)


def test_volatile_loads_of_a_layout_load_its_streams_volatile(monkeypatch):
    """half_tiles.VOLATILE makes the loads of params, gradients and states volatile in
    the plain or the select kernels of a layout over 16-bit params and gradients (not
    the per-leaf tables', nor in-place kernels, nor with fp32 params, nor the other
    kind's), and the step keeps
    its bits: off the zeros the same as without, on them skip_zeros' (the control: the
    step without skip_zeros moves them)."""
    from ftopt.lowering import half_tiles, lanes

    assert lanes.volatile_loads("x = tl.load(st0_mu_in + offs, mask=in_range, other=0.0)"
                                ) == ("x = tl.load(st0_mu_in + offs, mask=in_range, "
                                      "other=0.0, volatile=True)")
    for kept in ("n = tl.load(numel_ptr + leaf)", "a = tl.load(g_addr_ptr + leaf).to(t)",
                 "c = tl.load(count0_in_ptr) + 1"):
        assert lanes.volatile_loads(kept) == kept
    states = {"state_dtype": torch.bfloat16}

    def volatile(on: dict, tx, dtype) -> list[bool]:
        """Per kernel the steps launch: all of its stream loads volatile (else none);
        in-place kernels (masked on ``keep``) never."""
        monkeypatch.setattr(half_tiles, "VOLATILE", {k: frozenset(v) for k, v in on.items()})
        for cache in (launch._kernel, launch._constants_cached):
            cache.cache_clear()
        out = []
        for path, _, _ in _kernels([_steps(tx, dtype, donate=(True,))]):
            body = open(path).read()
            streams = len(re.findall(r"tl\.load\((?:g_ptr|p_ptr|st\d+_\w+_in) \+ offs", body))
            marked = body.count("volatile=True")
            assert streams >= 4 and marked in (0, streams), (marked, streams)
            assert not (marked and "keep = " in body)
            in_place.append("keep = " in body)
            out.append(marked > 0)
        return out

    plain, skip = ftopt.adam(1e-3, **states), ftopt.adam(1e-3, skip_zeros=True, **states)
    in_place: list = []
    kinds = {"plain": ["16-bit states"], "select": []}
    assert volatile(kinds, plain, torch.bfloat16) == [True]
    assert not any(volatile(kinds, skip, torch.bfloat16))
    assert not any(volatile(kinds, plain, torch.float32))
    assert not any(volatile(kinds, ftopt.adam(1e-3), torch.bfloat16))
    kinds = {"plain": [], "select": ["16-bit states"]}
    in_place.clear()
    assert volatile(kinds, skip, torch.bfloat16) == [not x for x in in_place]
    assert set(in_place) == {False, True}  # (a select kernel and an in-place one)
    assert volatile(kinds, plain, torch.bfloat16) == [False]
    gen = fresh_generator()
    p = {"a": torch.randn(3000, generator=gen).bfloat16(),
         "b": torch.randn(7, 5, generator=gen).bfloat16()}
    g = {k: torch.randn(v.shape, generator=gen).bfloat16() for k, v in p.items()}
    g["a"][::3] = 0.0
    first = {k: v + 1.0 for k, v in g.items()}  # (m, v != 0 where g is zero next)
    out = {}
    for on in ("16-bit states", ""):
        monkeypatch.setattr(half_tiles, "VOLATILE", {"plain": frozenset({on} - {""}),
                                                     "select": frozenset({on} - {""})})
        for cache in (launch._kernel, launch._constants_cached):
            cache.cache_clear()
        for name, tx in (("plain", ftopt.adam(1e-2, **states)),
                         ("skip", ftopt.adam(1e-2, skip_zeros=True, **states))):
            state = ftopt.step(tx, p, first, tx.init(p), backend="fused")[1]
            out[on, name] = ftopt.step(tx, p, g, state, backend="fused")
    for name in ("plain", "skip"):
        for a, b in zip(*(ftopt.tree.leaves(out[on, name]) for on in ("16-bit states", ""))):
            assert torch.equal(a, b), name
    (plain_p, _), (skip_p, _) = out["16-bit states", "plain"], out["16-bit states", "skip"]
    for k in p:
        on = g[k] != 0
        assert torch.equal(skip_p[k][on], plain_p[k][on]), k
        assert torch.equal(skip_p[k][~on], p[k][~on]), k
        assert not torch.equal(plain_p[k][~on], p[k][~on]) or on.all(), k  # the control


def test_half_tiles_route_by_kernel_kind_and_param_width(monkeypatch):
    """tiles.tile and tiles.skip_maxnreg take half_tiles' entries for 16-bit params only:
    PLAIN's for kernels without skip_zeros, SELECT's for select kernels; in-place, heavy
    (norms) and indexed (noise) kernels keep their own."""
    from types import SimpleNamespace

    from ftopt.lowering import half_tiles, tiles

    monkeypatch.setattr(half_tiles, "PLAIN", {"16-bit states": (512, 2, 72)})
    monkeypatch.setattr(half_tiles, "SELECT", {"16-bit states": (256, 2, 80)})
    monkeypatch.setattr(tiles, "SELECT_MAXNREG", {"16-bit states": 40})

    def traced(skips, in_place=False, levels=0):
        return SimpleNamespace(skips=skips, in_place=in_place, levels=levels, stages=[])

    kind = "16-bit states"
    plain, select = traced([False]), traced([True])
    assert tiles.tile(plain, 0, kind, 2) == (512, 2)
    assert tiles.skip_maxnreg(plain, kind, 2) == 72
    assert tiles.tile(select, 0, kind, 2) == (256, 2)
    assert tiles.skip_maxnreg(select, kind, 2) == 80
    # fp32 params: the defaults
    assert tiles.tile(plain, 0, kind, 4) == (tiles.BLOCK, tiles.NUM_WARPS)
    assert tiles.skip_maxnreg(plain, kind, 4) is None
    assert tiles.tile(select, 0, kind, 4) == (tiles.BLOCK, tiles.NUM_WARPS)
    assert tiles.skip_maxnreg(select, kind, 4) == 40
    assert tiles.tile(plain, 0, "16-bit", 2) == (tiles.BLOCK, tiles.NUM_WARPS)
    in_place = traced([True], in_place=True)
    assert tiles.tile(in_place, 0, kind, 2) == tiles.IN_PLACE_TILES.get(
        kind, tiles.IN_PLACE_TILE)
    assert tiles.tile(traced([False], levels=1), 0, kind, 2) == tiles.HEAVY_TILE
    assert tiles.skip_maxnreg(traced([True], levels=1), kind, 2) == 40


def test_fast_math_layouts_take_the_approximate_instructions(monkeypatch):
    """A layout in tiles.FAST_MATH gets approximate sqrt and division in its main kernel
    (which pass the front end), the others keep the correctly rounded ones; an 8-bit
    encoder keeps its correctly rounded division (its codes must equal eager's). Results
    stay within the contract."""
    from ftopt.lowering import tiles

    monkeypatch.setattr(tiles, "FAST_MATH",
                        frozenset({"16-bit states", "16-bit", "8-bit"}))
    cases = ((ftopt.adam(1e-3, state_dtype=torch.bfloat16), torch.float32, True),
             (ftopt.adam(1e-3), torch.bfloat16, True),
             (ftopt.adam(1e-3), torch.float32, False),
             (ftopt.adam(1e-3, state_bits=8), torch.float32, True))
    for tx, dtype, fast in cases:
        kernels = _kernels([_steps(tx, dtype, donate=(True,))])
        mains = [open(path).read() for (path, name, _) in kernels if name == "ftopt_main"]
        assert mains
        for src in mains:
            body = src.split("pid = tl.program_id(0)", 1)[1]
            update = "\n".join(x for x in body.splitlines()
                               if not x.lstrip().startswith("q_"))
            # (8-bit Adam's leaves below min_size keep fp32 states: the "fp32" layout)
            want = fast and ("qmap" in body or tx is not cases[-1][0])
            assert ("tl.fdiv(" in body and "ftopt_fast_sqrt(" in body) == want, (tx, dtype)
            assert ("tl.div_rn(" in update or "tl.sqrt_rn(" in update) != want, (tx, dtype)
            if "qmap" in body:
                assert "tl.div_rn(" in body  # (the encoder's)
        assert ("qmap" in "".join(mains)) == (tx is cases[-1][0])
        if fast:
            assert not _compile_all(kernels)
    gen = torch.Generator().manual_seed(2)
    p = {"w": torch.randn(3000, generator=gen).to(torch.bfloat16)}
    g = {"w": torch.randn(3000, generator=gen).to(torch.bfloat16)}
    tx = ftopt.adam(1e-2, state_dtype=torch.bfloat16)
    s = tx.init(p)
    for _ in range(3):
        (pf, sf), (pe, se) = (ftopt.step(tx, p, g, s, backend=b) for b in ("fused", "eager"))
        # (one bf16 ulp: the interpreter truncates where a GPU rounds to nearest)
        torch.testing.assert_close(pf["w"].float(), pe["w"].float(), rtol=2 ** -7, atol=0)
        p, s = pe, se
