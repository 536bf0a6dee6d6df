"""Random optimizer steps for the fuzzed contract: chain structures, hyperparameters, pytrees.

Everything is drawn through a :class:`registry.Source`, so the same code serves hypothesis
(``HypothesisSource``: shrinkable draws, in pytest) and a plain ``random.Random``
(``RandomSource``: the GPU runner, where hypothesis may be missing). A *structure*
(:class:`Structure`) is everything that decides which kernels compile (the transforms and
their boolean options, skip_zeros, the state format, tensor/scheduled hyperparameters); a
:class:`Case` adds what changes freely between calls: float hyperparameters, the pytree,
its dtypes and values, the gradients and their zero patterns. The GPU runner reuses a
bounded pool of structures, since on a GPU compiling a kernel costs far more than a step.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from registry import BY_NAME, Entry, Source, by_trait

import ftopt
from ftopt.base import GradientTransformation


class RandomSource:
    """A :class:`registry.Source` over ``random.Random``."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def floats(self, lo: float, hi: float) -> float:
        return self.rng.uniform(lo, hi)

    def integers(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, options: Sequence[Any]) -> Any:
        return self.rng.choice(list(options))

    def boolean(self, p: float = 0.5) -> bool:
        return self.rng.random() < p


class HypothesisSource:
    """A :class:`registry.Source` over hypothesis' ``st.data()`` (draws shrink)."""

    def __init__(self, data: Any):
        from hypothesis import strategies as st

        self.data, self.st = data, st

    def floats(self, lo: float, hi: float) -> float:
        return self.data.draw(self.st.floats(lo, hi, allow_nan=False, allow_infinity=False))

    def integers(self, lo: int, hi: int) -> int:
        return self.data.draw(self.st.integers(lo, hi))

    def choice(self, options: Sequence[Any]) -> Any:
        return self.data.draw(self.st.sampled_from(list(options)))

    def boolean(self, p: float = 0.5) -> bool:
        return self.data.draw(self.st.integers(0, 999)) < int(p * 1000)


