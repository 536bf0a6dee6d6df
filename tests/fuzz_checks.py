"""The properties the fuzzed contract checks on one :class:`fuzz_cases.Case`.

Each check raises ``AssertionError`` (a :class:`PurityError` when an input was modified)
with a message that names the step, the leaf and the values; ``tests/test_fuzz.py``,
``tests/test_fuzz_pinned.py`` and ``benchmarks/fuzz.py`` call them. Every non-donated call
they make is also checked for purity (SPEC §1): its inputs, hyperparameter tensors
included, keep their bits.

* :func:`fused_vs_eager`: ``step`` (and for some cases ``tx.update``) on both backends
  from the same inputs at every step, within SPEC §6's tolerance (fp32: relative 1e-6 per
  leaf; fp16/bf16 params: one ulp of the param dtype plus fp32 rounding; 8-bit codes at
  most one code apart, counted in :data:`STATS` when they differ at all).
* :func:`skip_zeros_exact`: SPEC §3 and §5 bit for bit on one backend.
* :func:`donate`: ``donate=True`` returns the given tensor objects, with the bits of
  ``donate=False``.
* :func:`checkpoint`: a state through ``torch.save``/``torch.load(weights_only=True)``
  continues bit-identically.
"""

from __future__ import annotations

import collections
import functools
import io
import random
import warnings
from typing import Any

import optree
import torch
from fuzz_cases import Case, plain_state
from registry import SIGNED_STATES, leaf_state

import ftopt
from ftopt.quant import dequantize_blockwise, dynamic_map, encode_with_absmax, expand_absmax
from ftopt.rules import QuantizedSlot

STATS: collections.Counter = collections.Counter()
SIGNED = SIGNED_STATES  # (the 8-bit map of each state: tests/registry.py)
BLOCK = 256
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class PurityError(AssertionError):
    """A call modified one of its inputs."""


def bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view with the same bits (so -0.0 != +0.0 and NaN == NaN)."""
    if t.is_floating_point():
        return t.detach().contiguous().view(_INT[t.element_size()])
    return t.detach()


def _bit_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    """How two same-shaped tensors differ, for a failure message: how many elements, by
    how many units in the last place at most (integer views), and the first such pair."""
    a, b = a.detach().cpu().reshape(-1), b.detach().cpu().reshape(-1)
    apart = (bits(a).long() - bits(b).long()).abs()
    where = (apart > 0).nonzero().flatten()
    if not where.numel():
        return "(no element differs)"
    k = int(where[0])
    return (f"({where.numel()} of {a.numel()} elements, up to {int(apart.max())} ulps; "
            f"element {k}: {a[k].item()!r} vs {b[k].item()!r})")


def _leaves(tree: Any) -> list:
    return optree.tree_leaves(tree, none_is_leaf=False, namespace="ftopt")


def _bytes_by_device(tensors: list) -> dict:
    """The bytes of ``tensors``, concatenated per device (one ``cat`` each): comparing
    two of these compares every tensor's bits with one kernel and one host read, where
    a ``torch.equal`` per tensor costs a kernel and a device sync each (the GPU runner's
    examples hold hundreds)."""
    parts: dict = {}
    for t in tensors:
        if t.numel():
            parts.setdefault(t.device, []).append(
                t.detach().contiguous().reshape(-1).view(torch.uint8))
    return {d: torch.cat(ps) for d, ps in parts.items()}


def _same_bytes(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[d].shape == b[d].shape and torch.equal(a[d], b[d]) for d in a)


def assert_bitwise(a: Any, b: Any, what: str) -> None:
    la, lb = _leaves(a), _leaves(b)
    assert optree.tree_structure(a, namespace="ftopt") == optree.tree_structure(
        b, namespace="ftopt"), f"{what}: tree structures differ"
    for i, (x, y) in enumerate(zip(la, lb)):
        assert x.dtype == y.dtype and x.shape == y.shape, \
            f"{what}: leaf {i} is {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
    if _same_bytes(_bytes_by_device(la), _bytes_by_device(lb)):
        return
    for i, (x, y) in enumerate(zip(la, lb)):  # (which leaf: for the message)
        assert x.device == y.device, f"{what}: leaf {i} is on {x.device} vs {y.device}"
        assert torch.equal(bits(x), bits(y)), \
            f"{what}: leaf {i} differs in its bits {_bit_diff(x, y)}"
    raise AssertionError(f"{what}: the leaves differ in their bits")


class Snapshot:
    """The bytes of every tensor of some trees, to check later that none was modified."""

    def __init__(self, *trees: Any):
        self.tensors = [t for t in _leaves(trees) if isinstance(t, torch.Tensor)]
        self.shapes = [(t.dtype, t.shape, t.device) for t in self.tensors]
        self.saved = _bytes_by_device(self.tensors)

    def check(self, what: str) -> None:
        if self.shapes == [(t.dtype, t.shape, t.device) for t in self.tensors] and \
                _same_bytes(self.saved, _bytes_by_device(self.tensors)):
            return
        for i, (t, meta) in enumerate(zip(self.tensors, self.shapes)):
            if (t.dtype, t.shape, t.device) != meta:
                raise PurityError(f"{what} modified input tensor {i} ({meta[0]}"
                                  f"{tuple(meta[1])} became {t.dtype}{tuple(t.shape)})")
        offsets: dict = {}
        for i, t in enumerate(self.tensors):  # (which tensor: for the message)
            if not t.numel():
                continue
            start = offsets.get(t.device, 0)
            end = start + t.numel() * t.element_size()
            offsets[t.device] = end
            now = t.detach().contiguous().reshape(-1).view(torch.uint8)
            if not torch.equal(now, self.saved[t.device][start:end]):
                raise PurityError(f"{what} modified input tensor {i} "
                                  f"({t.dtype}{tuple(t.shape)})")
        raise PurityError(f"{what} modified an input tensor")


def pure_step(case: Case, tx, p, g, s, backend: str):
    snap = Snapshot(p, g, s, case.hparam_tensors())
    out = ftopt.step(tx, p, g, s, backend=backend)
    snap.check(f"step(backend={backend!r}, donate=False)")
    return out


def pure_update(case: Case, tx, p, g, s, backend: str):
    snap = Snapshot(p, g, s, case.hparam_tensors())
    out = tx.update(g, s, p, backend=backend)
    snap.check(f"update(backend={backend!r})")
    return out


# ------------------------------------------------------------------------------------------
# fused == eager
# ------------------------------------------------------------------------------------------


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu()


def _tree_host(tree: Any) -> Any:
    return optree.tree_map(lambda t: _host(t) if isinstance(t, torch.Tensor) else t, tree,
                           none_is_leaf=False, namespace="ftopt")


def _rel(a: torch.Tensor, b: torch.Tensor, old: torch.Tensor | None = None) -> float:
    """max |a - b| over the largest magnitude of a, b (and ``old``, if given). NaN at the
    same elements of both agrees (Prodigy's estimate after an all-zero first step is
    0/0, as optax's), NaN on one side only does not. Computed on the host: a copy of
    each tensor costs the GPU runner less than a dozen kernels and three syncs."""
    a, b = _host(a).double(), _host(b).double()
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return float("inf")
    a, b = a[~nan], b[~nan]
    if a.numel() == 0:
        return 0.0
    scale = torch.maximum(a.abs().max(), b.abs().max())
    if old is not None:
        old = _host(old).double()
        old = old[~old.isnan()]
        if old.numel():
            scale = torch.maximum(scale, old.abs().max())
    scale = scale.clamp_min(1e-30)
    return (torch.where(a == b, 0.0, (a - b).abs()).max() / scale).item()


def _widen(x: Any, jitter: torch.Generator | None) -> Any:
    """``x`` with its floating tensors in float64 (16-bit ones too: fp32 math is what a
    16-bit param or state gets, and float64 holds it exactly); with ``jitter`` each element
    also moved by a random relative amount of up to one fp32 ulp (8-bit slots
    stay as they are: their absmax is fp32 by format)."""
    is_q = lambda t: isinstance(t, QuantizedSlot)  # noqa: E731

    def up(t):
        if is_q(t) or not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return t
        w = t.double()
        if jitter is not None and w.numel():
            r = torch.rand(w.shape, generator=jitter, dtype=torch.float64) * 2 - 1
            w = w * (1 + torch.finfo(torch.float32).eps * r.to(w.device))
        return w
    return optree.tree_map(up, x, is_leaf=is_q, none_is_leaf=False, namespace="ftopt")


def _jitter32(x: Any, jitter: torch.Generator, widen: bool) -> Any:
    """``x`` with its fp32 tensors (every floating one, widened to fp32, if ``widen``)
    each moved by a random relative amount of up to one fp32 ulp; 16-bit tensors not
    widened. An 8-bit slot keeps its codes, and its absmax moves as an fp32 tensor does:
    a chain of 8-bit states whose only other stage is one that rounds its input away
    (Rprop's signs) then still sees a rounding move before the stages that amplify it
    (CPU fuzz seed 219: Muon's momentum into Newton-Schulz, NorMuon's row moments 7e-6
    apart, relative, between fused and eager while eager's draws did not move)."""
    is_q = lambda t: isinstance(t, QuantizedSlot)  # noqa: E731

    def move(t):
        if is_q(t):
            return QuantizedSlot(t.codes, move(t.absmax))
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return t
        if t.dtype != torch.float32 and not widen:
            return t
        w = t.double()
        r = torch.rand(w.shape, generator=jitter, dtype=torch.float64) * 2 - 1
        return (w * (1 + torch.finfo(torch.float32).eps * r.to(w.device))).float()
    return optree.tree_map(move, x, is_leaf=is_q, none_is_leaf=False, namespace="ftopt")


class Reference:
    """The same step in float64 (eager), made only when fp32 results disagree by more
    than 1e-6: a random chain can be ill-conditioned (cancellation in a moment, a division
    by a small second moment, Yogi's v − g² at b2 = 0), and then a rounding difference of
    one ulp grows. Fused is then held to being about as accurate as eager: its error
    against float64 at most twice eager's, plus four times the chain's own *spread* (how
    far the float64 result moves when every input moves by up to one fp32 ulp, the largest
    of two random draws, eight on a retry: what one rounding early in the chain can do to
    the result), plus 1e-6 of the leaf's scale."""

    DRAWS = 2
    MORE = 8  # (:meth:`more_draws`)
    DRAWS32 = 8
    MORE32 = 32  # (the same)

    def __init__(self, tx, p, g, s, moved_tx=None, host_eager: bool = False, host_tx=None):
        """``moved_tx``: random.Random -> the transformation with its hyperparameters
        moved by one fp32 ulp (:meth:`fuzz_cases.Case.moved_tx`), for :meth:`moved32`.
        ``host_eager``: the inputs are on a GPU, so :meth:`host_leaf` may run eager on the
        CPU, with ``tx`` or, where it holds device tensors, ``host_tx()`` (the same
        transformation with them on the CPU: :meth:`fuzz_cases.Case.host_tx`)."""
        self.args = (tx, p, g, s)
        self.moved_tx = moved_tx
        self.host_eager = host_eager
        self.host_tx = host_tx
        self._host: dict[str, Any] = {}
        self.result = None
        self.updates = None
        self._moved: dict[str, list] = {}
        self._state = None
        self.draws = self.DRAWS
        self.draws32 = self.DRAWS32

    def _run(self, kind: str, jitter: torch.Generator | None):
        tx, p, g, s = self.args
        wide = [_widen(x, jitter) for x in (p, g, s)]
        if kind == "update":
            return tx.update(wide[1], wide[2], wide[0], backend="eager")[0]
        return ftopt.step(tx, *wide, backend="eager")

    def moved32(self, kind: str) -> list:
        """The eager fp32 result (``"step"`` or ``"update"``) from inputs and
        hyperparameters moved by up to one fp32 ulp (gradients widened to fp32 first),
        ``DRAWS32`` draws: how far fp32 rounding alone moves this chain, intermediate
        roundings included. The float64 spread, from moved tensors only, cannot see those:
        a cancellation late in a chain amplifies a rounding made early in it, or one of a
        hyperparameter (the H200's fuzz, seed 17: a yogi -> adan -> rms -> adan chain
        whose 8-bit absmax moves by 1e-5 when its hyperparameters move by one ulp).
        Eight draws: the largest move is a heavy-tailed quantity, and three underrated it
        (CPU fuzz, seed 82 example 410: Muon -> AdEMAMix, whose draws range 0.29e-6 to
        3.79e-6; fused, an ulp off eager's Muon momentum, was 6.82e-6 from eager, refused
        at three draws and admitted at eight). Made only where fp32 results disagree."""
        runs = self._moved.setdefault("fp32 " + kind, [])
        tx, p, g, s = self.args
        for k in range(len(runs), self.draws32):
            if self.moved_tx is not None:
                tx = self.moved_tx(random.Random(1000 + k))
            jitter = torch.Generator().manual_seed(1000 + k)
            wide = [_jitter32(x, jitter, i == 1) for i, x in enumerate((p, g, s))]
            runs.append(tx.update(wide[1], wide[2], wide[0], backend="eager")
                        if kind == "update" else ftopt.step(tx, *wide, backend="eager"))
        return runs

    def more_draws(self) -> bool:
        """Take :attr:`MORE32` draws of eager and :attr:`MORE` of float64 from now on,
        where fewer were taken and some were (a comparison they did not settle): whether
        it did. An ill-conditioned chain's result can be two-valued at the ulp level, and
        eight draws may all land on eager's side (CPU fuzz seed 226 example 840: SM3's
        accumulator after a bias-corrected stddev whose variance cancels, 25 of 64 draws
        near fused's value, 39 near eager's; the first eight all near eager's). And where
        eager's draws cannot move what the chain amplifies, the float64 spread is the
        rule's only measure, the largest of a heavy-tailed quantity's draws (CPU fuzz
        seed 330 example 640: bf16 params, which eager's draws do not move, into Muon's
        momentum, its lerp an ulp apart between fused and eager, into Newton-Schulz and
        NorMuon's row moments 1e-5 apart, relative; the spread of two float64 draws put
        fused 1.5 times past the bound, eight put it within). A real difference stays
        outside them too."""
        fp32 = any(k.startswith("fp32 ") for k in self._moved)
        fp64 = any(not k.startswith("fp32 ") for k in self._moved)
        more = (self.draws32 < self.MORE32 and fp32) or (self.draws < self.MORE and fp64)
        if more:
            self.draws32, self.draws = self.MORE32, self.MORE
            self._state = None  # (its spreads again, from the draws to come)
        return more

    def host_leaf(self, kind: str, spec, j: int) -> torch.Tensor | None:
        """Leaf ``j`` of the eager params (``"step"``) or update (``"update"``) computed
        on the CPU from the same fp32 inputs, on the inputs' device (None where
        ``host_eager`` is off). Torch's CUDA kernels may contract a multiply-add that
        its CPU kernels round twice, as the fused kernels do: in a chain that amplifies
        its roundings that alone can put CUDA's eager far nearer float64 than the CPU's
        (the H200's fuzz, seed 22: a Yogi -> AMSGrad chain, CUDA eager 6e-7 from float64
        in every moved draw, the CPU's eager and fused 4.5e-6)."""
        if not self.host_eager:
            return None
        leaf = spec.flatten_up_to(self._host_run(kind)[0])[j]
        return None if leaf is None else leaf.to(spec.flatten_up_to(self.args[1])[j].device)

    def host_states(self, kind: str) -> list | None:
        """The state leaves (8-bit slots whole) of eager run on the CPU, as
        :meth:`host_leaf` runs it (None where ``host_eager`` is off): CUDA's eager may
        round a state otherwise too (the H200's fuzz, seed 26: Yogi one ulp apart, an
        optimistic gradient's cancellation then 1.8e-6)."""
        return _state_leaves(self._host_run(kind)[1]) if self.host_eager else None

    def _host_run(self, kind: str):
        if kind not in self._host:
            tx, p, g, s = self.args
            if self.host_tx is not None:
                tx = self.host_tx()
            host = [optree.tree_map(lambda t: t.cpu(), x, none_is_leaf=False,
                                    namespace="ftopt") for x in (p, g, s)]
            self._host[kind] = (tx.update(host[1], host[2], host[0], backend="eager")
                                if kind == "update" else ftopt.step(tx, *host, backend="eager"))
        return self._host[kind]

    def moved_leaf(self, kind: str, spec, j: int) -> list:
        """Leaf ``j`` of the params (``"step"``) or updates (``"update"``) of each draw."""
        return [spec.flatten_up_to(m[0])[j] for m in self.moved32(kind)]

    def moved_states(self, kind: str) -> list:
        """The state leaves (8-bit slots whole) of each draw."""
        return [_state_leaves(m[1]) for m in self.moved32(kind)]

    def _draws(self, kind: str) -> list:
        runs = self._moved.setdefault(kind, [])
        for k in range(len(runs), self.draws):
            runs.append(self._run(kind, torch.Generator().manual_seed(k)))
        return runs

    def update(self, spec, j: int) -> tuple[torch.Tensor, float]:
        """``tx.update``'s update of leaf ``j`` in float64 (every float input widened:
        an update is fp32 whatever the param dtype), and its spread."""
        if self.updates is None:
            self.updates = self._run("update", None)
        r = spec.flatten_up_to(self.updates)[j]
        return r, max(_rel(spec.flatten_up_to(m)[j], r) for m in self._draws("update"))

    def param(self, spec, j: int) -> tuple[torch.Tensor, float]:
        r = spec.flatten_up_to(self.get()[0])[j]
        return r, max(_rel(spec.flatten_up_to(m[0])[j], r) for m in self._draws("step"))

    def state(self) -> tuple[list, list[float]]:
        """The float64 state's leaves (8-bit slots whole) and each one's spread (of an
        8-bit slot: of its absmax)."""
        is_q = lambda x: isinstance(x, QuantizedSlot)  # noqa: E731
        leaves = lambda st: optree.tree_leaves(st, is_leaf=is_q,  # noqa: E731
                                               namespace="ftopt")
        if self._state is not None:
            return self._state
        ref = leaves(self.get()[1])
        spread = [0.0] * len(ref)
        for m in self._draws("step"):
            for i, (a, b) in enumerate(zip(leaves(m[1]), ref)):
                if is_q(b):
                    a, b = a.absmax, b.absmax
                if isinstance(b, torch.Tensor) and b.is_floating_point():
                    spread[i] = max(spread[i], _rel(a, b))
        self._state = (ref, spread)
        return self._state

    def get(self):
        if self.result is None:
            self.result = self._run("step", None)
        return self.result


def _all_finite(*trees: Any) -> bool:
    """Whether every float tensor of ``trees`` is finite (an 8-bit slot's absmax is)."""
    return all(bool(torch.isfinite(x).all()) for tree in trees for x in _state_leaves(tree)
               if isinstance(x, torch.Tensor) and x.is_floating_point())


def _state_leaves(state: Any) -> list:
    return optree.tree_leaves(state, is_leaf=lambda x: isinstance(x, QuantizedSlot),
                              namespace="ftopt")


def _as_accurate(f: torch.Tensor, e: torch.Tensor, r: torch.Tensor,
                 spread: float = 0.0) -> bool:
    return _rel(f, r) <= 2 * _rel(e, r) + 4 * spread + 1e-6


def _as_accurate_as_host(f: torch.Tensor, ref, host, old=None) -> bool:
    """Fused at least about as accurate against float64 as eager on the CPU
    (:meth:`Reference.host_leaf`; ``host``: () -> that leaf or None)."""
    if ref is None or host is None:
        return False
    h = host()
    if h is None:
        return False
    r, spread = ref()
    return _rel(f, r, old) <= 2 * _rel(h, r, old) + 4 * spread + 1e-6


def _ill_conditioned(f: torch.Tensor, e: torch.Tensor, ref=None, moved=None, host=None,
                     old=None) -> bool:
    """Fused and eager apart in a chain that amplifies its roundings, with fused about as
    accurate as eager: against float64 (``ref``: () -> (float64 leaf, spread)), within
    what eager moves by itself (``moved``), or against eager on the CPU (``host``)."""
    return ((ref is not None and _as_accurate(f, e, *ref()))
            or _within_fp32_spread(f, e, moved, old)
            or _as_near_float64_as_moved(f, ref, moved, old)
            or _as_accurate_as_host(f, ref, host, old))


def _as_near_float64_as_moved(f: torch.Tensor, ref, moved, old=None) -> bool:
    """Fused at most twice as far from float64 as eager's draws are (``ref``: () ->
    (float64 leaf, spread); ``moved``: () -> the same leaf of each draw): where fp32's own
    roundings cancel to a small result, eager's draws scatter around float64 and fused
    may land on the other side of it, farther from eager than the draws reach (CPU fuzz
    seed 197: a snapshot's sum of nine updates near 0.4 cancelling to -7.09e-4, float64
    -7.09330e-4, eager's draws up to 2.0e-7 from it, eager 0.8e-7 below, fused 2.7e-7
    above)."""
    if ref is None or moved is None:
        return False
    r = ref()[0]
    return _rel(f, r, old) <= 2 * max(_rel(m, r, old) for m in moved()) + 1e-6


def _within_fp32_spread(f: torch.Tensor, e: torch.Tensor, moved, old=None) -> bool:
    """Fused differs from eager by at most twice what eager moves by itself when its
    inputs move by one fp32 ulp (``moved``: () -> the same leaf of each draw)."""
    if moved is None:
        return False
    return _rel(f, e, old) <= 2 * max(_rel(m, e, old) for m in moved()) + 1e-6


def _close_param(f: torch.Tensor, e: torch.Tensor, old: torch.Tensor, what: str,
                 ref=None, moved=None, host=None) -> None:
    assert f.dtype == e.dtype and f.shape == e.shape, f"{what}: dtype/shape differ"
    if f.dtype == torch.float32:
        # Relative to the param before the step too: p + u may cancel to ~0, where fp32
        # rounding of u (an ulp of |p|) is all that is left.
        err = _rel(f, e, old)
        if err > 1e-6 and _ill_conditioned(f, e, ref, moved, host, old):
            return
        assert err <= 1e-6, f"{what}: relative error {err:.3g} > 1e-6"
        return
    # 16-bit: each backend rounds an fp32 value once; those values may differ by fp32
    # rounding relative to the inputs, so one ulp of the result plus that.
    fi = torch.finfo(f.dtype)
    ef, ee, eo = _host(f).float(), _host(e).float(), _host(old).float()
    tol = fi.eps * torch.maximum(ee.abs(), torch.tensor(fi.smallest_normal)) \
        + 4 * torch.finfo(torch.float32).eps * eo.abs()
    bad = (ef - ee).abs() > tol
    if bad.any() and (_ill_conditioned(f, e, ref, moved, host, old)
                      or _ill_conditioned(*_only(bad, f, e, ref, moved, host, old))):
        return  # (an ill-conditioned chain: as for fp32 params above)
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements beyond one ulp, e.g. fused "
                           f"{ef[bad][:3].tolist()} eager {ee[bad][:3].tolist()}")


def _only(mask: torch.Tensor, f, e, ref, moved, host, old) -> tuple:
    """:func:`_ill_conditioned`'s arguments at the elements of ``mask`` alone: fused,
    eager, then the references, draws and old values there. Its tests weigh a whole
    leaf's largest difference, which one element of a large magnitude a 16-bit ulp apart
    can hold while the elements beyond an ulp are tiny ones that eager's own draws scatter
    over (CPU fuzz seed 207: NorMuon, a bf16 element stepped from -0.0 to -4.6e-8, fused
    at float64's, eager two ulps off and its draws up to two either side; seed 210: Muon
    then Adan, fp16 states, subnormal elements of a leaf whose largest is 0.14).
    ``old``: ``None`` for states."""
    at = lambda x: _host(x)[mask]  # noqa: E731
    return (at(f), at(e),
            None if ref is None else lambda: (lambda r, spread: (at(r), spread))(*ref()),
            None if moved is None else lambda: [at(m) for m in moved()],
            None if host is None else lambda: (lambda h: None if h is None else at(h))(host()),
            None if old is None else at(old))


def _nth(leaves: list | None, i: int):
    return None if leaves is None else leaves[i]


def _close_states(f: Any, e: Any, what: str, ref=None, moved=None, host=None) -> None:
    """``moved``: () -> the state leaves (8-bit slots whole) of each draw of
    :meth:`Reference.moved32`; ``host``: () -> those of eager on the CPU, or None
    (:meth:`Reference.host_states`)."""
    is_q = lambda x: isinstance(x, QuantizedSlot)
    lf, sf = optree.tree_flatten(f, is_leaf=is_q, namespace="ftopt")
    le, se = optree.tree_flatten(e, is_leaf=is_q, namespace="ftopt")
    lr = ref  # (() -> (float64 leaves, their spreads), made on the first need)
    assert sf == se, f"{what}: state structures differ: {sf} vs {se}"
    for i, (x, y) in enumerate(zip(lf, le)):
        if isinstance(x, QuantizedSlot):
            err = _rel(x.absmax, y.absmax)
            if not (err <= 1e-6 or (lr is not None and _as_accurate(
                    x.absmax, y.absmax, lr()[0][i].absmax, lr()[1][i]))
                    or _within_fp32_spread(x.absmax, y.absmax, moved and (
                        lambda i=i: [m[i].absmax for m in moved()]))):
                raise AssertionError(f"{what}: 8-bit absmax of leaf {i}: relative error "
                                     f"{err:.3g}")
            diff = (_host(x.codes).int() - _host(y.codes).int()).abs()
            n = int((diff > 0).sum())
            if n:
                STATS["code_diff_elements"] += n
                warnings.warn(f"{what}: {n} 8-bit codes differ between fused and eager "
                              f"(max {int(diff.max())})", stacklevel=2)
            allowed = 1
            if n and int(diff.max()) > 1 and moved is not None and y.codes.numel():
                # An ill-conditioned leaf: eager's own codes move by up to k when its
                # inputs and hyperparameters move by one fp32 ulp (a few draws, so by
                # leaf, not by element); fused may then differ by up to 1 + k.
                allowed += max(int((_host(m[i].codes).int() - _host(y.codes).int()).abs()
                                   .max()) for m in moved())
            if n and int(diff.max()) > allowed and lr is not None and y.codes.numel():
                # Or fused's codes are about as far from float64's as eager's are: a
                # discontinuity at a near-tie (Yogi's sign(v - g²), H200 fuzz seed 17
                # example 2160: eager's absmax 63% from float64's, codes 127 apart).
                cr = _host(lr()[0][i].codes).int()
                far = [int((_host(c.codes).int() - cr).abs().max()) for c in (x, y)]
                if far[1] > 1 and far[0] <= 2 * far[1] + allowed:  # (eager off by more
                    allowed = int(diff.max())  # than its own rounding: ill-conditioned)
            assert n == 0 or int(diff.max()) <= allowed, (
                f"{what}: 8-bit codes of leaf {i} differ by {int(diff.max())} > {allowed}")
            continue
        assert x.dtype == y.dtype and x.shape == y.shape, f"{what}: state leaf {i} layout"
        x, y = _host(x), _host(y)
        # (this leaf of the float64 reference, of eager's draws, of eager on the CPU)
        refs = (lr and (lambda i=i: (lr()[0][i], lr()[1][i])),
                moved and (lambda i=i: [_host(m[i]) for m in moved()]),
                host and (lambda i=i: _nth(host(), i)))
        if not x.is_floating_point():
            assert torch.equal(x, y), f"{what}: state leaf {i}: {x} vs {y}"
        elif x.dtype in (torch.float16, torch.bfloat16):
            # 16-bit storage (state_dtype): each backend rounds an fp32 value once; those
            # may differ in their last bits, so one ulp of the result plus that error.
            fi = torch.finfo(x.dtype)
            ef, ee = x.float(), y.float()
            scale = ee.abs().max() if ee.numel() else 0.0
            tol = fi.eps * torch.maximum(ee.abs(), torch.tensor(fi.smallest_normal)) \
                + 1e-6 * scale
            bad = (ef - ee).abs() > tol
            if bad.any() and (_ill_conditioned(x, y, *refs)
                              or _ill_conditioned(*_only(bad, x, y, *refs, None))):
                continue  # (an ill-conditioned chain, as for 16-bit params)
            assert not bad.any(), (f"{what}: 16-bit state leaf {i}: {int(bad.sum())} "
                                   "elements beyond one ulp")
        else:
            err = _rel(x, y)
            if err > 1e-6 and _ill_conditioned(x, y, *refs):
                continue
            assert err <= 1e-6, f"{what}: state leaf {i}: relative error {err:.3g} > 1e-6"


def fused_vs_eager(case: Case) -> None:
    """Every step from the same inputs on both backends (so errors cannot accumulate)."""
    tx = case.tx()
    p = case.params
    s = tx.init(p)
    for k, g in enumerate(case.grads):
        pe, se = pure_step(case, tx, p, g, s, "eager")
        pf, sf = pure_step(case, tx, p, g, s, "fused")
        ref = Reference(tx, p, g, s, case.moved_tx,
                        host_eager=torch.device(case.device).type != "cpu",
                        host_tx=case.host_tx if case.structure.tensors else None)
        updates = None
        if case.update_too:
            ue = pure_update(case, tx, p, g, s, "eager")
            updates = (pure_update(case, tx, p, g, s, "fused"), ue)
        counted = STATS["code_diff_elements"]
        try:
            _compare_step(k, p, (pf, sf), (pe, se), updates, ref)
        except AssertionError:
            if not ref.more_draws():
                raise
            STATS["code_diff_elements"] = counted  # (counted again)
            _compare_step(k, p, (pf, sf), (pe, se), updates, ref)
        p, s = pe, se


def _compare_step(k: int, p, fused, eager, updates, ref: Reference) -> None:
    """Step ``k``'s params and states (and its update and the update's state, where
    ``updates``: ((fused), (eager))) of fused against eager."""
    (pf, sf), (pe, se) = fused, eager
    paths, flat_old, spec = ftopt.tree.flatten_with_paths(p)
    for j, (path, old, a, b) in enumerate(zip(paths, flat_old, spec.flatten_up_to(pf),
                                              spec.flatten_up_to(pe))):
        _close_param(a, b, old, f"step {k}, param {path}",
                     functools.partial(ref.param, spec, j),
                     functools.partial(ref.moved_leaf, "step", spec, j),
                     functools.partial(ref.host_leaf, "step", spec, j))
    _close_states(sf, se, f"step {k}, state", ref.state,
                  functools.partial(ref.moved_states, "step"),
                  functools.partial(ref.host_states, "step"))
    if updates is not None:
        (uf, suf), (ue, sue) = updates
        lu_f, lu_e = spec.flatten_up_to(uf), spec.flatten_up_to(ue)
        for j, (path, a, b) in enumerate(zip(paths, lu_f, lu_e)):
            assert (a is None) == (b is None), f"update {k} at {path}: None on one side"
            if a is not None:
                assert a.dtype == b.dtype, f"update {k} at {path}: {a.dtype} vs {b.dtype}"
                err = _rel(a, b)
                if err > 1e-6 and _ill_conditioned(
                        a, b, functools.partial(ref.update, spec, j),
                        functools.partial(ref.moved_leaf, "update", spec, j),
                        functools.partial(ref.host_leaf, "update", spec, j)):
                    continue  # ill-conditioned: fused about as accurate as eager
                r, spread = ref.update(spec, j)
                assert err <= 1e-6, (f"update {k} at {path}: relative error {err:.3g} "
                                     f"(against float64: fused {_rel(a, r):.3g}, eager "
                                     f"{_rel(b, r):.3g}, spread {spread:.3g})")
        # (the update's new state is the step's: the same float64 reference)
        _close_states(suf, sue, f"update {k}, state", ref.state,
                      functools.partial(ref.moved_states, "update"),
                      functools.partial(ref.host_states, "update"))


# ------------------------------------------------------------------------------------------
# skip_zeros
# ------------------------------------------------------------------------------------------


def _slots(state: Any, params: Any) -> list[tuple[str, list]]:
    """The per-element state slots of ``state``: (field name, leaves aligned with the
    param leaves, ``None`` where a slot has no leaf for that param)."""
    # A slot is the params' containers with a tensor, an 8-bit slot or None at each leaf:
    # compared as structures with those three as leaves (no exception tried and caught:
    # optree's mismatch message would format every tensor of the state).
    is_q = lambda x: isinstance(x, QuantizedSlot)
    is_slot_leaf = lambda x: x is None or isinstance(x, (torch.Tensor, QuantizedSlot))
    spec = optree.tree_structure(params, is_leaf=is_slot_leaf, none_is_leaf=True,
                                 namespace="ftopt")
    # (a param held as None, frozen, has no slot leaf: dropped, so that the slots line up
    # with the param tensors, as ``ftopt.tree.flatten_with_paths`` gives them)
    held = [x is not None for x in optree.tree_leaves(
        params, is_leaf=is_slot_leaf, none_is_leaf=True, namespace="ftopt")]
    shapes = [tuple(p.shape) for p in _leaves(params)]
    found = []

    def walk(node: Any, name: str) -> None:
        if node is None or isinstance(node, (torch.Tensor, QuantizedSlot)):
            return
        flat, node_spec = optree.tree_flatten(node, is_leaf=is_slot_leaf, none_is_leaf=True,
                                              namespace="ftopt")
        if node_spec != spec:
            flat = None
        elif not all(held):
            if any(x is not None for x, h in zip(flat, held) if not h):
                raise AssertionError(f"state {name}: a slot leaf where the param is None")
            flat = [x for x, h in zip(flat, held) if h]
        if flat is not None and all(
                x is None or (is_q(x) and tuple(x.codes.shape) == sh)
                or (isinstance(x, torch.Tensor) and x.is_floating_point()
                    and tuple(x.shape) == sh) for x, sh in zip(flat, shapes)):
            found.append((name, flat))
            return
        if hasattr(node, "_fields"):
            for f in node._fields:
                if not leaf_state(node, f):  # (no element of a param's own)
                    walk(getattr(node, f), f)
        elif isinstance(node, dict):
            for v in node.values():
                walk(v, name)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v, name)

    walk(state, "")
    return found


# Quiet NaNs with payloads and signs, as integers of each float width.
_NANS = {torch.float16: [0xFE00, 0x7E01, 0x7FFF], torch.bfloat16: [0xFFC1, 0x7FC0, 0x7FFF],
         torch.float32: [0x7FC00001, 0xFFC00123, 0x7FFFFFFF]}


def _with_skipped_nans(params: Any, grads: Any, state: Any) -> tuple[Any, Any]:
    """Copies of ``params`` and ``state`` with NaNs (payloads, signs) at the first
    zero-gradient elements of each leaf: in 16-bit params (fp32 ones on a CPU, whose
    ``p + (-0.0)`` keeps a NaN's bits; a GPU's gives the canonical NaN) and in every
    per-element fp32 or 16-bit state slot (8-bit ones hold no NaN: they encode it as 0)."""
    params, state = _clone(params), _clone(state)
    _, flat_p, spec = ftopt.tree.flatten_with_paths(params)
    flat_g = spec.flatten_up_to(grads)
    slots = [leaves for _, leaves in _slots(state, params)]
    for j, (p, g) in enumerate(zip(flat_p, flat_g)):
        if g is None:
            continue
        at = (g.reshape(-1) == 0).nonzero().reshape(-1)[:3]
        targets = [x for x in (leaves[j] for leaves in slots) if isinstance(x, torch.Tensor)]
        if p.element_size() == 2 or p.device.type == "cpu":
            targets.append(p)
        for x in targets:
            if x.dtype in _NANS and x.is_contiguous() and len(at):
                nans = torch.tensor(_NANS[x.dtype][:len(at)], dtype=torch.int64)
                x.view(-1).view(_INT[x.element_size()])[at] = (
                    nans.to(torch.int32).to(_INT[x.element_size()]).to(x.device))
    return params, state


def skip_zeros_exact(case: Case, backend: str) -> None:
    """SPEC §3/§5 on one backend, every step from the skip-aware run's state; the last
    (of two or more) with NaNs at zero-gradient elements of the params and states, whose
    bits it keeps too (the plain chain's elements off the zeros then not compared, nor
    where a norm or matrix stage meets a non-finite value: :attr:`Structure.reads_others`)."""
    s_ = case.structure
    tx, plain = case.tx(), case.tx(skip=False)
    p = case.params
    s = tx.init(p)
    plain_like = plain.init(p)
    for k, g_dev in enumerate(case.grads):
        poisoned = 0 < k == len(case.grads) - 1
        if poisoned:
            p, s = _with_skipped_nans(p, g_dev, s)
        exact = s_.exact_off_zeros and not poisoned
        p1_dev, s1_dev = pure_step(case, tx, p, g_dev, s, backend)
        p0, s0 = pure_step(case, plain, p, g_dev, plain_state(s_, s, plain_like), backend)
        # (compared on the host: one copy a tensor, not an index, a kernel and a sync per
        # comparison on the GPU runner)
        p, g, s, p1, s1, p0, s0 = (_tree_host(x) for x in (p, g_dev, s, p1_dev, s1_dev,
                                                             p0, s0))
        # A NaN or an infinity in the step's inputs or the plain chain's results: a norm
        # or matrix stage may have read one where skip_zeros' read 0 (CPU fuzz seed 268:
        # the two global norms NaNs of either sign), so only the zeros are held exact.
        exact = exact and not (s_.reads_others and not _all_finite(p, s, p0, s0))
        paths, flat_p, spec = ftopt.tree.flatten_with_paths(p)
        flat_g = spec.flatten_up_to(g)
        skipped = [torch.ones(x.shape, dtype=torch.bool, device=x.device) if gg is None
                   else gg == 0 for x, gg in zip(flat_p, flat_g)]
        where = f"step {k} ({backend})"
        for path, m, old, new, ctl in zip(paths, skipped, flat_p, spec.flatten_up_to(p1),
                                          spec.flatten_up_to(p0)):
            assert torch.equal(bits(new)[m], bits(old)[m]), \
                f"{where}: param {path} changed at a zero-gradient element"
            if exact:
                assert torch.equal(bits(new)[~m], bits(ctl)[~m]), \
                    f"{where}: param {path} differs from the plain chain off the zeros " \
                    f"{_bit_diff(new[~m], ctl[~m])}"
        olds, news, ctls = _slots(s, p), _slots(s1, p), _slots(s0, p)
        assert [n for n, _ in olds] == [n for n, _ in news] == [n for n, _ in ctls], \
            f"{where}: state slots differ: {[n for n, _ in olds]}, {[n for n, _ in ctls]}"
        for (name, old_l), (_, new_l), (_, ctl_l) in zip(olds, news, ctls):
            for path, m, old, new, ctl in zip(paths, skipped, old_l, new_l, ctl_l):
                if old is None:
                    continue
                w = f"{where}: state {name} at {path}"
                if isinstance(old, QuantizedSlot):
                    _check_quantized(old, new, ctl, m, name, exact, w)
                    continue
                assert torch.equal(bits(new)[m], bits(old)[m]), \
                    f"{w} changed at a zero-gradient element"
                if exact:
                    assert torch.equal(bits(new)[~m], bits(ctl)[~m]), \
                        f"{w} differs from the plain chain off the zeros " \
                        f"{_bit_diff(new[~m], ctl[~m])}"
        p, s = p1_dev, s1_dev


def _check_quantized(old: QuantizedSlot, new: QuantizedSlot, ctl: QuantizedSlot,
                     m: torch.Tensor, name: str, exact: bool, w: str) -> None:
    """§5: all-zero-gradient blocks keep their bytes; a skipped element of another block
    is its old value re-encoded with the block's new absmax; blocks without a zero
    gradient equal the plain chain's bytes."""
    n = m.numel()
    nblocks = old.absmax.numel()
    flat_m = torch.cat([m.reshape(-1), m.new_ones(nblocks * BLOCK - n)])
    per_block = flat_m.view(nblocks, BLOCK)
    full, none = per_block.all(1), ~per_block.any(1)
    assert torch.equal(bits(new.absmax)[full], bits(old.absmax)[full]), \
        f"{w}: absmax of an all-zero-gradient block changed"
    elem_full = expand_absmax(full, n).view(m.shape)
    assert torch.equal(new.codes[elem_full], old.codes[elem_full]), \
        f"{w}: codes of an all-zero-gradient block changed"
    qmap = dynamic_map(name in SIGNED, m.device)
    old_x = dequantize_blockwise(old.codes, old.absmax, qmap, BLOCK)
    want = encode_with_absmax(old_x, expand_absmax(new.absmax, n).view(m.shape), qmap)
    part = m & ~elem_full
    assert torch.equal(new.codes[part], want[part]), \
        f"{w}: a skipped element is not its old value re-encoded with the new absmax"
    if exact:
        elem_none = expand_absmax(none, n).view(m.shape)
        assert torch.equal(bits(new.absmax)[none], bits(ctl.absmax)[none]) and torch.equal(
            new.codes[elem_none], ctl.codes[elem_none]), \
            f"{w}: a block without zero gradients differs from the plain chain"


# ------------------------------------------------------------------------------------------
# donate, checkpoint
# ------------------------------------------------------------------------------------------


def _clone(tree: Any) -> Any:
    return optree.tree_map(lambda t: t.clone(), tree, namespace="ftopt")


def donate(case: Case, backend: str) -> None:
    tx = case.tx()
    ref_p, ref_s = case.params, tx.init(case.params)
    p, s = _clone(ref_p), _clone(ref_s)
    for k, g in enumerate(case.grads):
        rp, rs = pure_step(case, tx, ref_p, g, ref_s, backend)
        ids_p, ids_s = [id(x) for x in _leaves(p)], [id(x) for x in _leaves(s)]
        snap = Snapshot(g, case.hparam_tensors())
        np_, ns = ftopt.step(tx, p, g, s, donate=True, backend=backend)
        snap.check(f"step {k} (donate=True, {backend}) on the grads/hyperparameters")
        assert [id(x) for x in _leaves(np_)] == ids_p, \
            f"step {k} ({backend}): donate=True did not return the given param tensors"
        assert [id(x) for x in _leaves(ns)] == ids_s, \
            f"step {k} ({backend}): donate=True did not return the given state tensors"
        assert_bitwise(np_, rp, f"step {k} ({backend}): donated params vs donate=False")
        assert_bitwise(ns, rs, f"step {k} ({backend}): donated state vs donate=False")
        p, s, ref_p, ref_s = np_, ns, rp, rs


def checkpoint(case: Case, backend: str) -> None:
    tx = case.tx()
    g1, g2 = case.grads[0], case.grads[-1]
    p, s = pure_step(case, tx, case.params, g1, tx.init(case.params), backend)
    buf = io.BytesIO()
    torch.save(s, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert_bitwise(loaded, s, "loaded state vs saved")
    a = pure_step(case, tx, p, g2, s, backend)
    b = pure_step(case, tx, p, g2, loaded, backend)
    assert_bitwise(b, a, f"step after torch.load ({backend}) vs the original state")


def purity(case: Case, backend: str) -> None:
    """``init``, ``update`` and ``step(donate=False)`` leave every input's bits alone."""
    tx = case.tx()
    snap = Snapshot(case.params, case.hparam_tensors())
    s = tx.init(case.params)
    snap.check("init")
    p = case.params
    for g in case.grads:
        pure_update(case, tx, p, g, s, backend)
        p, s = pure_step(case, tx, p, g, s, backend)


PROPERTIES = ("fused_vs_eager", "skip_zeros", "purity", "donate", "checkpoint")


def backends(case: Case) -> list[str]:
    return ["eager", "fused"] if case.structure.fusible else ["eager"]


def run_all(case: Case, only: tuple[str, ...] = PROPERTIES) -> dict[str, str | None]:
    """Every property that applies to ``case``: ``{property: None if it held, else the
    failure message}``. An exception other than ``AssertionError`` is a failure too; a
    :class:`PurityError` counts against "purity" whichever check met it."""
    results: dict[str, str | None] = {}

    def run(name: str, fn, *args) -> None:
        results.setdefault(name, None)
        try:
            fn(case, *args)
        except PurityError as err:
            results["purity"] = results.get("purity") or f"{name}: {err}"
        except Exception as err:  # noqa: BLE001  (reported, never swallowed)
            results[name] = results[name] or f"{type(err).__name__}: {err}"

    if "fused_vs_eager" in only and case.structure.fusible:
        run("fused_vs_eager", fused_vs_eager)
    for b in backends(case):
        if "skip_zeros" in only and case.structure.skip != "off":
            run("skip_zeros", skip_zeros_exact, b)
        if "purity" in only:
            run("purity", purity, b)
        if "donate" in only:
            run("donate", donate, b)
        if "checkpoint" in only:
            run("checkpoint", checkpoint, b)
    return results
