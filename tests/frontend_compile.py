"""Compiles generated kernels to Triton IR in a process where Triton runs compiled, not
interpreted (``tests/test_frontend.py`` runs it: Triton imported under the interpreter
makes its own ``@triton.jit`` helpers, ``tl.sum``/``tl.max``/``tl.min``, interpreted
functions, which its compiler cannot call).

Reads ``[{"path", "name", "signature", "constexprs"}]`` as JSON on stdin; writes one error
message (or ``null``) per kernel as JSON on stdout. NVIDIA target, front end only: no
GPU and no ptxas needed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402


def front_end(path: str, name: str, signature: dict, constexprs: list) -> None:
    spec = importlib.util.spec_from_file_location(f"frontend_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    fn = getattr(module, name)
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": 4})
    context = triton._C.libtriton.ir.context()
    triton._C.libtriton.ir.load_dialects(context)
    backend.load_dialects(context)
    const = {(fn.arg_names.index(k),): v for k, v in constexprs}
    ASTSource(fn, signature, const).make_ir(target, options,
                                            backend.get_codegen_implementation(options),
                                            backend.get_module_map(), context)


def main() -> None:
    errors = []
    for job in json.load(sys.stdin):
        try:
            front_end(job["path"], job["name"], job["signature"], job["constexprs"])
            errors.append(None)
        except Exception as err:  # reported, with Triton's messages, by the test
            chain = []
            while err is not None and len(chain) < 4:
                chain.append(f"{type(err).__name__}: {err}")
                err = err.__cause__ or err.__context__
            errors.append("\n".join(chain))
    json.dump(errors, sys.stdout)


if __name__ == "__main__":
    main()
