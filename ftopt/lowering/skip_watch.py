"""Which kernels a "split" skip_zeros group runs, from how many of its blocks have zeros.

A "split" step (:mod:`ftopt.lowering.split`) runs the plain body in a program with no
zero gradient, nothing in one with only zeros, and in one with some zeros the select or
in-place body ("split+select", "split+in_place") or a flag for a second launch
("split+defer"). That is the fastest skip_zeros step while few blocks have some zero
gradients, and not where many do: gradients with scattered zeros (a layer after dead ReLU
units, pruned weights) put nearly every block on the slow branch. H200, GPT-2 Adam
(``benchmarks/RESULTS.md``), every block part zero, against no skip_zeros: 8-bit
split+defer +67% (split+select +15%: with a zero in a fraction ``f`` of the blocks,
split+defer 0.627 + 0.41 f ms, split+select 0.645 + ~0.05 f, the same at f ~ 0.04); fp32
split+in_place +7.5% (select +2.9%), bf16 params +10..12% (+4%), bf16 states +13%
(+2.5%), stochastic rounding +18% (+8%). Where the blocks are all zero instead (an
embedding's unused rows) the split modes gain 1.14-1.31x, which select does not.

So each such group keeps a :class:`SkipWatch` and an alternate group (the same leaves in
"split+select" for split+defer, in "select" for the others:
:func:`ftopt.lowering.groups.build_group`). Every :data:`tiles.WATCH_PERIOD` steps (the
first step too) it counts the step's flags: split+defer's, which its main kernel writes
every step (1: deferred); the others' from a variant of their kernel that the counting
steps alone run (1: some zeros, 2: only zeros; the flags cleared before), since the
stores cost the plain kernel up to 3% (bf16 params). The count is taken on the device and
copied to the host without waiting, read at a later step once it is there. The group
runs its alternate while more than :data:`tiles.DEFER_SELECT_ABOVE` of its blocks were
deferred (split+defer), or while ``f - SPLIT_ZERO_WEIGHT * z`` exceeds
:data:`tiles.SPLIT_SELECT_ABOVE` (the others; ``f``, ``z``: the fractions of blocks with
some and with only zeros; bf16/fp16 states rounded to nearest, for which select is the
cheaper mode with dense gradients too: :data:`tiles.SPLIT_SELECT_ABOVE_STATES`); then
one step in :data:`tiles.WATCH_PROBE` runs the split mode again to count, the first at a
step 1 mod :data:`tiles.WATCH_FIRST_PROBE` (16: step 17, not 65), so that the kernels
the mode's probe runs compile in a loop's first steps (H200, GPT-2 Adam, bf16 states,
90% of the embedding's rows zero: with the first probe at step 65, 50 back-to-back steps
past the 60th took 0.72-1.69 ms a step, 16.7 in one run, against a median of 0.35-0.39
ms a step by events). (A deferring group's flags mark its all-zero blocks too, 2, which
its deferred kernel passes over; the zeros do not weigh in its choice, since
split+select skips them as well.)

A group of one block a program, of a layout of :data:`tiles.SPAN_ALTERNATES`, also has a
spanned alternate (programs of several blocks: an all-zero stretch waits on memory once
per span, the other blocks pay the span loop's registers), which it runs while more than
:data:`tiles.SPAN_ABOVE` of its blocks were all zero (before the rule for select): most
of a model's gradients zero, as the experts of a mixture that saw no tokens, or
embedding tables that are most of the parameters. Below that, where some of its leaves
are each mostly all zero (an embedding's unused rows), it counts its blocks with zeros
per leaf too and runs those leaves in a spanned group of their own and the others in the
mode their own counts choose, whatever the whole group's (its *carve*:
:func:`ftopt.lowering.groups.carved`; :data:`tiles.CARVE_MIN_BLOCKS`). H200, GPT-2 Adam,
90% of the embedding's rows zero and one gradient in 97 of the other leaves', against no
skip_zeros: the others in the group's mode / in their own, bf16 states 1.12-1.13x /
1.22-1.24x, 8-bit (the whole group in split+select, no carve) 1.05x / 1.09x; the others'
gradients dense: unchanged (``benchmarks/RESULTS.md``). A carving group's probe runs the
carve with the others in the group's own mode, both groups counting, rather than the
whole group (whose leaves, the embedding's too, then run one block a program: the probe
step took 600-650 us against 470-490, 8-bit and bf16 states, H200, GPT-2 Adam, 90% of
the embedding's rows zero).

Every mode writes the same bytes (the same skip_zeros semantics, the same math): only the time
differs. While a CUDA graph is being captured nothing is counted and nothing switches
(the captured launches are those of the mode of the moment).
``FTOPT_SKIP_WATCH=0`` turns the watch off.
"""

