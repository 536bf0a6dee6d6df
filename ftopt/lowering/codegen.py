"""Rule graph -> Triton source: one main kernel per chain and dtype group, plus one
reduction kernel per level of norms.

Every kernel walks a work table: program ``pid`` handles ``BLOCK`` elements of leaf
``block_leaf[pid]`` starting at ``block_start[pid]``. Tensors are reached through int64
address tables (one entry per leaf and role), so one launch covers every leaf.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ftopt import program
from ftopt.lowering import half_tiles, lanes, leaf_slots, quantized, split, tiles, word_selects
from ftopt.lowering.kernel_files import compile_source  # noqa: F401 (launch, devices)
from ftopt.lowering.roles import input_roles, kept_stores, output_roles, role_dtypes, slot_signs
from ftopt.lowering.sym_algebra import SymbolicAlgebra, as_name
from ftopt.lowering.symbolic import Graph, Reduction
from ftopt.rule_transform import RuleTransform


@dataclass(eq=False)
class TracedChain:
    """A chain traced into one graph, with the roles (tensors) its kernels touch.

    ``in_place``: the step is donated and every stage is skip-aware, so zero-gradient
    lanes are neither loaded nor stored (their old values stay in memory).
    ``donated``: the kernels write the states over their inputs, so a slot whose new value
    is its old one needs no store (:func:`ftopt.lowering.roles.elided_slots`).
    ``output``: ``"p"`` (a step: writes the new params) or ``"u"`` (an update: writes
    the chain's update in fp32 and reads params only where a rule uses them).
    ``seeded``: a segment after a matrix stage: the first stage's ``u`` is read from the
    ``x`` role (fp32), and ``g``, the raw gradient, only decides ``skip_zeros``.
    ``"mixed"``: only for the leaves whose per-leaf ``seeded`` value is set (the others,
    branches that start in this segment, read ``g``; their ``x`` address is 0).
    """

    graph: Graph
    stages: list[RuleTransform]
    skips: list[bool]
    in_place: bool
    output: str = "p"
    donated: bool = False
    slot_roles: list[tuple[int, str]] = field(default_factory=list)  # (stage, slot name)
    stores: list[tuple[str, str]] = field(default_factory=list)  # (role, node)
    levels: int = 0
    seeded: bool | str = False
    # The stages that are alternatives at each position (``masked``/``partition``): a
    # position of several reads its per-step scalars by the leaf's ``branch`` value.
    positions: list = field(default_factory=list)
    flagged: list = field(default_factory=list)
    owner_skips: list = field(default_factory=list)
    # ``st{i}_{name}`` -> the per-leaf flag (node) of a flagged position with state: a
    # leaf it leaves out has no state there (address 0), so its loads and stores are off.
    slot_flags: dict = field(default_factory=dict)
    # ``st{i}_{name}`` of the per-leaf slots (one 0-d fp32 tensor per leaf, never 8 or 16
    # bits): loaded once per program, stored by the first program of each leaf.
    leaf_slots: set = field(default_factory=set)
    # ``(run{i}_{name}, node)`` of the running scalars a body computes (a global value of
    # this step, :attr:`ftopt.rules.Rule.running`): lane 0 of program 0 stores each.
    running_stores: list = field(default_factory=list)


def trace_chain(stages: list[RuleTransform], skips: list[bool], donate: bool,
                output: str = "p", seeded: bool | str = False, positions: list | None = None,
                flagged: list | None = None, owner_skips: list | None = None,
                skip_lanes: bool = True) -> TracedChain:
    """Runs every position's body on symbols, feeding each position's ``u`` to the next.

    ``donate``: the step writes over its inputs; ``skip_lanes``: a donated skip_zeros step
    may then leave zero-gradient lanes unloaded and unstored (``in_place``, where it can).

    ``skips[i]``: stage ``i`` is inside a skip_zeros chain; its update is zero and its
    states keep their old values where the raw gradient is zero, as the eager path does.
    ``positions[k]``: the stages (alternatives, one per partition branch) at step ``k``
    (default: stage ``k`` alone); ``flagged[k]``: position ``k`` reads a per-leaf flag
    (a mask leaves some leaves out: their ``u`` passes through); ``owner_skips[k]``: its
    skip_zeros applies to the leaves the flag keeps only.
    """
    if positions is None:
        positions = [(i,) for i in range(len(stages))]
        flagged = [s.rule.leaf_mask is not None for s in stages]
    if owner_skips is None:
        owner_skips = [False] * len(positions)
    stage_skips, skips = skips, [skips[pos[0]] for pos in positions]
    g = Graph()
    g.add("tl.load(g_ptr + offs{GMASK}).to(tl.float32)", (), "elem", name="g")
    masking = any(skips)
    zero_node = g.add("g == 0.0", ("g",), "elem", name="zero") if masking else None
    # -0.0 where g is zero (p + (-0.0) is p, -0.0 too), from its bits: a -0.0 literal loses
    # its sign in some Triton versions. (``|g| * -1.0`` before: a value live from g's load
    # to the last select; 8-bit Adam with skip_zeros 144 -> 116 registers; sm_90.)
    neg_zero = g.add(f"tl.full([BLOCK], {-2**31}, tl.int32).to(tl.float32, bitcast=True)",
                     (), "elem", name="neg_zero") if masking else None
    # (A leaf passed through a branch-own skip_zeros keeps its update where g is zero:
    # the kernel must store p + u there, so it loads every lane.)
    in_place = (donate and skip_lanes and output == "p" and bool(skips) and all(skips)
                and not any(o and f for o, f in zip(owner_skips, flagged)))
    if in_place:
        g.add("g != 0.0", ("g",), "elem", name="keep")
    p = g.add("tl.load(p_ptr + offs{LMASK}).to(tl.float32)", ("keep",) if in_place else (),
              "elem", name="p")
    traced = TracedChain(g, stages, list(skips), in_place, output, donate, seeded=seeded,
                         positions=list(positions), flagged=list(flagged),
                         owner_skips=list(owner_skips))
    algebra = SymbolicAlgebra(traced, p, zero_node, neg_zero)
    first = g.sym("g")
    if seeded == "mixed":
        flag = g.leaf_value(None, "seeded") != 0.0
        traced.slot_flags["x"] = flag.name  # (no x address where the flag is off)
        x = g.add(f"tl.load(x_ptr + offs{{LMASK@{flag.name}}})",
                  ("keep", flag.name) if in_place else (flag.name,), "elem", name="x_old")
        first = algebra.ops().where(flag, x, first)
    elif seeded:
        first = g.add("tl.load(x_ptr + offs{LMASK})", ("keep",) if in_place else (), "elem",
                      name="x")
    # (In place, zero-gradient lanes are neither loaded nor stored: no selects.)
    u = program.trace_chain([stages[pos[0]] for pos in positions], skips, algebra, first,
                            selects=not in_place, zero_from=g.sym("g"), owner_skips=owner_skips)
    if output == "p":
        traced.stores.append(("p_out", (p + u).name))
    else:
        traced.stores.append(("u_out", as_name(u, g)))
    traced.levels = max((r.level for r in g.reductions), default=0)
    if in_place and (g.reductions or traced.leaf_slots or traced.running_stores):
        # Norms (of p, say) need every lane loaded, and a per-leaf slot's skip_zeros reads
        # a norm (of the non-zero lanes): select old values instead.
        return trace_chain(stages, stage_skips, donate, output=output, seeded=seeded,
                           positions=positions, flagged=flagged, owner_skips=owner_skips,
                           skip_lanes=False)
    return traced


@dataclass(frozen=True)
class Variant:
    """What changes the generated code besides the chain."""

    p_dtype: torch.dtype
    g_dtype: torch.dtype
    aligned: bool  # every address of the group is 16-byte aligned
    scalar_args: bool  # per-step scalars are kernel arguments (else loaded from a buffer)
    quant_block: int = 0  # elements per absmax of 8-bit slots (0: fp32 slots)
    # ``(slot, dtype)`` of each 16-bit slot (``st{i}_{name}``); the others are fp32.
    slot_dtypes: tuple = ()
    # A donated 8-bit step of a skip_zeros chain: a program whose gradients are all zero
    # returns at once (its params and 8-bit blocks stay as they are, byte for byte).
    skip_tiles: bool = False
    encoder: str = "arithmetic"  # of 8-bit slots (quantized.ENCODER)
    # A donated skip_zeros step: a program whose gradients are all zero writes nothing
    # (its bytes stay); 8-bit blocks then need no select of old codes (one a program).
    skip_stores: bool = False
    fast_math: bool = False  # approximate sqrt and division in the body (tiles.FAST_MATH)
    # A donated skip_zeros step of a plain chain (tiles.chunk_lanes): the tile is rows of
    # this many lanes; a row whose gradients are all zero is neither loaded nor stored.
    chunk_lanes: int = 0
    # A donated skip_zeros step whose all-zero programs may write nothing (as
    # ``skip_stores``): a program with no zero gradient runs the body with the skip
    # masks constant (its selects fold away), one with only zeros returns at once.
    split: bool = False
    # "split+defer" (ftopt.lowering.split): 1, the main kernel (a program with some zero
    # gradients, or a tail program, stores a flag); 2, the deferred kernel (runs them).
    defer: int = 0
    # The body of a "split" kernel's program without zero gradients (the skip masks
    # constant): no select of an all-zero 8-bit block's old codes and absmax.
    dense: bool = False
    # A "split" main kernel's blocks a program (tiles.SPANS): it checks the gradients of
    # all of them at once, then runs each (ftopt.lowering.split.spanned).
    span: int = 1
    # A "split" main kernel (not "split+defer") that flags its programs with some zero
    # gradients (1) and with only zeros (2), for ftopt.lowering.skip_watch.
    count_flags: bool = False
    one_leaf: bool = False  # the group's blocks are one leaf's, in order
    defer_flags: int = 0  # the deferred kernel's flags a program (tiles.DEFER_FLAGS)
    looped: int = 0  # the spans a program of fewer loops over (split.spanned)
    pdl: bool = False  # a programmatic dependent launch (ftopt.lowering.streams.PDL)


def _prelude(roles: list[str], dtypes: dict[str, str], variant: Variant) -> list[str]:
    lines = [
        "pid = tl.program_id(0)",
        "leaf = 0" if variant.one_leaf else "leaf = tl.load(block_leaf_ptr + pid)",
        "start = pid.to(tl.int64) * BLOCK" if variant.one_leaf else
        "start = tl.multiple_of(tl.load(block_start_ptr + pid), BLOCK)",
        "n = tl.load(numel_ptr + leaf)",
        "offs = start + tl.arange(0, BLOCK)" if not variant.chunk_lanes else
        f"offs = start + {lanes.rows(variant.chunk_lanes)}",
    ]
    for role in roles:
        pointer = f"tl.load({role}_addr_ptr + leaf).to(tl.pointer_type({dtypes[role]}))"
        if variant.aligned:
            # On the pointer, not the integer it is cast from: the hint does not survive
            # the cast, and without it no access is vectorized (LDG.E.128: 4-8 lanes).
            pointer = f"tl.multiple_of({pointer}, 16)"
        lines.append(f"{_pointer_var(role)} = {pointer}")
    return lines


def _pointer_var(role: str) -> str:
    return {"g": "g_ptr", "p": "p_ptr", "x": "x_ptr"}.get(role, role)


def _signature(roles: list[str], extra: list[str], n_scalars: int, variant: Variant,
               extra_constexprs: tuple = ()) -> str:
    args = ["block_leaf_ptr", "block_start_ptr", "numel_ptr"]
    args += [f"{r}_addr_ptr" for r in roles]
    args += [f"sa{i}" for i in range(n_scalars)] if variant.scalar_args else ["scalars_ptr"]
    args += ["leaf_values_ptr", "reductions_ptr", "global_reductions_ptr"]
    if variant.quant_block:
        args += ["qmap_signed_ptr", "qmap_unsigned_ptr"]
    args += extra
    args += ["N_LEAF_VALUES: tl.constexpr", "N_REDUCTIONS: tl.constexpr", "BLOCK: tl.constexpr"]
    if variant.quant_block:
        args += ["QBLOCK: tl.constexpr"]
    args += [f"{name}: tl.constexpr" for name in extra_constexprs]
    return ", ".join(args)


def counted_stages(traced: TracedChain) -> list[int]:
    """Stages with a step count: the main kernel increments them (program 0 of one
    launch per step, the launch with ``COUNT``)."""
    return [i for i, stage in enumerate(traced.stages) if stage.rule.counted]


def _count_lines(traced: TracedChain) -> tuple[list[str], list[str]]:
    """(arguments, lines) of the step-count increments."""
    args, lines = [], ["if COUNT:", "    if pid == 0:"]
    for i in counted_stages(traced):
        args += [f"count{i}_in_ptr", f"count{i}_out_ptr"]
        lines.append(f"        tl.store(count{i}_out_ptr, tl.load(count{i}_in_ptr) + 1)")
    return args, (lines if args else [])


def _body_lines(traced: TracedChain, nodes, masks: dict[str, str],
                variant: Variant, tail: bool, p_word: bool = False,
                packed: bool = False) -> list[str]:  # (packed: g's word mask nz beside it)
    signs = slot_signs(traced) if variant.quant_block else {}
    half = dict(variant.slot_dtypes)
    lines = []
    for node in nodes:
        expr = node.expr.replace("{GMASK}", masks["GMASK"]).replace("{LMASK}", masks["LMASK"])
        role = node.name[: -len("_old")] if node.name.endswith("_old") else None
        if role in traced.slot_flags:
            expr = expr.replace(f"{{LMASK@{traced.slot_flags[role]}}}",
                                lanes.load_mask(traced, masks, tail, role))
        if role in signs:
            lines += quantized.load_lines(node.name, role, signs[role],
                                          lanes.load_mask(traced, masks, tail, role))
            continue
        if role in half:  # 16-bit storage: read exactly into fp32
            load = f"tl.load({role}_in + offs{lanes.load_mask(traced, masks, tail, role)})"
            lines += lanes.half_load_lines(node.name, load, half[role], True)
            continue
        if (node.name == "g" and packed) or (node.name == "p" and variant.p_dtype in (
                torch.float16, torch.bfloat16)):
            load, _, cast = expr.rpartition(".to(")
            assert cast == "tl.float32)", expr
            lines += ([f"g_raw = {load}", "nz = ftopt_nonzero_words(g_raw)",
                       "g = g_raw.to(tl.float32)"] if node.name == "g" else
                      lanes.half_load_lines("p", load, variant.p_dtype, False, p_word))
            continue
        if variant.scalar_args and node.name.startswith("s") and expr.startswith(
                "tl.load(scalars_ptr"):
            expr = "sa" + node.name[1:]
        lines.append(f"{node.name} = {expr}")
    return lines


def main_source(traced: TracedChain, variant: Variant) -> str:
    quant = bool(variant.quant_block)
    roles = input_roles(traced, quant) + output_roles(traced, quant)
    dtypes = role_dtypes(traced, variant)
    stores, words = word_selects.moved(traced, kept_stores(traced, quant), variant)
    nodes = main_nodes(traced, quant, stores, [*words.values(), *["zero"] * bool(words)])
    bodies = [_body_and_stores(traced, nodes, stores,
                               lanes.masks(traced, tail, bool(variant.chunk_lanes)), variant,
                               dtypes, tail, words) for tail in (False, True)]
    if variant.chunk_lanes:
        bodies = [lanes.with_live_rows(body, variant.chunk_lanes) for body in bodies]
    if variant.split and variant.defer != 2:
        dense = replace(variant, skip_stores=False, split=False, dense=True)
        bodies[0] = split.split_on_zeros(bodies[0], _body_and_stores(
            traced, nodes, stores, lanes.masks(traced, False), dense, dtypes, False, words),
            bool(variant.defer), variant.count_flags)
        if variant.defer:
            bodies[1] = split.deferred_tail()
    count_args, count_lines = _count_lines(traced)
    prelude = _prelude(roles, dtypes, variant)
    if variant.span > 1:
        body = split.spanned(prelude, *bodies, variant.span, dtypes["g"],
                             2 if variant.defer or variant.count_flags else None,
                             variant.one_leaf, variant.looped)
        prelude = prelude[:1]
    else:
        body = (split.deferred_blocks if variant.defer == 2 else split.full_or_tail)(*bodies)
    helpers = {**traced.graph.helpers,
               **word_selects.helpers(traced, variant, lanes.bf16_convert(traced))}
    if word_selects.takes(traced, variant, half_tiles.VOLATILE[
            "select" if any(traced.skips) else "plain"]):
        body = [lanes.volatile_loads(x) for x in body]
    body, helpers = _with_fast_math(body, helpers, variant)
    if variant.quant_block and variant.encoder.startswith("lg2"):
        helpers = {**helpers, "ftopt_lg2": quantized.LG2_HELPER[
            "interpreter" if tiles.INTERPRETING else "cuda"]}
    if variant.skip_tiles:
        body = ["if tl.sum((tl.load(g_ptr + offs, mask=offs < n, other=0.0)"
                ".to(tl.float32) != 0.0).to(tl.int32)) > 0:"] + ["    " + x for x in body]
    lines = (split.deferred(prelude, body, variant.defer_flags) if variant.defer == 2
             else prelude + count_lines + body)
    if variant.pdl:  # (the kernel before ends first; the next may start with the last programs)
        lines = ["tl.extra.cuda.gdc_wait()", "tl.extra.cuda.gdc_launch_dependents()", *lines]
    running_args = [f"{role}_ptr" for role, _ in traced.running_stores]
    flags = ["flags_ptr"] * bool(variant.defer or variant.count_flags)
    sig = _signature(roles, count_args + running_args + flags,
                     len(traced.graph.scalars), variant, ("COUNT",))
    return _kernel("ftopt_main", sig, lines, helpers)


def main_nodes(traced: TracedChain, quantized: bool, kept: list | None = None,
               loads: list = ()) -> list:
    """The nodes the main kernel computes: what its stores (``kept``, default all but the
    elided ones), flags and ``loads`` need; loads first (``tiles.LOADS_FIRST``)."""
    kept = kept_stores(traced, quantized) if kept is None else kept
    nodes = traced.graph.closure([node for _, node in kept] + list(loads)
                                 + [node for _, node in traced.running_stores]
                                 + list(traced.slot_flags.values()))
    return traced.graph.loads_first(nodes) if tiles.LOADS_FIRST and not quantized else nodes


def _broadcast(value: str) -> str:
    """``value`` as a [BLOCK] tensor, every bit kept: a product with 1.0 (a sum with a
    -0.0 literal, which would keep a -0.0 too, becomes +0.0 in Triton 3.6 on an H200)."""
    return f"tl.full([BLOCK], 1.0, tl.float32) * {value}"


def _body_and_stores(traced: TracedChain, nodes, kept: list, masks: dict, variant: Variant,
                     dtypes: dict, tail: bool, words: dict) -> list[str]:
    # (words: role -> the loaded value whose word it stores where zero, word_selects.moved)
    signs = slot_signs(traced) if variant.quant_block else {}
    packed = bool(words) and word_selects.packed(traced, variant)
    lines = _body_lines(traced, nodes, masks, variant, tail, "p_out" in words, packed)
    names = {node.name for node in nodes}
    for role, node in traced.running_stores:  # (every group's program 0: the same value)
        lines.append(f"tl.store({role}_ptr + offs * 0, {_broadcast(node)}, "
                     f"mask=offs == tl.where(pid == 0, 0, -1))")
    stores: list[str] = []
    for role, node in kept:
        value = node
        if traced.graph.nodes[node].kind != "elem":  # broadcast a per-leaf value
            value = _broadcast(node)
        slot = role[: -len("_out")]
        flag = traced.slot_flags.get(slot)
        if slot in traced.leaf_slots:
            lines.append(leaf_slots.store(role, value, flag))
            continue
        store_mask = (masks["SMASK"] if flag is None
                      else lanes.flag_mask(traced, flag, False))
        if slot in signs:
            stage = int(slot[2:].split("_", 1)[0])
            zero = "zero" if traced.skips[stage] and not variant.dense else None
            # (an all-zero program writes nothing, returns at once, or in a split kernel's
            # full blocks never reaches this body)
            quiet = variant.skip_stores or variant.skip_tiles or (variant.split and not tail)
            stores += quantized.store_lines(slot, f"{slot}_old", value, signs[slot], zero,
                                            tail, variant.encoder, flag, quiet)
            continue
        # (a 16-bit NaN that stays a NaN keeps its bits: its old value's, where loaded)
        old = "p" if role == "p_out" else f"{slot}_old"
        old = old if old in names else None
        keep = f"{words[role]}_raw" if role in words else None
        if dict(variant.slot_dtypes).get(slot) == torch.bfloat16:
            stores += lanes.bf16_store_lines(role, slot, value, store_mask, old,
                                             lanes.bf16_convert(traced),
                                             lanes.nan_from_word(traced) or bool(keep), keep,
                                             packed)
            continue
        if old is not None and dtypes[role] in ("tl.float16", "tl.bfloat16"):
            value = lanes.half_value(value, old, dtypes[role], keep, packed)
        stores.append(f"tl.store({_pointer_var(role)} + offs, ({value}).to({dtypes[role]})"
                      f"{store_mask})")
    if not (variant.skip_stores and traced.skips and all(traced.skips)):
        return lines + stores
    # Nothing is written where every gradient of the program is zero: the donated
    # params and states keep their bytes, as the skip_zeros contract asks.
    zero = "(g == 0.0)" if not tail else "((g == 0.0) | (offs >= n))"
    return lines + [f"if tl.min({zero}.to(tl.int32)) == 0:"] + ["    " + x for x in stores]


def reduction_source(traced: TracedChain, level: int, variant: Variant) -> str:
    reductions = level_reductions(traced, level)
    roles = input_roles(traced, bool(variant.quant_block))
    dtypes = role_dtypes(traced, variant)
    nodes = traced.graph.closure([r.source for r in reductions])
    bodies = []
    for tail in (False, True):
        lines = _body_lines(traced, nodes, lanes.masks(traced, tail), variant, tail)
        for j, red in enumerate(reductions):
            x = red.source
            square = (f"({x} * {x} + tl.zeros([BLOCK], tl.float32))" if red.square
                      else f"({x} + tl.zeros([BLOCK], tl.float32))")
            if tail:
                square = f"tl.where(in_range, {square}, 0.0)"
            lines.append(f"tl.store(partials_ptr + pid * {len(reductions)} + {j}, "
                         f"tl.sum({square}))")
        bodies.append(lines)
    lines = _prelude(roles, dtypes, variant) + split.full_or_tail(*bodies)
    # The main kernel's math, approximate where its is: a trust ratio's norm of ``u`` then
    # scales the ``u`` it was taken of (LAMB's ``u`` cancelling 33-fold put an ulp of it,
    # rounded one way here and another there, 2e-6 into the update, the H100's fuzz).
    lines, helpers = _with_fast_math(lines, traced.graph.helpers, variant)
    sig = _signature(roles, ["partials_ptr"], len(traced.graph.scalars), variant)
    return _kernel(f"ftopt_reduce_{level}", sig, lines, helpers)


def _with_fast_math(lines: list[str], helpers: dict, variant: Variant) -> tuple[list, dict]:
    """``lines`` and ``helpers`` with the approximate square root and division of a
    fast-math variant (:data:`tiles.FAST_MATH`), the same in every kernel of a step."""
    if not variant.fast_math:
        return lines, helpers
    return ([lanes.fast_math(x) for x in lines],
            {**helpers, "ftopt_fast_sqrt": lanes.FAST_SQRT})


def level_reductions(traced: TracedChain, level: int) -> list[Reduction]:
    return [r for r in traced.graph.reductions if r.level == level]


def _kernel(name: str, signature: str, lines: list[str], helpers: dict | None = None) -> str:
    called = "".join(source + "\n\n" for _, source in sorted((helpers or {}).items()))
    return ("import triton\nimport triton.language as tl\n\n\n" + called + "@triton.jit\n"
            f"def {name}({signature}):\n" + "\n".join("    " + x for x in lines) + "\n")
