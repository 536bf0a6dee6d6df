"""Static instruction counts of the generated kernels, compiled for sm_90 on a CPU.

The 8-bit and noise kernels are bound by their instructions, not by memory
(``benchmarks/RESULTS.md``), and GPU time is scarce. This script runs a donated fused
step of each case under the Triton interpreter, records the kernels it launches (as
``tests/test_frontend.py`` does), compiles each for an H100/H200 (``GPUTarget("cuda",
90, 32)``, the GPU's tiles, warps and register cap, no fma contraction as launched) with
Triton's whole pipeline and the ``ptxas`` it ships, and counts the SASS instructions by
kind: a way to compare two versions of a kernel before timing them on the GPU. Counts
are static: a kernel's full and tail blocks are both counted, loops once. The kernels
are generated with the GPU's bf16 conversions (``FTOPT_BF16_CONVERT=1`` unless set), and
compiled with NVIDIA's helpers in place of the interpreter's (the 8-bit ``lg2``, the
packed picks of ``ftopt.lowering.word_selects``). The
local Triton may be newer than the GPU machine's: for its counts put that version first
on the path (``pip install --target DIR triton==3.6.0``, then ``PYTHONPATH=DIR``); 3.9
and 3.6 give registers up to 8 apart.

    python benchmarks/sass_count.py                       # every case
    python benchmarks/sass_count.py adam8 noisy_sgd       # some
    python benchmarks/sass_count.py --out benchmarks/results/sass_counts   # .md and .json

Prints a table per kernel: instructions in all, per element of a thread's share of the
tile, and by kind (global loads/stores, MUFU, float, integer, shuffles, control).

Hand-edited variants of a kernel, counted as its own (a shape to try before generating
it): ``--edit DIR`` writes each recorded kernel's source to ``DIR/<case>_<kernel>_<i>.py``;
``--sources DIR`` compiles those files (where present) in place of the generated ones,
with the same signature, constants and options; ``--maxnreg N`` sets the register cap of
the kernels that have one (``--cap-all``: of every kernel); ``--tile 512x2`` the tile
of the kernels without 8-bit slots (512x4 by default, whatever tile the GPU gives them).

    python benchmarks/sass_count.py adam8_skip --edit /tmp/k      # then edit /tmp/k/*.py
    python benchmarks/sass_count.py adam8_skip --sources /tmp/k --maxnreg 64 --dump /tmp/s

To time an edited kernel in the real step on a GPU, put it in a folder under the name of
the generated source it replaces (``ftopt_<key>.py``, the source's hash, which ``--edit``
prints beside each file) and run with ``FTOPT_KERNEL_SOURCES=FOLDER``: each kernel it
replaces says so in a warning. The GPU's source can differ from the one recorded here
(8-bit encoders' helpers, programmatic dependent launches): there, take the name from
the GPU's own generated files (``ftopt_kernels_*/`` in the temporary folder) and no
warning means nothing was replaced.

``--loads`` prints where each kernel's 64- and 128-bit loads and stores sit in its SASS
(the listing's lines, up to the first ``EXIT``): loads far apart wait on memory in turn.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

KINDS = {
    "global": ("LDG", "STG", "LD", "ST", "RED", "ATOM", "ATOMG"),
    "mufu": ("MUFU",),
    "float": ("FFMA", "FADD", "FMUL", "FSETP", "FSEL", "FMNMX", "FCHK", "F2I", "I2F", "F2F",
              "FRND", "FSET", "HADD2", "HMUL2", "HFMA2", "F2FP", "DADD", "DMUL", "DFMA"),
    "integer": ("IMAD", "IADD3", "LOP3", "SHF", "ISETP", "SEL", "LEA", "IABS", "IMNMX",
                "PRMT", "FLO", "POPC", "BREV", "VIMNMX", "I2IP", "SGXT", "LEA.HI", "IADD"),
    "shuffle": ("SHFL", "REDUX", "VOTE", "MATCH"),
    "control": ("BRA", "EXIT", "BSSY", "BSYNC", "BAR", "WARPSYNC", "CALL", "RET", "BMOV",
                "YIELD", "JMP"),
}


def _cases() -> dict:
    import ftopt

    return {
        "sgd": lambda: ftopt.sgd(1e-2),
        "adam": lambda: ftopt.adam(1e-3),
        "adam_skip": lambda: ftopt.adam(1e-3, skip_zeros=True),
        "adam_bf16_states": lambda: ftopt.adam(1e-3, state_dtype=__import__("torch").bfloat16),
        "adam_bf16_states_skip": lambda: ftopt.adam(
            1e-3, state_dtype=__import__("torch").bfloat16, skip_zeros=True),
        "adam_bf16_states_sr": lambda: ftopt.adam(
            1e-3, state_dtype=__import__("torch").bfloat16, state_rounding="stochastic"),
        "adam_bf16_states_sr_skip": lambda: ftopt.adam(
            1e-3, state_dtype=__import__("torch").bfloat16, state_rounding="stochastic",
            skip_zeros=True),
        "adam_fp16_states": lambda: ftopt.adam(1e-3, state_dtype=__import__("torch").float16),
        "adam_fp16_states_skip": lambda: ftopt.adam(
            1e-3, state_dtype=__import__("torch").float16, skip_zeros=True),
        "adam_bf16_params": lambda: ftopt.adam(1e-3),
        "adam_bf16_params_skip": lambda: ftopt.adam(1e-3, skip_zeros=True),
        # (the "adam_bf16_states" cases above have fp32 params)
        "adam_bf16_params_bf16_states": lambda: ftopt.adam(
            1e-3, state_dtype=__import__("torch").bfloat16),
        "adam_bf16_params_bf16_states_skip": lambda: ftopt.adam(
            1e-3, state_dtype=__import__("torch").bfloat16, skip_zeros=True),
        "adam_bf16_params_bf16_states_sr": lambda: ftopt.adam(
            1e-3, state_dtype=__import__("torch").bfloat16, state_rounding="stochastic"),
        "adam_bf16_params_bf16_states_sr_skip": lambda: ftopt.adam(
            1e-3, state_dtype=__import__("torch").bfloat16, state_rounding="stochastic",
            skip_zeros=True),
        **{f"{name}_bf16_params_bf16_states{tail}": (
            lambda make=make, skip=skip: make(state_dtype=__import__("torch").bfloat16,
                                              skip_zeros=skip))
           for name, make in (("lion", lambda **k: ftopt.lion(1e-4, **k)),
                              ("ademamix", lambda **k: ftopt.ademamix(1e-3, **k)),
                              ("sgd", lambda **k: ftopt.sgd(1e-2, momentum=0.9, **k)))
           for tail, skip in (("", False), ("_skip", True))},
        "adam8": lambda: ftopt.adam(1e-3, state_bits=8),
        "adam8_skip": lambda: ftopt.adam(1e-3, state_bits=8, skip_zeros=True),
        "ademamix8": lambda: ftopt.ademamix(1e-3, state_bits=8),
        "ademamix8_skip": lambda: ftopt.ademamix(1e-3, state_bits=8, skip_zeros=True),
        # (fuzz seed 102's chain of six 8-bit states: at cap 64 its split+defer main
        # kernel gave wrong Lion moments on sm_90)
        "ademamix_stddev_lion8_skip_bf16_params": lambda: ftopt.quantize_states(
            ftopt.skip_zeros(ftopt.chain(
                ftopt.scale_by_ademamix(alpha=ftopt.ademamix_alpha_warmup(5.0, 1),
                                        b3=ftopt.ademamix_b3_warmup(0.9, 0.9999, 1)),
                ftopt.scale_by_stddev(0.5, 1e-5, bias_correction=True, eps_in_sqrt=False),
                ftopt.scale_by_lion())), bits=8, min_size=200),
        "noisy_sgd": lambda: ftopt.noisy_sgd(1e-2),
        "novograd": lambda: ftopt.novograd(1e-2),
        "fromage": lambda: ftopt.fromage(1e-2),
    }


def record(names: list[str], tile: tuple[int, int] | None = None) -> list[dict]:
    """The compile jobs of every kernel the cases launch (recorded under the
    interpreter); ``tile``: (elements, warps) of the kernels without 8-bit slots, in
    place of 512x4."""
    os.environ["TRITON_INTERPRET"] = "1"
    # (the GPU's bf16 conversions, not the interpreter's bit-exact rounding: 100
    # instructions apart in a bf16 Adam kernel)
    os.environ.setdefault("FTOPT_BF16_CONVERT", "1")
    import test_frontend as tf
    import torch

    from ftopt.lowering import tiles

    cases = _cases()
    jobs = []
    for name in names:
        dtype = torch.bfloat16 if "_bf16_params" in name else torch.float32
        kernels = tf._kernels([tf._steps(cases[name](), dtype, donate=(True,), zero=False)])
        for (path, kname, _), (arg_names, args, constants) in kernels.items():
            sig, _ = tf._signature(arg_names, args, constants)
            consts = dict(tf._gpu_constants(constants))
            if "QBLOCK" in constants:
                # (the GPU's tile, or FTOPT_QUANT_TILE's where set)
                block, warps = (tiles.QUANT_TILE if "FTOPT_QUANT_TILE" in os.environ
                                else (256, 1))
                block = max(block, constants["QBLOCK"])
                consts["BLOCK"] = block
                cap = (tiles.QUANT_SKIP_MAXNREG if "skip" in name else tiles.QUANT_MAXNREG)
                source = pathlib.Path(path).read_text()
                if "flags_ptr" in source and "first = tl.program_id(0)" not in source:
                    cap = tiles.QUANT_DEFER_MAXNREG  # a "split+defer" main kernel
                options = {"num_warps": warps, **({"maxnreg": cap} if cap else {})}
            else:
                block, warps = tile or (consts.get("BLOCK", 512), 4)
                if "BLOCK" in consts:
                    consts["BLOCK"] = block
                options = {"num_warps": warps}
            # (as launch._constants_cached: no a*b+c -> fma contraction in any kernel)
            options["enable_fp_fusion"] = False
            jobs.append({"case": name, "path": path, "name": kname, "signature": sig,
                         "constexprs": [(k, v) for k, v in consts.items() if k in arg_names],
                         "options": options, "block": block})
    return jobs


def _opcode(line: str) -> str | None:
    m = re.search(r"\t(?:@!?U?P\w+ )?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)", line)
    if not m:
        return None
    op = m.group(1)
    return None if op.startswith("NOP") else op


def count(sass: str) -> dict:
    kinds: collections.Counter = collections.Counter()
    total = 0
    for line in sass.splitlines():
        op = _opcode(line)
        if op is None:
            continue
        total += 1
        base = op.split(".")[0]
        for kind, ops in KINDS.items():
            if base in ops:
                kinds[kind] += 1
                break
        else:
            kinds["other"] += 1
    return {"total": total, **kinds}


def vector_accesses(sass: str) -> str:
    """Where the first body of a kernel (up to its first ``EXIT``) loads (``L``) and
    stores (``S``) 64- and 128-bit vectors: the line of each in the SASS listing, as
    ``--dump`` writes it (``L68 L69 L178 L366 S506``: loads issued apart)."""
    out = []
    for number, line in enumerate(sass.splitlines(), 1):
        op = _opcode(line) or ""
        if op.startswith("EXIT"):
            break
        if op.startswith(("LDG", "STG")) and (".64" in op or ".128" in op):
            out.append(f"{op[0]}{number}")
    return " ".join(out)


def _resources(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers a thread, bytes of stack and local memory: spills) from ``cuobjdump
    -res-usage`` (Triton's NVIDIA backend ships it)."""
    import tempfile

    import triton.backends.nvidia as nvidia

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True,
                              text=True).stdout
    reg = re.search(r"REG:(\d+)", text)
    spilled = [int(m.group(1)) for m in re.finditer(r"(?:STACK|LOCAL):(\d+)", text)]
    return (int(reg.group(1)) if reg else None, sum(spilled) if spilled else None)


