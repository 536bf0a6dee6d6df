"""Generated kernel sources -> Triton kernels: each source written to a file (Triton
reads a kernel's source back) and imported once per process, keyed by its hash.

``FTOPT_KERNEL_SOURCES``: a folder of hand-edited kernels, each named as the generated
source it replaces (``ftopt_<key>.py``, ``benchmarks/sass_count.py --edit``), to time a
variant in the real step before generating it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib
import sys
import tempfile
import warnings

from ftopt.lowering.knobs import text as knob_text

__all__ = ["compile_source"]

_MODULES: dict[str, object] = {}
_CACHE_DIR: str | None = None
# Named as the generated kernels they replace (sass_count.py --dump)
_SOURCES = knob_text("FTOPT_KERNEL_SOURCES", "", "a folder of hand-edited kernels to time")


def compile_source(source: str, name: str):
    """Import generated source (from a file, so Triton can read it back) once."""
    global _CACHE_DIR
    key = hashlib.sha256(source.encode()).hexdigest()[:24]
    module = _MODULES.get(key)
    if module is None:
        if _CACHE_DIR is None:
            _CACHE_DIR = tempfile.mkdtemp(prefix="ftopt_kernels_")
        path = os.path.join(_CACHE_DIR, f"ftopt_{key}.py")
        if _SOURCES and os.path.exists(edited := os.path.join(_SOURCES, f"ftopt_{key}.py")):
            warnings.warn(f"FTOPT_KERNEL_SOURCES: {edited} in place of its kernel", stacklevel=2)
            source = pathlib.Path(edited).read_text()
        with open(path, "w") as f:
            f.write(source)
        spec = importlib.util.spec_from_file_location(f"ftopt_kernels_{key}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        _MODULES[key] = module
    return getattr(module, name)
