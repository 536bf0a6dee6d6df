"""Running a traced :class:`~ftopt.chunked.program.Program` over cache-sized chunks of
all leaves (see the comment at the top of :mod:`ftopt.chunked.program`)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from ftopt.chunked.program import NotTraceable, Program

#: Elements per chunk (1 MiB of fp32): the ten or so chunk-sized tensors a program touches
#: stay in the last-level cache, and each op is large enough to split over the intra-op
#: threads (ATen's grain is 32768 elements) and to hide the per-op dispatch cost. On a
#: 2-core CPU (benchmarks/eager_cpu.py) 64Ki and 512Ki elements were both ~20% slower.
#: Each thread that runs a program keeps its chunk buffers (about ten chunks) for reuse.
CHUNK = 1 << 18


def chunkable(tensors: Sequence) -> bool:
    """Whether the chunked evaluator may run over these per-leaf tensors (CPU only: on an
    accelerator a foreach op over whole leaves is already one launch)."""
    return all(t.device.type == "cpu" for t in tensors)


def run_program(
    prog: Program,
    inputs: dict[str, Sequence[torch.Tensor]],
    outputs: dict[str, Sequence[torch.Tensor]],
    *,
    aliases: Sequence[str] = (),
    chunk: int | None = None,
) -> None:
    """Run ``prog`` over all leaves, chunk by chunk.

    ``inputs`` and ``outputs`` hold one tensor per leaf for each name (all of a leaf's
    tensors have the same number of elements); outputs are written in place. An output
    named in ``aliases`` is the same memory as the input of that name (a donated state):
    it is written only once nothing reads the input any more. Non-contiguous inputs are
    read through contiguous copies; outputs must be contiguous.
    """
    chunk = CHUNK if chunk is None else chunk
    missing = [n for n in prog.inputs if n not in inputs]
    if missing:
        raise ValueError(f"program inputs {missing} not given")
    out_names = list(outputs)
    ins = [inputs[n] for n in prog.inputs]
    outs = [outputs[n] for n in out_names]
    for name, ts in zip(out_names, outs):
        if not all(t.is_contiguous() for t in ts):
            raise ValueError(f"output {name}: tensors must be contiguous")
    numels = [t.numel() for t in (ins[0] if ins else outs[0])]
    solo, packed = _waves(numels, chunk)
    largest = max([e - s for _, bounds in solo for s, e in bounds]
                  + [sum(numels[i] for i in leaves) for leaves in packed] + [0])
    if largest == 0:
        return
    prog.drop_identities()
    plan = _Plan(prog, out_names, [ts[0].dtype if len(ts) else None for ts in outs],
                 aliases, largest)
    for i, bounds in solo:
        if len(bounds) == 1:
            # A whole leaf in one chunk: its tensors as they are (no flattened views).
            fi = [x[i] if x[i].is_contiguous() else x[i].contiguous() for x in ins]
            fo = [x[i] for x in outs]
            shape = (fi or fo)[0].shape
            if all(t.shape == shape for t in fi) and all(t.shape == shape for t in fo):
                plan.run_wave(numels[i], fi, fo, shape)
                continue
        fi = [_flat(x[i]) for x in ins]
        fo = [_flat(x[i]) for x in outs]
        if len(bounds) == 1:
            plan.run_wave(numels[i], fi, fo)
            continue
        for s, e in bounds:
            plan.run_wave(e - s, [t[s:e] for t in fi], [t[s:e] for t in fo])
    for leaves in packed:
        plan.run_packed(leaves, [[_flat(x[i]) for i in leaves] for x in ins],
                        [[_flat(x[i]) for i in leaves] for x in outs])


def _flat(t: torch.Tensor) -> torch.Tensor:
    if t.ndim == 1 and t.is_contiguous():
        return t
    return t.contiguous().view(-1)


#: Leaves of at least this many elements are never packed: gathering and scattering them
#: would cost more than the per-op overhead of their own smaller chunk.
_SOLO = 1 << 14


def _waves(numels: Sequence[int], chunk: int):
    """Split leaves into chunks: a large leaf into pieces of at most ``chunk`` elements
    (its tensors are used in place, ``(leaf, [(start, stop), ...])``), small leaves packed
    together into waves of at most ``chunk`` elements (gathered into, and scattered from,
    buffers; a list of leaves)."""
    solo, packed, cur, cur_n = [], [], [], 0
    for i, n in enumerate(numels):
        if n == 0:
            continue
        if n >= min(chunk // 2, _SOLO):
            pieces = -(-n // chunk)
            size = -(-n // pieces)
            size = -(-size // 64) * 64  # a multiple of the vector width
            solo.append((i, [(s, min(n, s + size)) for s in range(0, n, size)]))
            continue
        if cur_n + n > chunk:
            packed.append(cur)
            cur, cur_n = [], 0
        cur.append(i)
        cur_n += n
    if cur:
        packed.append(cur)
    return solo, packed


def check_aliases(prog: Program, aliases) -> None:
    """Raise :class:`NotTraceable` if an output is a donated input of another name (it
    would be copied from memory that the other output overwrites)."""
    aliased_inputs = {prog.inputs[n] for n in aliases if n in prog.inputs}
    for name, v in prog.outputs:
        if v in aliased_inputs and prog.inputs.get(name) != v:
            raise NotTraceable("an output reads a donated input of another name")


_SCRATCH = threading.local()


def _scratch(key, dtype: torch.dtype, size: int) -> torch.Tensor:
    """A chunk buffer kept for the next step (per thread): allocating it afresh each
    step would map and fault in new pages every time."""
    cache = getattr(_SCRATCH, "buffers", None)
    if cache is None:
        cache = _SCRATCH.buffers = {}
    buf = cache.get((key, dtype))
    if buf is None or buf.numel() < size:
        buf = cache[key, dtype] = torch.empty(size, dtype=dtype, device="cpu")
    return buf if buf.numel() == size else buf[:size]


class _Plan:
    """Where every value of a program lives while a chunk runs."""

    def __init__(self, prog: Program, out_names: list[str], out_dtypes: list,
                 aliases: Sequence[str], chunk: int):
        self.chunk = chunk
        n_vals = len(prog.dtypes)
        end = len(prog.code)
        last = [-1] * n_vals
        for k, (_, args, _) in enumerate(prog.code):
            for a in args:
                last[a] = k
        for _, v in prog.outputs:
            last[v] = end
        out_pos = {name: j for j, name in enumerate(out_names)}
        missing = [name for name, _ in prog.outputs if name not in out_pos]
        if missing:
            raise ValueError(f"program outputs {missing} not given")
        aliases = set(aliases)
        check_aliases(prog, aliases)
        produced = {res: k for k, (_, _, res) in enumerate(prog.code)}
        # Results written straight into an output's memory.
        direct: dict[int, str] = {}
        for name, v in prog.outputs:
            if v not in produced or v in direct or out_dtypes[out_pos[name]] != prog.dtypes[v]:
                continue
            if name in aliases and name in prog.inputs and last[prog.inputs[name]] > produced[v]:
                continue  # the donated input is still read after this op
            direct[v] = name
        # Chunk buffers for the other results: a result reuses the buffer of an operand
        # that dies at its op (the op then runs in place).
        buf_dtypes: list[torch.dtype] = []
        free: dict[torch.dtype, list[int]] = {}
        buf_of: dict[int, int] = {}
        for k, (_, args, res) in enumerate(prog.code):
            for a in set(args):
                if a in buf_of and last[a] == k:
                    free.setdefault(prog.dtypes[a], []).append(buf_of[a])
            if res not in direct:
                pool = free.setdefault(prog.dtypes[res], [])
                buf_of[res] = pool.pop() if pool else len(buf_dtypes)
                if buf_of[res] == len(buf_dtypes):
                    buf_dtypes.append(prog.dtypes[res])
                if last[res] < k:  # never read
                    pool.append(buf_of[res])
        self.bufs = [_scratch(("tmp", k), d, chunk) for k, d in enumerate(buf_dtypes)]
        # End-of-chunk copies: outputs not written directly (an input value or a result
        # that also feeds another output), except a donated input left as it is.
        self.copies: list[tuple[int, int]] = []
        kept = set()
        for name, v in prog.outputs:
            if direct.get(v) == name:
                continue
            if name in aliases and prog.inputs.get(name) == v:
                kept.add(out_pos[name])
                continue
            self.copies.append((out_pos[name], v))
        self.loc: list = [None] * n_vals
        for index, value in prog.consts.items():
            self.loc[index] = value
        self.in_slots = list(prog.inputs.values())
        self.in_dtypes = [prog.dtypes[v] for v in self.in_slots]
        self.buf_slots = list(buf_of.items())
        self.direct_slots = [(v, out_pos[name]) for v, name in direct.items()]
        self.code = list(prog.code)
        # Packed chunks scatter every output but the donated inputs left as they are.
        self.scattered = [(j, d) for j, d in enumerate(out_dtypes) if j not in kept]
        self._gather: list = [None] * len(self.in_slots)
        self._scatter: dict[int, torch.Tensor] = {}

    def run_wave(self, n: int, ins: list, outs: list, shape=None) -> None:
        """One chunk: ``ins``/``outs`` are the chunk's tensors, per name, all of ``n``
        elements (flat, or all of ``shape``)."""
        loc = self.loc
        for v, t in zip(self.in_slots, ins):
            loc[v] = t
        if shape is not None and len(shape) != 1:
            bufs = [b[:n].view(shape) for b in self.bufs]
        else:
            bufs = self.bufs if n == self.chunk else [b[:n] for b in self.bufs]
        for v, j in self.buf_slots:
            loc[v] = bufs[j]
        for v, j in self.direct_slots:
            loc[v] = outs[j]
        for fn, args, res in self.code:
            fn(*[loc[a] for a in args], out=loc[res])
        for j, v in self.copies:
            outs[j].copy_(loc[v])

    def run_packed(self, leaves: list[int], ins: list[list], outs: list[list]) -> None:
        """One chunk of several small leaves: inputs are gathered into chunk buffers and
        outputs scattered from them (``ins``/``outs``: per name, the leaves' flat views)."""
        sizes = [t.numel() for t in (ins[0] if ins else outs[0])]
        n = sum(sizes)
        gathered = []
        for j, pieces in enumerate(ins):
            if self._gather[j] is None:
                self._gather[j] = _scratch(("in", j), self.in_dtypes[j], self.chunk)
            gathered.append(torch.cat(pieces, out=self._gather[j][:n]))
        scatter = [None] * len(outs)
        for j, dtype in self.scattered:
            if j not in self._scatter:
                self._scatter[j] = _scratch(("out", j), dtype, self.chunk)
            scatter[j] = self._scatter[j][:n]
        self.run_wave(n, gathered, scatter)
        for j, _ in self.scattered:
            torch._foreach_copy_(outs[j], list(scatter[j].split(sizes)))