@dataclass(frozen=True)
class Part:
    """One registry entry with its structural options (and inner parts for combinators)."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()
    inner: tuple[Part, ...] = ()

    @property
    def entry(self) -> Entry:
        return BY_NAME[self.name]

    def flat(self) -> list[Part]:
        return [self] + [q for p in self.inner for q in p.flat()]


@dataclass(frozen=True)
class Structure:
    """What decides the kernels: see the module docstring.

    ``skip``: "off", "marker" (``skip_zeros()`` at index ``skip_at`` of the top chain),
    "wrap" (``skip_zeros(tx)``) or "keyword" (the alias' ``skip_zeros=True``). ``quant``:
    "wrapper" (``quantize_states(tx, 8, min_size=min_size)``) or "keyword" (the alias'
    ``state_bits=8``, min_size 4096). ``state_dtype``: "" or "bfloat16"/"float16", the
    storage of the float states that are not 8-bit (the alias' keyword with "keyword", else
    passed to ``quantize_states``).
    """

    parts: tuple[Part, ...]
    skip: str = "off"
    skip_at: int = 0
    bits: int = 32
    quant: str = "wrapper"
    min_size: int = 0
    state_dtype: str = ""
    tensors: bool = False
    schedules: bool = False
    named: bool = False

    @property
    def fusible(self) -> bool:
        """Every part fuses: 8-bit states included, where a leaf also keeps wide states
        (copies of the params, the registry's ``wide_states``) that the 8-bit kernels load
        and store as floats."""
        return all(p.entry.fusible for top in self.parts for p in top.flat())

    @property
    def alias(self) -> Part | None:
        last = self.parts[-1]
        return last if last.entry.kind == "alias" else None

    @property
    def reads_others(self) -> bool:
        """Whether a stage reads elements other than its own (a norm, or a matrix stage).
        :attr:`exact_off_zeros` holds for finite values: with a NaN or an infinity in the
        step, a stage that keeps zeros gives 0·NaN = NaN at a zero gradient, which the
        plain chain's norm then reads where skip_zeros' reads 0 (SPEC §3's norms)."""
        return any((p.entry.norms or p.entry.mixes) and p.entry.kind != "combinator"
                   for top in self.parts for p in top.flat())

    @property
    def exact_off_zeros(self) -> bool:
        """Whether skip_zeros leaves the non-zero-gradient elements bit-identical to the
        plain chain: no norm or matrix stage reads an update (or its own state) that
        skip_zeros changed (SPEC §3). A matrix stage (Muon's orthogonalisation) mixes every
        element of its leaf, its momentum kept at the zeros included. A reduction (the
        registry's ``norms``: a global or per-leaf norm, or one over each row as
        ``scale_by_row_norm``'s norm and ``centralize``'s mean) sees a skipped element as
        0 where the plain chain sees a stateful stage's update there (AdEMAMix's momentum,
        non-zero at a zero gradient), so after such a stage every element of that row,
        leaf or tree may differ; the zero-gradient elements themselves stay exact."""
        changed = False
        for top in self.parts:
            for p in top.flat():
                e = p.entry
                if e.kind == "combinator":
                    continue
                if e.norms and (changed or e.kind == "alias" or e.norm_after_state):
                    return False
                if e.mixes and (changed or e.states):
                    return False
                changed = changed or not e.keeps_zero
        return True

    def describe(self) -> str:
        def part(p: Part) -> str:
            opts = ",".join(f"{k}={v}" for k, v in p.options)
            inner = "(" + ", ".join(part(q) for q in p.inner) + ")" if p.inner else ""
            return f"{p.name}{'[' + opts + ']' if opts else ''}{inner}"
        bits = f"bits={self.bits}/{self.quant}/min_size={self.min_size}" if self.bits == 8 \
            else "bits=32"
        bits += f" state_dtype={self.state_dtype}" if self.state_dtype else ""
        return (f"{' -> '.join(part(p) for p in self.parts)} | skip={self.skip}@"
                f"{self.skip_at} {bits} tensors={self.tensors} schedules={self.schedules} "
                f"named={self.named}")


_PREFIXES = ("clip_by_global_norm", "add_decayed_weights", "scale", "clip_by_param_norm_ratio")


def _draw_part(src: Source, entries: list[Entry]) -> Part:
    e = src.choice(entries)
    return Part(e.name, tuple(sorted(e.draw_options(src).items())))


def _building_blocks() -> list[Entry]:
    return [e for e in by_trait(kind="transform", fusible=True)]


def draw_structure(src: Source, fusible: bool = False, skip: bool = False) -> Structure:
    """A random structure: 1-5 fusible transforms in any order, or an alias alone or
    after a wrapper, or (sometimes) a chain through a combinator that runs eagerly.
    ``fusible``/``skip``: only structures that fuse / that use skip_zeros."""
    modes = ["chain", "chain", "chain", "alias", "alias"] + ([] if fusible else ["combinator"])
    mode = src.choice(modes)
    blocks = _building_blocks()
    if mode == "chain":
        parts = tuple(_draw_part(src, blocks) for _ in range(src.integers(1, 5)))
    elif mode == "alias":
        prefix = (_draw_part(src, [BY_NAME[n] for n in _PREFIXES]),) if src.boolean(0.3) \
            else ()
        aliases = by_trait(kind="alias", fusible=True) if fusible else by_trait(kind="alias")
        parts = (*prefix, _draw_part(src, aliases))
    else:
        comb = src.choice(["masked", "partition", "set_to_zero", "stateless", "chain",
                           "named_chain"])
        e = BY_NAME[comb]
        n_inner = {"masked": 1, "partition": 2, "chain": 2, "named_chain": 2}.get(comb, 0)
        inner = tuple(_draw_part(src, blocks) for _ in range(n_inner))
        middle = Part(comb, tuple(sorted(e.draw_options(src).items())), inner)
        before = tuple(_draw_part(src, blocks) for _ in range(src.integers(0, 1)))
        after = tuple(_draw_part(src, blocks) for _ in range(src.integers(0, 1)))
        parts = (*before, middle, *after)
    s = Structure(parts)
    alias_alone = s.alias is not None and len(parts) == 1
    ways = ["marker", "marker", "wrap"] + (["keyword"] if alias_alone else [])
    s = replace(s, skip=src.choice(ways if skip else ["off", *ways]),
                skip_at=src.integers(0, len(parts)), named=mode == "chain" and src.boolean(0.2))
    if any(p.entry.eight_bit for top in parts for p in top.flat()) and src.boolean(0.35):
        quant = "keyword" if s.alias is not None and src.boolean(0.15) else "wrapper"
        s = replace(s, bits=8, quant=quant, min_size=src.choice([0, 1, 64, 200]))
    s = replace(s, tensors=src.boolean(0.3), schedules=src.boolean(0.2))
    if any(p.entry.eight_bit for top in parts for p in top.flat()) and src.boolean(0.2):
        s = replace(s, state_dtype=src.choice(["bfloat16", "float16"]))
    return s


# ------------------------------------------------------------------------------------------
# Building transforms
# ------------------------------------------------------------------------------------------


def draw_hparams(src: Source, s: Structure, device: Any) -> list:
    """Float hyperparameters for every part (nested like the parts)."""
    def one(p: Part) -> dict:
        h = p.entry.draw_floats(src, tensors=s.tensors, device=device, schedules=s.schedules)
        if p.inner:
            h["__inner__"] = [one(q) for q in p.inner]
        return h
    return [one(p) for p in s.parts]


def _make(p: Part, h: dict, **alias_kw: Any) -> GradientTransformation:
    kw = {**dict(p.options), **{k: v for k, v in h.items() if k != "__inner__"}}
    if p.inner:
        kw["inner"] = [_make(q, hq) for q, hq in zip(p.inner, h["__inner__"])]
    return p.entry.make(**kw, **alias_kw)


def build(s: Structure, hps: list, skip: bool = True) -> GradientTransformation:
    """The transform of ``s`` (without skip_zeros when ``skip`` is False: the control)."""
    skip_mode = s.skip if skip else "off"
    txs = []
    for i, (p, h) in enumerate(zip(s.parts, hps)):
        kw = {}
        if p.entry.kind == "alias" and i == len(s.parts) - 1:
            kw["skip_zeros"] = skip_mode == "keyword"
            if s.bits == 8 and s.quant == "keyword":
                kw["state_bits"] = 8
                if s.state_dtype:
                    kw["state_dtype"] = getattr(torch, s.state_dtype)
        txs.append(_make(p, h, **kw))
    if skip_mode == "marker":
        txs.insert(min(s.skip_at, len(txs)), ftopt.skip_zeros())
    if s.named:
        tx = ftopt.named_chain(*[(f"n{i}", t) for i, t in enumerate(txs)])
    elif len(txs) == 1:
        tx = txs[0]
    else:
        tx = ftopt.chain(*txs)
    if skip_mode == "wrap":
        tx = ftopt.skip_zeros(tx)
    state_dtype = getattr(torch, s.state_dtype) if s.state_dtype else None
    if s.bits == 8 and s.quant == "wrapper":
        tx = ftopt.quantize_states(tx, bits=8, min_size=s.min_size, state_dtype=state_dtype)
    elif s.bits == 32 and state_dtype is not None:
        tx = ftopt.quantize_states(tx, bits=32, state_dtype=state_dtype)
    return tx


def plain_state(s: Structure, state: Any, like: Any = None) -> Any:
    """The state of ``build(s, hps, skip=False)`` from that of ``build(s, hps)``: the same
    but for the skip_zeros marker's empty state. ``like``: the plain chain's initial state
    (an alias' ``skip_zeros=True`` may put a marker at the end of each branch's chain, as
    Muon's partition does, not only at the end of its own chain)."""
    if s.skip == "wrap":
        return state[0]
    if s.skip == "keyword":
        return state[:-1] if like is None else _without_markers(state, like)
    if s.skip != "marker":
        return state
    n = len(s.parts) + 1
    k = min(s.skip_at, n - 1)
    if s.named:
        kept = [(key, v) for i, (key, v) in enumerate(state.items()) if i != k]
        return OrderedDict((f"n{i}", v) for i, (_, v) in enumerate(kept))
    rest = tuple(v for i, v in enumerate(state) if i != k)
    return rest[0] if len(rest) == 1 else rest


def _without_markers(state: Any, like: Any) -> Any:
    """``state`` shaped as ``like``: a tuple one longer than ``like``'s, ending in an
    :class:`ftopt.EmptyState` (a skip_zeros marker), loses that end."""
    if isinstance(state, ftopt.EmptyState) or not isinstance(state, (tuple, dict)):
        return state
    if isinstance(state, dict):
        return type(state)((k, _without_markers(v, like[k])) for k, v in state.items())
    items = list(state)
    if (not hasattr(state, "_fields") and len(items) == len(like) + 1
            and isinstance(items[-1], ftopt.EmptyState)):
        items = items[:-1]
    items = [_without_markers(x, y) for x, y in zip(items, like)]
    return type(state)(*items) if hasattr(state, "_fields") else type(state)(items)


# ------------------------------------------------------------------------------------------
# Pytrees and gradients
# ------------------------------------------------------------------------------------------

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SMALL_SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 3), (33,), (16, 17), (257,)]
BLOCK_SHAPES = [(257,), (300,), (2, 260), (513,)]  # 8-bit: more than one 256-block


@dataclass
class Case:
    """One example: a structure with its hyperparameters, params and per-step grads."""

    structure: Structure
    hparams: list
    params: Any
    grads: list
    device: str
    seed: int
    update_too: bool = False
    notes: list = field(default_factory=list)

    def tx(self, skip: bool = True) -> GradientTransformation:
        return build(self.structure, self.hparams, skip)

    def moved_tx(self, rng: random.Random, skip: bool = True) -> GradientTransformation:
        """The transformation with every float hyperparameter (not 0 or 1) moved by a
        random relative amount of up to one fp32 ulp: what an fp32 rounding of a
        hyperparameter, or of a scalar made from it, can do (``Reference.moved32``).
        A move that leaves a hyperparameter's domain keeps that draw's hparams as they
        are."""
        def move(h):
            return {k: ([move(q) for q in v] if k == "__inner__" else
                        v * (1 + 2.0 ** -23 * (2 * rng.random() - 1))
                        if isinstance(v, float) and v not in (0.0, 1.0) else v)
                    for k, v in h.items()}
        try:
            return build(self.structure, [move(h) for h in self.hparams], skip)
        except ValueError:
            return self.tx(skip)

    def host_tx(self, skip: bool = True) -> GradientTransformation:
        """The transformation with its hyperparameter tensors on the CPU (for eager run
        there: ``fuzz_checks.Reference.host_leaf``)."""
        def cpu(h):
            return {k: ([cpu(q) for q in v] if k == "__inner__" else
                        v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in h.items()}
        return build(self.structure, [cpu(h) for h in self.hparams], skip)

    def hparam_tensors(self) -> list[torch.Tensor]:
        out = []

        def walk(h):
            for k, v in h.items():
                if k == "__inner__":
                    for q in v:
                        walk(q)
                elif isinstance(v, torch.Tensor):
                    out.append(v)
        for h in self.hparams:
            walk(h)
        return out

    def describe(self) -> str:
        def hp(h):
            return {k: (round(float(v), 9) if isinstance(v, (float, torch.Tensor)) else
                        ([hp(q) for q in v] if k == "__inner__" else getattr(
                            v, "__qualname__", v)))
                    for k, v in h.items()}
        leaves = [(path, tuple(p.shape), str(p.dtype).replace("torch.", ""))
                  for path, p in zip(*ftopt.tree.flatten_with_paths(self.params)[:2])]
        return (f"structure: {self.structure.describe()}\nhparams: "
                f"{[hp(h) for h in self.hparams]}\nleaves: {leaves}\ndata seed: {self.seed}"
                f", steps: {len(self.grads)}, device: {self.device}")


def _nest(src: Source, leaves: list, depth: int = 0) -> Any:
    """A random container over ``leaves``: a dict at the root, lists/tuples/dicts below."""
    if depth > 0 and (len(leaves) == 1 and src.boolean(0.7) or depth >= 3):
        return leaves[0] if len(leaves) == 1 else list(leaves)
    groups: list[list] = []
    i = 0
    while i < len(leaves):
        n = src.integers(1, max(1, len(leaves) - i)) if src.boolean(0.3) else 1
        groups.append(leaves[i:i + n])
        i += n
    kids = [g[0] if len(g) == 1 else _nest(src, g, depth + 1) for g in groups]
    kind = "dict" if depth == 0 else src.choice(["dict", "list", "tuple"])
    if kind == "dict":
        return {f"w{j}": k for j, k in enumerate(kids)}
    return kids if kind == "list" else tuple(kids)


def _grad(gen: torch.Generator, p: torch.Tensor, pattern: str) -> torch.Tensor:
    g = torch.randn(p.shape, generator=gen) * 10.0 ** float(torch.randint(-3, 2, (), generator=gen))
    flat = g.view(-1)
    n = flat.numel()
    if n and pattern == "scattered":
        flat[torch.rand(n, generator=gen) < 0.3] = 0.0
    elif n and pattern == "negzero":
        pick = torch.rand(n, generator=gen)
        flat[pick < 0.2] = -0.0
        flat[pick > 0.9] = 0.0
    elif n and pattern == "rows" and p.ndim >= 2:
        g[torch.rand(p.shape[0], generator=gen) < 0.5] = -0.0
    elif pattern == "all":
        g = torch.zeros_like(g) if torch.rand((), generator=gen) < 0.5 else -torch.zeros_like(g)
    elif n > 256 and pattern == "block":
        b = int(torch.randint(0, (n + 255) // 256, (), generator=gen))
        flat[b * 256:(b + 1) * 256] = 0.0
        flat[torch.rand(n, generator=gen) < 0.05] = -0.0
    return g.to(p.dtype)


def draw_case(src: Source, s: Structure, device: Any = "cpu", steps: int | None = None,
              max_leaves: int = 5, dtypes: Sequence[str] | None = None) -> Case:
    """Hyperparameters, a pytree and 2-3 steps of gradients for structure ``s``.

    ``dtypes``: the param dtypes (keys of :data:`DTYPES`) the leaves may take, each leaf
    one of them (all one dtype, or mixed); ``None``: any, as fp32 half of the time. The
    GPU runner gives each structure a fixed pair, since each dtype of a tree is a kernel
    of its own to compile."""
    hps = draw_hparams(src, s, device)
    n = src.integers(1, max_leaves)
    shapes = [src.choice(SMALL_SHAPES) for _ in range(n)]
    if s.bits == 8:
        shapes[src.integers(0, n - 1)] = src.choice(BLOCK_SHAPES)
        if s.quant == "keyword":
            shapes[src.integers(0, n - 1)] = (4097,)
    if dtypes is None:  # (the draws of every earlier run, so their replays still hold)
        names: list[str] = sorted(DTYPES)
        mode = src.choice(["fp32", "fp32", "fp32", "fp16", "bf16", "mixed"])
    else:
        names = list(dtypes)
        mode = src.choice([*names, "mixed"]) if len(names) > 1 else names[0]
    leaf_dtypes = [DTYPES[src.choice(names) if mode == "mixed" else mode] for _ in range(n)]
    seed = src.integers(0, 2**31 - 1)
    steps = steps if steps is not None else src.integers(2, 3)
    patterns = [[src.choice(["none", "scattered", "negzero", "rows", "all", "block", "none"])
                 for _ in range(n)] for _ in range(steps)]
    nones = [[src.boolean(0.12) for _ in range(n)] for _ in range(steps)]
    gen = torch.Generator().manual_seed(seed)
    leaves = []
    for shape, dtype in zip(shapes, leaf_dtypes):
        p = torch.randn(shape, generator=gen) * 10.0 ** float(torch.randint(-1, 2, (),
                                                                            generator=gen))
        if p.numel():
            pick = torch.rand(p.shape, generator=gen)
            p[pick < 0.05] = -0.0
            p[pick > 0.97] = 0.0
        leaves.append(p.to(dtype))
    params = _nest(src, leaves)
    spec = ftopt.tree.structure(params)
    grads = []
    for k in range(steps):
        gl = [None if nones[k][i] else _grad(gen, p, patterns[k][i])
              for i, p in enumerate(leaves)]
        grads.append(spec.unflatten([g.to(device) if g is not None else None for g in gl]))
    params = ftopt.tree.map(lambda t: t.to(device), params)
    update_too = src.boolean(0.3)
    if src.boolean(0.15):
        # A frozen param held as None (an empty subtree, as optax reads it) ahead of the
        # others: masks and labels over the params see it. (Drawn last, so that the
        # draws above stay as they were: an earlier run's example replays with the same
        # structure, hyperparameters and tensors, now and then with this leaf too.)
        params = {"frozen": None, **params}
        grads = [{"frozen": None, **g} for g in grads]
    return Case(s, hps, params, grads, str(device), seed, update_too=update_too)