from __future__ import annotations

import torch

from ftopt.lowering import tiles


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class SkipWatch:
    """The mode of one "split" group: :meth:`plan` before its launches (whether it runs
    its alternate), :meth:`after` after them."""

    def __init__(self, flags: torch.Tensor, blocks: int, deferring: bool,
                 select_above: float = 0.0, span_above: float | None = None,
                 leaf_blocks: tuple = ()):
        self.flags = flags  # one byte a main program (ftopt.lowering.split)
        self.blocks = blocks  # main programs (the flags past them stay zero)
        self.deferring = deferring  # "split+defer" (else its flags only count)
        # The threshold: tiles.DEFER_SELECT_ABOVE or tiles.split_select_above's.
        self.select_above = select_above
        self.span_above = span_above  # tiles.SPAN_ABOVE (None: no spanned alternate)
        # Where it may carve: each leaf's blocks (its main programs in leaf order), and
        # on the device each leaf's first and last block + 1.
        self.leaf_blocks = leaf_blocks
        blocks_of = torch.tensor(leaf_blocks, dtype=torch.int64)
        ends = blocks_of.cumsum(0)
        self._leaf_ends = ((ends - blocks_of).to(flags.device), ends.to(flags.device))
        # What the group runs but in the steps that count: 0 itself, 1 its alternate,
        # 2 its spanned alternate, 3 its carve: the positions of the leaves run spanned,
        # and whether the others run the alternate.
        self.other = 0
        self.carve: tuple | None = None
        # carve -> its two groups, each with its leaves' positions on the device, and
        # build_group's arguments for them (ftopt.lowering.groups.carved).
        self.carves: dict = {}
        self.rebuild: tuple | None = None
        self.now = 0  # ... this step
        self.carve_now: tuple | None = None  # the carve this step runs (now 3)
        # carve -> its flags' leaf order: each leaf's first and last block + 1 in them,
        # and where each leaf's counts go back to (SkipWatch.after)
        self._carve_ends: dict = {}
        # Blocks with some zero gradients (deferred) and with only zeros, over all
        # blocks, as last counted (only zeros: counted where not deferring).
        self.fraction: float | None = None
        self.zero_fraction: float | None = None
        self.steps = 0
        self.probed = False  # a step of a mode other than 0 has counted
        self.sampling = False  # this step's flags are counted after its launches
        self.pending: tuple | None = None  # (event or None, counts) not yet read
        self._host: torch.Tensor | None = None

    def plan(self) -> int:
        """Before a step's launches: what the group runs this step (:attr:`other`'s
        values). (While a CUDA graph is captured: the mode of the moment, no event
        queried.)"""
        if _capturing(self.flags.device):
            self.sampling = False
            self.now = self.other
            self.carve_now = self.carve if self.now == 3 else None
            return self.now
        if self.pending is not None:
            event, counts = self.pending
            if event is None or event.query():
                self.pending = None
                self._decide(*counts.tolist())
        self.steps += 1
        period = (tiles.WATCH_PERIOD if not self.other
                  else tiles.WATCH_PROBE if self.probed else tiles.WATCH_FIRST_PROBE)
        self.sampling = self.pending is None and self.steps % period == 1 % period
        self.probed |= self.sampling and self.other != 0
        # (a carving group's probe: its carve with the others in the group's own mode)
        probe_carve = self.sampling and self.other == 3
        self.now = 3 if probe_carve else 0 if self.sampling else self.other
        self.carve_now = ((self.carve[0], False) if probe_carve
                          else self.carve if self.now == 3 else None)
        return self.now

    def defer_flags(self) -> int:
        """Flags a program of a deferring group's deferred kernel reads:
        :data:`tiles.DEFER_FLAGS_FEW` while the last count found fewer than
        :data:`tiles.DEFER_FEW_BELOW` of its blocks deferred, else :data:`tiles.DEFER_FLAGS`."""
        few = self.fraction is not None and self.fraction < tiles.DEFER_FEW_BELOW
        return tiles.DEFER_FLAGS_FEW if few and self.deferring else tiles.DEFER_FLAGS

    def _alternate(self, some: int, zeros: int, blocks: int) -> bool:
        """Whether blocks of which ``some`` have some zero gradients and ``zeros`` only
        zeros run the alternate ("select" or "split+select")."""
        weight = 0.0 if self.deferring else tiles.SPLIT_ZERO_WEIGHT
        blocks = max(blocks, 1)
        return (some - weight * zeros) / blocks > self.select_above

    def _decide(self, nonzero: int, total: int, *per_leaf: int) -> None:
        """From the count of set flags and their sum (1 some zeros, 2 only zeros), and
        where it may carve, each leaf's all-zero blocks, then its blocks with some zeros."""
        zeros = total - nonzero
        blocks = max(self.blocks, 1)
        self.fraction, self.zero_fraction = (nonzero - zeros) / blocks, zeros / blocks
        self.other = (2 if self.span_above is not None and self.zero_fraction > self.span_above
                      else int(self._alternate(nonzero - zeros, zeros, blocks)))
        # (per-leaf counts only where it may carve: it has a spanned alternate)
        zero_of, some_of = per_leaf[:len(per_leaf) // 2], per_leaf[len(per_leaf) // 2:]
        sparse = tuple(j for j, z in enumerate(zero_of)
                       if z > self.span_above * self.leaf_blocks[j])
        self.carve = None
        if (self.other != 2 and 0 < len(sparse) < len(zero_of)
                and sum(zero_of[j] for j in sparse) >= tiles.CARVE_MIN_BLOCKS):
            # The other leaves run the mode their own counts choose (dense gradients
            # beside an embedding: bf16 states rounded to nearest then run select; many
            # blocks part zero: the alternate, as the whole group would).
            rest = [j for j in range(len(zero_of)) if j not in sparse]
            self.other, self.carve = 3, (sparse, self._alternate(
                sum(some_of[j] for j in rest), sum(zero_of[j] for j in rest),
                sum(self.leaf_blocks[j] for j in rest)))

    def _counted_flags(self) -> tuple:
        """This step's flags, one a block in the order of their leaves, and each leaf's
        first and last block + 1 among them, and where each leaf's counts are in the
        group's leaf order (``None``: in order). A probe of a carve counts the flags of
        its two groups, the others' leaves first (:func:`ftopt.lowering.groups.carved`)."""
        if self.now != 3:
            return self.flags[:self.blocks], (*self._leaf_ends, None)
        parts = self.carves[self.carve_now]
        found = self._carve_ends.get(self.carve_now)
        if found is None:
            sparse = self.carve_now[0]
            order = [j for j in range(len(self.leaf_blocks)) if j not in sparse] + list(sparse)
            blocks_of = torch.tensor([self.leaf_blocks[j] for j in order], dtype=torch.int64)
            ends = blocks_of.cumsum(0)
            device = self.flags.device
            found = self._carve_ends[self.carve_now] = (
                (ends - blocks_of).to(device), ends.to(device),
                torch.tensor(order).argsort().to(device),
                [sum(self.leaf_blocks[j] for j in part) for part in (order[:-len(sparse)],
                                                                     sparse)])
        starts, ends, back, blocks = found
        flags = torch.cat([sub.flags[:n] for (sub, _), n in zip(parts, blocks)])
        return flags, (starts, ends, back)

    def after(self) -> None:
        """After a step's launches: count the flags of a sampled step."""
        if not self.sampling:
            return
        self.sampling = False
        flags, (starts, ends, back) = self._counted_flags()
        counts = torch.stack([torch.count_nonzero(flags), flags.sum(dtype=torch.int64)])
        if self.leaf_blocks and self.zero_fraction != 0.0:
            # Each leaf's all-zero blocks, from a running count (a sum per leaf by
            # atomic adds into one slot would serialize: an embedding's 150k blocks cost
            # 8-bit dense steps 2% when counted every 16 steps, H200). Only where the last
            # count found some.
            # One running count of both: the all-zero blocks in the high 32 bits, those
            # with some zeros in the low.
            both = (flags == 2).to(torch.int64) * 2**32 + (flags == 1)
            running = torch.cat([counts.new_zeros(1), both.cumsum(0)])
            per_leaf = running[ends] - running[starts]
            per_leaf = per_leaf if back is None else per_leaf[back]
            counts = torch.cat([counts, per_leaf >> 32, per_leaf & (2**32 - 1)])
        if self.flags.device.type == "cpu":
            self.pending = (None, counts)
            return
        if self._host is None or len(self._host) != len(counts):  # (no copy pending)
            self._host = torch.empty(len(counts), dtype=torch.int64, pin_memory=True)
        self._host.copy_(counts, non_blocking=True)
        event = torch.Event(self.flags.device.type)
        event.record()
        self.pending = (event, self._host)
