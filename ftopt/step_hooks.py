"""torch's optimizer step hooks around :meth:`ftopt.Optimizer.step`, at a lower host cost.

``torch.optim.Optimizer`` wraps each subclass's ``step`` (``profile_hook_step``) in a
profiler range, the global and the optimizer's own pre- and post-hooks, and a call of
``_optimizer_step_code`` (where torch's profiler looks at the optimizer); torch's
optimizers step with gradients off. Its range, ``torch.autograd.profiler.record_function``,
is two dispatcher calls, and ``torch.no_grad()`` an object and two calls: several
microseconds of a step that fused kernels make short. :func:`hooked` does the same with
torch's C-level range (``torch._C._profiler._RecordFunctionFast``, the one torch's own
compiled kernels use; the profiler sees the same name) and grad mode set directly. While
``torch.compile`` traces, and on a torch without that range or the hook tables, torch's
own wrapper runs, around ``step`` under ``torch.no_grad()``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from itertools import chain
from typing import Any

import torch
from torch.optim import optimizer as _torch_optimizer

__all__ = ["hooked"]

_FAST_RANGE = getattr(getattr(torch._C, "_profiler", None), "_RecordFunctionFast", None)
_PRE_HOOKS = getattr(_torch_optimizer, "_global_optimizer_pre_hooks", None)
_POST_HOOKS = getattr(_torch_optimizer, "_global_optimizer_post_hooks", None)


def hooked(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` (an optimizer class's) run with gradients off and wrapped as torch wraps
    it, marked ``hooked`` so that ``torch.optim.Optimizer`` does not wrap it again."""
    torch_step = torch.optim.Optimizer.profile_hook_step(torch.no_grad()(step))
    if _FAST_RANGE is None or _PRE_HOOKS is None or _POST_HOOKS is None:
        torch_step.hooked = True  # type: ignore[attr-defined]
        return torch_step

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # As torch's: the hooks see ``args`` with the optimizer first.
        self = args[0]
        if torch.compiler.is_compiling():
            return torch_step(*args, **kwargs)
        with _FAST_RANGE(f"Optimizer.step#{type(self).__name__}.step"):
            pre_hooks = self._optimizer_step_pre_hooks
            for pre_hook in chain(_PRE_HOOKS.values(), pre_hooks.values()) if (
                    _PRE_HOOKS or pre_hooks) else ():
                result = pre_hook(self, args, kwargs)
                if result is not None:
                    if isinstance(result, tuple) and len(result) == 2:
                        args, kwargs = result
                    else:
                        raise RuntimeError(f"{step} must return None or a tuple of "
                                           f"(new_args, new_kwargs), but got {result}.")
            enabled = torch.is_grad_enabled()
            torch._C._set_grad_enabled(False)
            try:
                out = step(*args, **kwargs)
            finally:
                torch._C._set_grad_enabled(enabled)
            self._optimizer_step_code()
            post_hooks = self._optimizer_step_post_hooks
            for post_hook in chain(post_hooks.values(), _POST_HOOKS.values()) if (
                    post_hooks or _POST_HOOKS) else ():
                post_hook(self, args, kwargs)
            return out

    wrapper.hooked = True  # type: ignore[attr-defined]
    return wrapper
