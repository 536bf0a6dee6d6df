"""Triton's interpreter (``TRITON_INTERPRET=1``), undone after each launch."""

from __future__ import annotations

import contextlib

import triton.language as tl


def patched() -> list:
    """The objects whose attributes Triton's interpreter replaces while it runs a kernel
    (``triton.runtime.interpreter._patch_lang``)."""
    core = tl.core
    names = ("tensor", "tensor_descriptor_base", "condition", "dtype")
    return [tl, core, tl.math, *[getattr(core, n) for n in names if hasattr(core, n)]]


@contextlib.contextmanager
def patches_undone():
    """Leaves ``triton.language`` as it was before an interpreted launch.

    Triton's interpreter (seen in 3.6 to 3.9) patches ``triton.language`` for the length
    of a launch and restores it afterwards, except for the ``@triton.jit`` helpers a
    kernel calls (``tl.sum``, ``tl.max``, ``tl.min`` of ``triton/language/standard.py``):
    each call of one patches ``triton.language.core`` again and never restores it. Left
    so, the next real compilation in the process (any Triton kernel not found in the
    cache, ours or the user's) runs the interpreter's builtins and fails.
    """
    objects = patched()
    saved = [dict(vars(obj)) for obj in objects]
    try:
        yield
    finally:
        for obj, before in zip(objects, saved):
            now = vars(obj)
            for name in [n for n in now if n not in before]:
                delattr(obj, name)
            for name, value in before.items():
                if now.get(name, _MISSING) is not value:
                    setattr(obj, name, value)


_MISSING = object()
