"""Triton's interpreter (``TRITON_INTERPRET=1``), undone after each launch."""

from __future__ import annotations

import contextlib
import inspect

import triton.language as tl

from ftopt.lowering import tiles

if tiles.INTERPRETING:  # (it imports numpy, which neither torch nor triton requires)
    import triton.runtime.interpreter as _runtime
else:
    _runtime = None


def patched() -> list:
    """The objects whose attributes Triton's interpreter replaces while it runs a kernel
    (``triton.runtime.interpreter._patch_lang``)."""
    core = tl.core
    names = ("tensor", "tensor_descriptor_base", "condition", "dtype")
    return [tl, core, tl.math, *[getattr(core, n) for n in names if hasattr(core, n)]]


@contextlib.contextmanager
def patches_undone(once: bool = True):
    """Leaves ``triton.language`` as it was before an interpreted launch (``once``: and
    patches it once a module for the launch, :func:`_patched_once`).

    Triton's interpreter (seen in 3.6 to 3.9) patches ``triton.language`` for the length
    of a launch and restores it afterwards, except for the ``@triton.jit`` helpers a
    kernel calls (``tl.sum``, ``tl.max``, ``tl.min`` of ``triton/language/standard.py``):
    each call of one patches ``triton.language.core`` again and never restores it. Left
    so, the next real compilation in the process (any Triton kernel not found in the
    cache, ours or the user's) runs the interpreter's builtins and fails.
    """
    objects = patched()
    saved = [dict(vars(obj)) for obj in objects]
    real = getattr(_runtime, "_patch_lang", None)
    if once and real is not None and hasattr(_runtime, "_LangPatchScope"):
        _runtime._patch_lang = _patched_once(real)
    try:
        yield
    finally:
        if once and real is not None:
            _runtime._patch_lang = real
        for obj, before in zip(objects, saved):
            now = vars(obj)
            for name in [n for n in now if n not in before]:
                delattr(obj, name)
            for name, value in before.items():
                if now.get(name, _MISSING) is not value:
                    setattr(obj, name, value)


_MISSING = object()


def _patched_once(real):
    """Triton's ``_patch_lang``, done only where the modules a function sees are not
    patched already.

    The interpreter patches ``triton.language`` at each launch, and again at each call
    of a ``@triton.jit`` function from a kernel (``tl.sum``, ``tl.max``, ``tl.zeros``:
    ``triton/language/standard.py``; the kernels' own helpers): ``inspect.getmembers``
    of four modules and classes, a quarter of the time of an 8-bit skip_zeros test,
    though within a launch the second patch finds nothing left to patch. Patched, a
    module's ``maximum`` is no longer a builtin."""
    def patch_lang(fn):
        langs = [v for v in fn.__globals__.values()
                 if inspect.ismodule(v) and (v is tl or v is tl.core)]
        if langs and not any(tl.core.is_builtin(lang.maximum) for lang in langs):
            return _runtime._LangPatchScope()  # (nothing to restore)
        return real(fn)
    return patch_lang
