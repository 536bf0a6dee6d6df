"""Which main kernels a "split+defer" group runs, from how many blocks it deferred.

A "split+defer" step (:mod:`ftopt.lowering.split`) runs the blocks without zero
gradients in its main kernel and flags those with some zeros for a second launch. That is
the fastest skip_zeros step while few blocks have some zero gradients, and the slowest
where many do: gradients with scattered zeros (a layer after dead ReLU units, pruned
weights) defer nearly every block, and the second launch runs them a program of
:data:`tiles.DEFER_FLAGS` blocks at a time. "split+select" runs such blocks in the main
kernel, with the select body beside the plain one (more registers: slower where no block
has zeros). H200, GPT-2 8-bit Adam (``benchmarks/RESULTS.md``): with a zero in a fraction
``f`` of the blocks, split+defer 0.627 + 0.41 f ms, split+select 0.645 + ~0.05 f: the
same time at f ~ 0.04.

So a group keeps a :class:`DeferWatch`. Every :data:`tiles.DEFER_PERIOD` steps (the first
step too) it counts the flags the step set (a count of the flag bytes on the device,
copied to the host without waiting; read at a later step, once it is there), and while
more than :data:`tiles.DEFER_SELECT_ABOVE` of the group's blocks were deferred, the group
runs "split+select"; then one step in :data:`tiles.DEFER_PROBE` runs "split+defer" again
to count them. Both kernels write the same bytes (the same skip_zeros semantics, the same
math): only the time differs. While a CUDA graph is being captured nothing is counted
and nothing switches (the captured launches are those of the mode of the moment).
"""

from __future__ import annotations

import torch

from ftopt.lowering import tiles


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class DeferWatch:
    """The mode of one "split+defer" group: :meth:`plan` before its launches,
    :meth:`after` after them."""

    def __init__(self, flags: torch.Tensor, blocks: int):
        self.flags = flags  # one byte a main program (ftopt.lowering.split)
        self.blocks = blocks  # main programs (the flags past them stay zero)
        self.select = False  # the group runs "split+select"
        self.fraction: float | None = None  # deferred blocks / blocks, last counted
        self.steps = 0
        self.sampling = False  # this step's flags are counted after its launches
        self.pending: tuple | None = None  # (event or None, count) not yet read
        self._host: torch.Tensor | None = None

    def plan(self) -> bool:
        """Before a step's launches: whether the group runs "split+select" this step.
        (While a CUDA graph is captured: the mode of the moment, no event queried.)"""
        if _capturing(self.flags.device):
            self.sampling = False
            return self.select
        if self.pending is not None:
            event, count = self.pending
            if event is None or event.query():
                self.pending = None
                self.fraction = int(count) / max(self.blocks, 1)
                self.select = self.fraction > tiles.DEFER_SELECT_ABOVE
        self.steps += 1
        period = tiles.DEFER_PROBE if self.select else tiles.DEFER_PERIOD
        self.sampling = self.pending is None and self.steps % period == 1 % period
        return self.select and not self.sampling

    def after(self) -> None:
        """After a step's launches: count the flags of a sampled step."""
        if not self.sampling:
            return
        self.sampling = False
        count = torch.count_nonzero(self.flags)
        if self.flags.device.type == "cpu":
            self.pending = (None, count)
            return
        if self._host is None:
            self._host = torch.empty((), dtype=torch.int64, pin_memory=True)
        self._host.copy_(count, non_blocking=True)
        event = torch.Event(self.flags.device.type)
        event.record()
        self.pending = (event, self._host)