def compile_jobs(jobs: list[dict]) -> list[dict]:
    """In this process (not interpreted): each job compiled to SASS and counted."""
    import importlib.util

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.tools.disasm import get_sass

    out = []
    for job in jobs:
        # (recorded under the interpreter: its helpers in place of the GPU's)
        from ftopt.lowering import quantized, word_selects

        path = pathlib.Path(job["path"])
        source = path.read_text()
        gpu = source.replace(quantized.LG2_HELPER["interpreter"], quantized.LG2_HELPER["cuda"])
        # (the packed picks' PTX; the bf16 states' with the GPU's conversions, as counted)
        gpu = gpu.replace(word_selects._PICKS["portable"], word_selects._PICKS["ptx"])
        for name, text in word_selects._KEEPS["portable"].items():
            gpu = gpu.replace(text, word_selects._KEEPS["ptx"][name])
        if gpu != source:
            path = path.with_name(path.stem + "_gpu.py")
            path.write_text(gpu)
        spec = importlib.util.spec_from_file_location(f"k_{abs(hash(str(path)))}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        fn = getattr(module, job["name"])
        const = {(fn.arg_names.index(k),): v for k, v in job["constexprs"]}
        src = ASTSource(fn, job["signature"], const)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options=job["options"])
        sass = get_sass(compiled.asm["cubin"])
        if os.environ.get("SASS_DUMP"):  # --dump DIR: each kernel's listing and its
            name = f"{job['case']}_{job['name']}_{len(out)}"  # Triton GPU IR (layouts)
            pathlib.Path(os.environ["SASS_DUMP"], name + ".sass").write_text(sass)
            pathlib.Path(os.environ["SASS_DUMP"], name + ".ttgir").write_text(
                compiled.asm["ttgir"])
            pathlib.Path(os.environ["SASS_DUMP"], name + ".ptx").write_text(
                compiled.asm["ptx"])
        counts = count(sass)
        counts["vectors"] = vector_accesses(sass)
        counts["registers"], counts["spills"] = _resources(compiled.asm["cubin"])
        counts["shared"] = compiled.metadata.shared  # (bytes a program)
        out.append(counts)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="*", help="cases (default: all)")
    ap.add_argument("--out", help="write <out>.md and <out>.json")
    ap.add_argument("--dump", help="write each kernel's SASS listing to this folder")
    ap.add_argument("--edit", help="write each kernel's source to this folder")
    ap.add_argument("--sources", help="compile this folder's sources in place of them")
    ap.add_argument("--maxnreg", type=int, help="the register cap of capped kernels")
    ap.add_argument("--cap-all", action="store_true",
                    help="--maxnreg caps every kernel, not only those with a cap")
    ap.add_argument("--tile", help="BLOCKxWARPS of the kernels without 8-bit slots "
                    "(default 512x4)")
    ap.add_argument("--loads", action="store_true",
                    help="print where each kernel's vector loads and stores sit")
    ap.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.compile:
        json.dump(compile_jobs(json.load(sys.stdin)), sys.stdout)
        return
    names = args.cases or list(_cases())
    jobs = record(names, tuple(int(x) for x in args.tile.split("x")) if args.tile
                  else None)
    for i, job in enumerate(jobs):
        name = f"{job['case']}_{job['name']}_{i}.py"
        if args.edit:
            pathlib.Path(args.edit).mkdir(parents=True, exist_ok=True)
            pathlib.Path(args.edit, name).write_text(pathlib.Path(job["path"]).read_text())
            print(f"{name}: {pathlib.Path(job['path']).name}")
        if args.sources and pathlib.Path(args.sources, name).exists():
            job["path"] = str(pathlib.Path(args.sources, name).resolve())
        if args.maxnreg and ("maxnreg" in job["options"] or args.cap_all):
            job["options"]["maxnreg"] = args.maxnreg
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if args.dump:
        pathlib.Path(args.dump).mkdir(parents=True, exist_ok=True)
        env["SASS_DUMP"] = str(pathlib.Path(args.dump).resolve())
    done = subprocess.run([sys.executable, __file__, "--compile"], input=json.dumps(jobs),
                          text=True, capture_output=True, env=env, timeout=1800)
    if done.returncode:
        raise SystemExit(done.stderr[-4000:])
    results = json.loads(done.stdout)
    cols = ["total", "global", "mufu", "float", "integer", "shuffle", "control", "other"]
    lines = ["| case | kernel | tile | elements/thread | " + " | ".join(cols)
             + " | per element | registers | local bytes | shared bytes |",
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in cols)
             + " | --- | --- | --- | --- |"]
    rows = []
    for job, res in zip(jobs, results):
        per_thread = job["block"] // (32 * job["options"]["num_warps"])
        row = {"case": job["case"], "kernel": job["name"],
               "tile": f"{job['block']}x{job['options']['num_warps']}",
               "elements_per_thread": per_thread, **res,
               "per_element": round(res["total"] / max(per_thread, 1), 1)}
        rows.append(row)
        lines.append(f"| {row['case']} | {row['kernel']} | {row['tile']} | {per_thread} | "
                     + " | ".join(str(res.get(c, 0)) for c in cols)
                     + f" | {row['per_element']} | {res.get('registers')} | "
                       f"{res.get('spills')} | {res.get('shared')} |")
    table = "\n".join(lines)
    print(table)
    if args.loads:
        for row in rows:
            print(f"{row['case']} {row['kernel']} {row['tile']}: {row['vectors']}")
    if args.out:
        write(args.out, "Static SASS counts", f"sass_count.py {' '.join(args.cases)}",
              "Static: full and tail blocks both counted.", table, rows)


def write(out: str, title: str, command: str, note: str, table: str, rows: list) -> None:
    """``out``.md (the table under a heading naming Triton's version and the command)
    and ``out``.json (the rows)."""
    import triton

    head = (f"# {title} (sm_90, compiled on a CPU with triton {triton.__version__})\n\n"
            f"Command: `python benchmarks/{command}`.{' ' + note if note else ''}\n\n")
    pathlib.Path(out + ".md").write_text(head + table + "\n")
    pathlib.Path(out + ".json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
