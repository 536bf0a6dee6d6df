"""Launching a traced chain: work and address tables per group, reductions, main kernel.

A group is the set of active leaves sharing (device, param dtype, grad dtype). Its work
table (leaf and start offset of every block, built once per set of leaf sizes) and its
address tables (one int64 per leaf and role) live on the device, so one launch covers
every leaf of the group.
"""

from __future__ import annotations

import array
import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch
import triton
import triton.language as tl

from ftopt.lowering import codegen, half_tiles, interpreter, quantized, streams, tiles, work


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 table on ``device``. A small copy from pageable memory is staged by the
    driver without waiting for the device's queue (measured on an H200: no slower than a
    pinned staging buffer, which costs an allocation per step)."""
    host = (torch.frombuffer(array.array("q", values), dtype=torch.int64) if values
            else torch.empty(0, dtype=torch.int64))
    if device.type == "cpu":
        return host.clone()
    return host.to(device, non_blocking=True)


# Triton's register cap (``maxnreg``) is an option of its NVIDIA backend only.
_NVIDIA = torch.version.cuda is not None and torch.version.hip is None

# Triton 3.3 on: the grid dependency instructions and the ``launch_pdl`` option
# (programmatic dependent launches: ftopt.lowering.streams.PDL).
DEPENDENT_LAUNCHES = hasattr(getattr(tl.extra, "cuda", None), "gdc_wait")

# Donated 8-bit skip_zeros steps: programs whose gradients are all zero return at once
# (False: they run the full body, to time one against the other).
SKIP_TILES = True


def switches() -> tuple:
    """The module switches that choose a kernel variant (bound launches rebind on one)."""
    return SKIP_TILES, quantized.ENCODER, streams.PDL


@dataclass
class GroupLaunch:
    """Everything one group's kernels need, except per-step scalars."""

    p_dtype: torch.dtype
    g_dtype: torch.dtype
    leaves: list[int]
    work: work.WorkTable
    traced: object = None  # the chain's graph for this group's layout
    addresses: dict[str, torch.Tensor] = field(default_factory=dict)
    leaf_values: torch.Tensor | None = None
    aligned: bool = False
    quant_block: int = 0  # 8-bit slots with this many elements per absmax (0: fp32 slots)
    qmaps: tuple = ()
    paths: list = field(default_factory=list)  # each leaf's pytree path (norms on shards)
    slot_dtypes: tuple = ()  # (slot, dtype) of each 16-bit slot (codegen.Variant)
    skip_tiles: bool = False  # all-zero-gradient programs return at once (codegen.Variant)
    skip_stores: bool = False  # all-zero-gradient programs write nothing (codegen.Variant)
    fast_math: bool = False  # approximate sqrt and division (codegen.Variant)
    chunk_lanes: int = 0  # rows of all-zero gradients neither loaded nor stored
    split: bool = False  # a no-zero program runs the plain body (codegen.Variant)
    # "split+defer": programs with some zero gradients run in a second launch, which
    # reads their flags here (ftopt.lowering.split; one byte a main program).
    flags: torch.Tensor | None = None
    # "split+defer" (deferring), or another "split" mode whose flags count its blocks with
    # some (1) and only (2) zero gradients (ftopt.lowering.skip_watch); its watch.
    deferring: bool = False
    counting: bool = False  # (not deferring) this step's kernel sets the flags
    watch: object = None
    alternate: GroupLaunch | None = None  # the group it runs instead
    spanned: GroupLaunch | None = None  # the watch's other alternate (tiles.SPAN_ALTERNATES)
    span: int = 1  # blocks a program of a "split" main kernel runs (codegen.Variant)
    one_leaf: bool = False  # its blocks in order, of one leaf (codegen.Variant)
    beside: bool = False  # a carve's spanned group: launched on a second stream (streams)
    warps: int = 0  # its programs' warps where not its layout's tile's (tiles.CARVE_WARPS)
    programs: int = 0  # a spanned kernel's programs, each looping (0: one a span)
    defer_flags: int = 0  # its watch's choice of the deferred kernel's flags a program
    pick: object = None  # itemgetter of the group's leaves among the active ones
    grad_addresses: list = field(default_factory=list)
    # The reduction pass's own tile and work table where they are not the main kernel's
    # (8-bit groups: tiles.HEAVY_TILE, ftopt.lowering.groups.build_group).
    reduce_tile: tuple = ()
    reduce_work: work.WorkTable | None = None

    def args(self, roles, scalars, reductions, global_reductions, main: bool = True) -> list:
        """``scalars``: a list of floats (kernel arguments) or a device buffer; ``main``:
        the blocks in the main kernel's order, else in the reduction pass's (its table:
        :attr:`reduce_work`)."""
        w = self.work if main else self.pass_work
        scalar_args = scalars if isinstance(scalars, list) else [scalars]
        leaf, start = (w.main_leaf, w.main_start) if main else (w.block_leaf, w.block_start)
        return [leaf, start, w.numel, *[self.addresses[r] for r in roles],
                *scalar_args, self.leaf_values, reductions, global_reductions, *self.qmaps]

    @property
    def pass_work(self) -> work.WorkTable:
        """The reduction pass's work table: :attr:`reduce_work`, else the main kernel's."""
        return self.reduce_work or self.work

    @property
    def elem_bytes(self) -> int:
        """The larger element size of the group's params and gradients."""
        return half_tiles.elem_bytes(self.p_dtype, self.g_dtype)

    @property
    def kind(self) -> str:
        """The group's layout (:func:`tiles.layout`)."""
        return tiles.layout(self.p_dtype, self.quant_block, self.slot_dtypes)

    def variant(self, scalars, deferred: bool = False) -> codegen.Variant:
        """The main kernel's variant (``deferred``: the deferred kernel's)."""
        defer = 1 + deferred if self.flags is not None and self.deferring else 0
        return _variant(self.p_dtype, self.g_dtype, self.aligned, isinstance(scalars, list),
                        self.quant_block, self.slot_dtypes, self.skip_tiles and SKIP_TILES,
                        quantized.ENCODER if self.quant_block else "arithmetic",
                        self.skip_stores, self.fast_math, self.chunk_lanes, self.split,
                        defer, span=1 if deferred else self.span,
                        count_flags=self.counting, one_leaf=self.one_leaf and not deferred,
                        looped=self.spans() if self.programs and not deferred else 0,
                        defer_flags=(self.defer_flags or tiles.DEFER_FLAGS) * deferred,
                        pdl=DEPENDENT_LAUNCHES and streams.dependent(self.work.main_leaf.device,
                                                                     deferred))

    def spans(self) -> int:
        """Programs of one main kernel's span each (:attr:`span` blocks)."""
        return -(-self.work.num_blocks // self.span)

    def kernels(self, scalars, counted: bool) -> list[tuple]:
        """(kernel, grid, constants, trailing arguments) of each main launch of this
        group: the main kernel's, and the deferred kernel's of a "split+defer" step."""
        variant = self.variant(scalars)
        out = [(_kernel(self.traced, "main", 0, variant),
                (min(self.programs, self.spans()) if self.programs else self.spans(),),
                _constants_cached(self.traced, self.quant_block, not counted, variant.defer,
                                  self.kind, variant.pdl, self.warps, self.elem_bytes),
                [self.flags] if variant.defer or variant.count_flags else [])]
        if variant.defer:
            deferred = self.variant(scalars, True)
            out.append((_kernel(self.traced, "main", 0, deferred),
                        (self.flags.numel() // (self.defer_flags or tiles.DEFER_FLAGS),),
                        _constants_cached(self.traced, self.quant_block, False, 2, self.kind,
                                          deferred.pdl, self.warps, self.elem_bytes),
                        [self.flags]))
        return out


@lru_cache(maxsize=256)
def _constants_cached(traced, quant_block: int, count: bool | None = None,
                      defer: int = 0, kind: str = "", pdl: bool = False,
                      warps: int = 0, elem_bytes: int = 4, tile: tuple = ()) -> tuple:
    """Constexprs and launch options (``count``: the main kernel's ``COUNT``; ``defer``:
    :attr:`codegen.Variant.defer`; ``kind``: the group's layout, :func:`tiles.layout`;
    ``pdl``: :attr:`codegen.Variant.pdl`; ``warps``: :attr:`GroupLaunch.warps`;
    ``elem_bytes``: :attr:`GroupLaunch.elem_bytes`; ``tile``: (elements, warps) in place
    of the layout's, :attr:`GroupLaunch.reduce_tile`)."""
    block, tile_warps = tile or tiles.tile(traced, quant_block, kind, elem_bytes)
    warps = warps or tile_warps
    constants = {
        "N_LEAF_VALUES": max(len(traced.graph.leaf_values), 1),
        "N_REDUCTIONS": max(len(traced.graph.reductions), 1),
        "BLOCK": block,
        "num_warps": warps,
        # No a*b+c -> fma contraction: every kernel variant (skip_zeros on or off) then
        # rounds each element the same way, and the eager path's way.
        "enable_fp_fusion": False,
    }
    if quant_block:
        constants["QBLOCK"] = quant_block
        cap = tiles.quant_maxnreg(traced, defer)
        if cap and not tiles.INTERPRETING and _NVIDIA:
            constants["maxnreg"] = cap
    elif (not tiles.INTERPRETING and _NVIDIA
          and (cap := tiles.skip_maxnreg(traced, kind, elem_bytes))):
        constants["maxnreg"] = cap
    if count is not None:
        constants["COUNT"] = count
    if pdl:
        constants["launch_pdl"] = True
    return tuple(constants.items())


# (one Variant object per variant: the kernel caches hash it once)
_variant = lru_cache(maxsize=256)(codegen.Variant)


@lru_cache(maxsize=256)
def _kernel(traced, kind: str, level: int, variant: codegen.Variant):
    if kind == "main":
        return codegen.compile_source(codegen.main_source(traced, variant), "ftopt_main")
    source = codegen.reduction_source(traced, level, variant)
    return codegen.compile_source(source, f"ftopt_reduce_{level}")


def _direct_launch_supported() -> bool:
    # From Triton 3.2 a compiled kernel's launcher takes every argument of the signature,
    # constexprs included, in order (older launchers drop the constexprs).
    if tiles.INTERPRETING:
        return False
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    return (major, minor) >= (3, 2)


_DIRECT = _direct_launch_supported()
_COMPILED: dict = {}


def _launch(kernel, grid: tuple, args: list, constants: tuple, device: torch.device,
            key: tuple = ()) -> None:
    """``kernel[grid](*args, **dict(constants))``, then straight to the compiled kernel.

    ``JITFunction.__call__`` binds every argument and recomputes the specialization key
    on each launch (about 0.1 ms per step with this many arguments, measured on an
    H200 host). What decides the specialization of these kernels is fixed per
    (kernel, constants, device, ``key``): every pointer argument is a device tensor
    from the caching allocator (16-byte aligned; the caller puts anything else, and
    the dtypes of tensors it passes directly, in ``key``), and scalars are fp32.
    """
    cache_key = (kernel, constants, device, key)
    found = _COMPILED.get(cache_key)
    if found is not None:
        compiled, tail = found
        compiled[grid + (1,) * (3 - len(grid))](*args, *tail)
        return
    named = dict(constants)
    if tiles.INTERPRETING:
        with interpreter.patches_undone():
            kernel[grid](*args, **named)
        return
    if "maxnreg" in named:
        _fit_cap(kernel, args, grid, named)
    compiled = kernel[grid](*args, **named)
    if _DIRECT and compiled is not None:
        tail = [named[name] for name in kernel.arg_names[len(args):]]
        _COMPILED[cache_key] = (compiled, tail)


# The most spilled registers one register of cap takes back, the steepest measured:
# ptxas 12.8 (H100), 8-bit skip_zeros kernels capped at 72, spilled at 72 / first cap
# within 16: Adam 98 / 120, 48 / 96; AdEMAMix 78 / 112; Lion 48 / 96; LAMB 86 / 112,
# 52 / 96 (1.3-1.75 a register; benchmarks/results/register_caps_step8_h100_1206.log).
_SPILLS_PER_REGISTER = 1.75


def _fit_cap(kernel, args: list, grid: tuple, named: dict) -> None:
    """Sets ``named["maxnreg"]`` to a cap of the grid ``cap + k * CAP_STEP`` (at most
    128) at which the kernel spills at most :data:`tiles.CAP_SPILLS` registers, or drops
    it (the compiler's choice) if none is found or the step is 0.

    From a cap that spills S registers it compiles next at the first cap of the grid
    (S - CAP_SPILLS) / :data:`_SPILLS_PER_REGISTER` registers higher or more. Where
    spills fall no faster than that, every cap below it spills too: the first cap that
    fits is the lowest, and past 128 none fits. Each kernel measured compiles twice, as
    many times as capped then uncapped (stepping up one cap at a time: up to nine)."""
    cap, step = named["maxnreg"], tiles.CAP_STEP
    spills = _spills_at(kernel, args, grid, named, cap)
    while spills > tiles.CAP_SPILLS:
        if step > 0:
            cap += math.ceil((spills - tiles.CAP_SPILLS) / (_SPILLS_PER_REGISTER * step)) * step
        if step <= 0 or cap > 128:
            del named["maxnreg"]
            return
        spills = _spills_at(kernel, args, grid, named, cap)


def _spills_at(kernel, args: list, grid: tuple, named: dict, cap: int) -> int:
    """The registers the kernel spills compiled at register cap ``cap``."""
    named["maxnreg"] = cap
    return _spills(kernel.warmup(*args, grid=grid, **named))


def _spills(compiled) -> int:
    """The registers a compiled kernel spills."""
    compiled._init_handles()
    return compiled.n_spills


@lru_cache(maxsize=16)
def _dummy(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.float32, device=device)


def run_main(traced, groups: list[GroupLaunch], scalars, leaf_bufs, global_buf,
             counts: list, device: torch.device, running: list = ()) -> bool:
    """Launches the main kernel of every group; the first launch also increments the
    step counts (``counts``: old and new count tensor of each counted stage, all on
    ``device``); ``running``: the 0-d fp32 tensors the kernels store the running scalars
    a body computes in (``traced.running_stores``, in order). Returns whether they were
    incremented (no launch if no group has work).
    """
    counts, count_key, counted = _count_args(traced, counts, device)
    launched = False
    side = streams.fork(device) if any([g.beside for g in groups]) else None
    for group, buf in zip(groups, leaf_bufs):
        w = group.work
        if w.num_blocks == 0:
            continue
        quant = bool(group.quant_block)
        roles = _main_roles(group.traced, quant)
        args = [*group.args(roles, scalars, buf, global_buf), *counts, *running]
        with streams.on(side if group.beside else None):  # (a carve: see streams)
            for kernel, grid, constants, more in group.kernels(scalars, counted):
                _launch(kernel, grid, args + more, constants, device,
                        (count_key, _aligned(running)))
        counted = launched = True
    streams.join(device, side)
    return launched


def _count_args(traced, counts: list, device: torch.device) -> tuple:
    """The count arguments of the main launches, their specialization key, and whether
    they are already counted. ``counts`` is empty when the counts were incremented
    before the launch (:func:`ftopt.lowering.counts.advance_counts`: some count is not on
    the kernels' device, as in a state loaded with another ``map_location``): the kernel
    still takes a pointer pair per counted stage, and gets dummies with ``COUNT`` off."""
    counted = False
    if not counts:
        n = len(codegen.counted_stages(traced))
        counts = [_dummy(device)] * (2 * n)
        counted = True
    key = (tuple(c.dtype for c in counts), all([c.data_ptr() % 16 == 0 for c in counts]))
    return counts, key, counted


def _aligned(tensors) -> bool:
    return all([t.data_ptr() % 16 == 0 for t in tensors])


@dataclass
class BoundLaunch:
    """One group's main launch with every argument but the scalars bound
    (``before[grad_at]``: the gradient address table, replaced when gradients move), its
    tensors as their addresses (:func:`bound_arg`)."""

    group: GroupLaunch
    runner: object
    before: list
    after: list
    grad_at: int
    tensors: list = field(default_factory=list)  # (those addresses' tensors, kept alive)


def bound_arg(x):
    """A bound launch's argument: a tensor as its address (the launcher takes an int as
    it is, a tensor with a call of its ``data_ptr`` and a driver query of the pointer),
    except under the interpreter, which reads tensors. H200 host, GPT-2 8-bit Adam, a
    donated call (us, median of 300, three runs, with the second stream's events reused:
    ``streams.fork``): 90% of the embedding's rows zero 234, 243, 189 -> 184, 203, 174;
    dense 153, 148, 117 -> 115, 112, 109; no skip_zeros 112, 120, 98 -> 101, 89, 90."""
    return x.data_ptr() if isinstance(x, torch.Tensor) and not tiles.INTERPRETING else x


def bind_main(traced, groups: list[GroupLaunch], scalars, counts: list,
              device: torch.device, running: list = ()) -> list | None:
    """The main launches of a step with no reduction pass, bound once: per group with
    work, a :class:`BoundLaunch` whose ``runner(*before, *scalars, *after)`` is the
    launch :func:`run_main` makes with these ``counts`` (scalars as floats, or a device
    buffer); ``None`` where a launch is not yet compiled or cannot be bound (the
    interpreter, Triton before 3.2, a step with reductions).

    ``run_main`` rebuilds every launch's arguments and looks its kernel up in four caches
    on each step; a donated step over the same tensors repeats all of it, so
    :meth:`ftopt.lowering.execute.PreparedStep.launch` keeps the bound launches instead.
    """
    if not _DIRECT or traced.levels != 0:
        return None
    counts, count_key, counted = _count_args(traced, counts, device)
    dummy = _dummy(device)
    bound = []
    for group in groups:
        w = group.work
        if w.num_blocks == 0:
            continue
        roles = _main_roles(group.traced, bool(group.quant_block))
        for kernel, grid, constants, more in group.kernels(scalars, counted):
            found = _COMPILED.get((kernel, constants, device,
                                   (count_key, _aligned(running))))
            if found is None:
                return None
            compiled, tail = found
            before = [w.main_leaf, w.main_start, w.numel,
                      *[group.addresses[r] for r in roles]]
            after = [group.leaf_values, dummy, dummy, *group.qmaps, *counts, *running,
                     *more, *tail]
            bound.append(BoundLaunch(group, compiled[grid + (1, 1)],
                                     list(map(bound_arg, before)), list(map(bound_arg, after)),
                                     3 + roles.index("g"), before + after))
        counted = True
    return bound


@lru_cache(maxsize=256)
def _main_roles(traced, quantized: bool) -> tuple:
    return tuple(codegen.input_roles(traced, quantized)
                 + codegen.output_roles(traced, quantized))
