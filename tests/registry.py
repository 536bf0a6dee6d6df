"""Every transform, alias and combinator that ``ftopt`` exports, with what tests need to know.

One table, so that a property test can draw from all of ftopt at once and a new export
cannot be forgotten (``tests/test_registry.py`` fails when an export that builds a
``GradientTransformation`` has no entry here). Each :class:`Entry` says how to build the
transform (``make(**hparams)``), how to draw valid hyperparameters (``sample(src)``, where
``src`` is any :class:`Source`: ``random.Random``-backed on the GPU runner, hypothesis-backed
in pytest), and its traits:

* ``states``: names of its per-element state slots; ``counted``: it keeps a step count;
* ``norms``: ``None``, ``"row"``, ``"leaf"`` or ``"global"`` (reads a reduction of the
  update: over each row ``u[i, ...]``, as a row norm or a row mean; a per-leaf norm; or a
  global norm);
* ``uses_params``; ``keeps_zero``: a zero incoming update stays zero (so a norm after it
  sees the same value with or without ``skip_zeros``);
* ``fusible``: it has an elementwise rule, so a chain of only fusible entries fuses;
* ``eight_bit``: it has per-element float states that ``quantize_states`` stores in 8 bits
  (or, with ``state_dtype``, in bf16/fp16: ``tests/test_state_dtype.py``);
  ``wide_states``: those of its states that stay in the params' dtype all the same (copies
  of the params); ``wide_follow_state_dtype``: ``state_dtype`` stores them as asked (see the
  fields; :meth:`Entry.wide` says which states a suite should find wide);
* ``mixes``: its update at one element reads other elements of the leaf beyond a norm (a
  matrix stage such as Newton-Schulz or factored moments): §3's element-by-element
  comparison with the plain chain and the per-element state layout the skip_zeros and
  reference suites assume do not hold; ``tests/test_matrix_optimizers.py`` checks these
  entries' float64 references and skip_zeros instead;
* ``norm_after_state``: its ``norms`` reads the output of its own stateful stage (MARS's
  clip of the corrected gradient), so with ``skip_zeros`` the elements off the zeros differ
  from the plain transform's, as after a stateful stage of a chain (SPEC §3);
* ``kind``: ``"transform"`` (a chain building block), ``"alias"`` (a whole optimizer) or
  ``"combinator"`` (wraps other transforms; ``make`` takes them as keywords);
* ``bookkeeping``: its state holds 0-d values that are neither step counts nor
  per-element state (``apply_if_finite``'s flags, ``MultiSteps``' micro-step counters,
  ``inject_hyperparams``' values): suites that expect only counts and slots leave them out;
* ``calls_per_step``: with its ``defaults()``, the inner step counts advance once every
  this many calls (``MultiSteps``' ``every_k_schedule``), not on every call;
* ``positional``: its update at a leaf depends on the leaf's position in the flattened
  tree (``add_noise``): suites that drop a leaf compare the others differently.

Hyperparameters are drawn inside the domains the constructors accept (SPEC §2, §4), at the
edges some of the time; float ones may be drawn as 0-d tensors. For the property suites an
entry also has ``example`` (hand-picked hyperparameters: :meth:`Entry.defaults` is each
option's first choice plus these), ``inner`` (a combinator's inner entries) and ``moves``
(False where the standalone optimizer leaves params as they are); :func:`standalone` builds
an entry into a whole optimizer (an alias as it is, anything else chained with
``scale_by_learning_rate``), and :func:`fusible`, :func:`eight_bit`, :func:`stateful`,
:func:`norms` and :func:`by_trait` select entries.

How to add a transform to the tests
-----------------------------------
1. Add one :class:`Entry` to :data:`TRANSFORMS` below: ``make``, the hyperparameter
   domains (``floats``, ``options``), its traits, and ``example`` values that make a sane
   optimizer (aliases: at least ``learning_rate``; combinators: ``inner``).
2. That is all for most suites: purity, pytrees, errors, checkpoint, fused-vs-eager
   (``fusible``), fused ``tx.update``, 8-bit states (``eight_bit``), skip_zeros around a
   single transform and the fuzzed contract read this table, and
   ``tests/test_registry.py::test_suites_cover_the_registry`` fails if one does not.
3. Some suites need data the registry does not hold; they fail (not skip), naming the table
   to extend, until it is added. An alias needs a ``Case`` in
   ``tests/test_skip_zeros.py::CASES`` (its §2 parts: the oracle of §3) and a float64
   reference: a class in ``tests/reference.py``, a case in
   ``tests/test_aliases_vs_reference.py::CASES`` and its name in ``REGISTRY_CASES`` there.
   A suite may pick other hyperparameters for an entry in its ``OVERRIDES`` (keyed by
   registry name). The measured 8-bit tracking bounds
   (``test_quantized_states.py::BOUNDS``) cover a hand-picked list, not every entry.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

import ftopt
from ftopt.base import GradientTransformation


class Source(Protocol):
    """Where random choices come from (``random.Random`` or hypothesis' ``data.draw``)."""

    def floats(self, lo: float, hi: float) -> float: ...

    def integers(self, lo: int, hi: int) -> int: ...

    def choice(self, options: Sequence[Any]) -> Any: ...

    def boolean(self, p: float = 0.5) -> bool: ...




@dataclass(frozen=True)
class HP:
    """A float hyperparameter's domain ``[lo, hi]`` (log-uniform when ``log``).

    ``tensor``: may be passed as a 0-d tensor. ``schedule``: a learning-rate-like value
    that may also be a schedule of the step count.
    """

    lo: float
    hi: float
    log: bool = False
    tensor: bool = True
    schedule: bool = False

    def draw(self, src: Source) -> float:
        """An edge value a fifth of the time (where edges are bugs' favourite places),
        magnitudes below fp32's smallest normal (2**-126) included
        (``test_fuzz_pinned.py::test_tiny_hyperparameter_in_the_interpreter``)."""
        edge = src.integers(0, 9)
        if edge == 0:
            return self.lo
        if edge == 1:
            return self.hi
        if self.log and self.lo > 0:
            return math.exp(src.floats(math.log(self.lo), math.log(self.hi)))
        return src.floats(self.lo, self.hi)


BETA = HP(0.0, 0.999)
EPS = HP(1e-8, 1e-3, log=True)
EPS_ROOT = HP(0.0, 1e-6)
LR = HP(1e-4, 1e-1, log=True, schedule=True)
WD = HP(0.0, 0.1)
DECAY = HP(0.0, 0.99)
BELIEF_B1 = HP(0.1, 0.999)  # see scale_by_belief below


def draw_schedule(src: Source, lo: float = 1e-4, hi: float = 1e-1) -> Callable:
    """One of ftopt's schedules, with values inside ``[lo, hi]``."""
    a = math.exp(src.floats(math.log(lo), math.log(hi)))
    b = math.exp(src.floats(math.log(lo), math.log(hi)))
    n = src.integers(1, 6)
    s = ftopt.schedules
    options = {
        "constant": lambda: s.constant_schedule(a),
        "linear": lambda: s.linear_schedule(a, b, n),
        "cosine": lambda: s.cosine_decay_schedule(a, n, b / a),
        "warmup_cosine": lambda: s.warmup_cosine_decay_schedule(lo, a, 1, n + 1, b),
        "exponential": lambda: s.exponential_decay(a, n, 0.5, end_value=lo),
        "polynomial": lambda: s.polynomial_schedule(a, b, 2.0, n),
        "warmup_constant": lambda: s.warmup_constant_schedule(lo, a, n),
        "piecewise": lambda: s.piecewise_constant_schedule(a, {1: 0.5, 3: 0.5}),
        "join": lambda: s.join_schedules([s.constant_schedule(a), s.linear_schedule(a, b, n)],
                                         [1]),
        "interpolate": lambda: s.piecewise_interpolate_schedule("cosine", a, {n: b / a}),
        "onecycle": lambda: s.linear_onecycle_schedule(n + 2, a, div_factor=max(a / b, 1.0),
                                                       final_div_factor=1.0),
        "warmup_exponential": lambda: s.warmup_exponential_decay_schedule(lo, a, 1, n, 0.5,
                                                                          end_value=lo),
        "sgdr": lambda: s.sgdr_schedule([dict(init_value=lo, peak_value=a, warmup_steps=1,
                                              decay_steps=n + 1, end_value=b)] * 2),
    }
    return options[src.choice(sorted(options))]()


@dataclass(frozen=True)
class Entry:
    """One buildable thing of ftopt (see the module docstring for the traits)."""

    name: str
    make: Callable[..., GradientTransformation]
    export: str = ""  # the ftopt name it exercises (default: ``name``)
    floats: dict[str, HP] = field(default_factory=dict)
    options: dict[str, tuple] = field(default_factory=dict)  # structural (compile-time)
    kind: str = "transform"
    states: tuple[str, ...] = ()
    counted: bool = False
    norms: str | None = None
    uses_params: bool = False
    keeps_zero: bool = False
    fusible: bool = True
    eight_bit: bool = False
    mixes: bool = False
    # Its norm reads the output of its own stateful stage (MARS clips the corrected gradient,
    # not 0 at a zero gradient): with skip_zeros the norm sees 0 there, so the elements off
    # the zeros differ from the plain transform's, as after a stateful stage of a chain.
    norm_after_state: bool = False
    moves: bool = True  # its standalone optimizer changes the params (not set_to_zero)
    # States that stay in the params' compute dtype under state_bits=8 and state_dtype (copies
    # of the params, rules.Slot.from_params: MADGRAD's x0, Prodigy's params0, Schedule-Free's
    # z): their leaves mix layouts, which both backends run (the 8-bit kernels load and store
    # such slots as floats), so the 8-bit and state_dtype suites expect them wide.
    wide_states: tuple[str, ...] = ()
    # ``state_dtype`` (an alias' keyword) stores the wide states as asked too (the
    # Schedule-Free aliases', as optax's), where the others keep the params' dtype.
    wide_follow_state_dtype: bool = False
    example: dict[str, Any] = field(default_factory=dict)  # hand-picked hyperparameters
    inner: tuple[str, ...] = ()  # combinators: the registry entries standalone() wraps
    bookkeeping: bool = False
    calls_per_step: int = 1
    # Its update at a leaf depends on the leaf's position in the flattened tree (add_noise's
    # draws): a tree with a leaf removed gives the others other values.
    positional: bool = False
    # Its update is scaled by a running 0-d value of its state made from global sums
    # (Prodigy's d, from Σ g·(x0 - p) and Σ|s|): the fp32 rounding of that value (a few ulps,
    # more where the dot product cancels) scales every later step of every element, so a
    # trajectory of steps of size ~d drifts from float64 beyond the per-element fp32
    # tolerance (measured: 6e-6 to 4e-5 of max(|p|, 1) at steps 4-6, fp16 states, d ~ 22); the
    # state_dtype float64 trajectory leaves it out, tests/test_prodigy.py compares its steps
    # from the same state instead.
    running_scale: bool = False

    def steps_after(self, calls: int) -> int:
        """How far its step counts have advanced after ``calls`` calls from ``init``."""
        return calls // self.calls_per_step

    @property
    def exported(self) -> str:
        return self.export or self.name

    def draw_options(self, src: Source) -> dict:
        """The structural choices (booleans, masks): part of a kernel's identity."""
        return {k: src.choice(v) for k, v in self.options.items()}

    def draw_floats(self, src: Source, tensors: bool = False, device: Any = "cpu",
                    schedules: bool = False) -> dict:
        """Float hyperparameters. ``tensors``: each may come as a 0-d fp32 tensor;
        ``schedules``: those that may be schedules are (both change the kernel)."""
        out: dict[str, Any] = {}
        for k, hp in self.floats.items():
            if hp.schedule and schedules:
                out[k] = draw_schedule(src, hp.lo, hp.hi)
                continue
            value = hp.draw(src)
            if tensors and hp.tensor and src.boolean(0.6):
                out[k] = torch.tensor(value, dtype=torch.float32, device=device)
            else:
                out[k] = value
        return out

    def sample(self, src: Source, **kwargs) -> dict:
        """All hyperparameters: ``make(**entry.sample(src))`` builds a valid transform."""
        return {**self.draw_options(src), **self.draw_floats(src, **kwargs)}

    def defaults(self, tensors: bool = False) -> dict:
        """Fixed hyperparameters for the property suites: each option's first choice and
        the hand-picked ``example`` values (the constructor's defaults for the rest).
        ``tensors``: floats that may be 0-d tensors come as fresh fp32 tensors."""
        out = {k: v[0] for k, v in self.options.items()}
        for k, v in self.example.items():
            hp = self.floats.get(k)
            if tensors and hp is not None and hp.tensor and isinstance(v, float):
                v = torch.tensor(v, dtype=torch.float32)
            out[k] = v
        return out

    @property
    def stateful(self) -> bool:
        """Whether its standalone optimizer keeps per-element state (inner ones included)."""
        return bool(self.states) or any(BY_NAME[n].stateful for n in self.inner)

    @property
    def needs_params(self) -> bool:
        """Whether its standalone optimizer reads params (inner ones included)."""
        return self.uses_params or any(BY_NAME[n].uses_params for n in self.inner)

    def wide(self, state_dtype: bool = False) -> frozenset[str]:
        """The states of its standalone optimizer (inner ones included) that stay in the
        params' dtype under ``state_bits=8`` or, when ``state_dtype``, under
        ``standalone(..., state_dtype=...)``."""
        names = set() if state_dtype and self.wide_follow_state_dtype else set(self.wide_states)
        for n in self.inner:
            names |= BY_NAME[n].wide(state_dtype)
        return frozenset(names)

    @property
    def quantizable(self) -> bool:
        """Whether 8-bit states of its standalone optimizer hold codes (inner ones included)."""
        return self.eight_bit or any(BY_NAME[n].eight_bit for n in self.inner)


def _ndim_mask(params: Any) -> Any:
    """A callable mask: matrices (and higher) only, as weight decay masks usually are
    (a leaf that is no tensor is left out, so that the library, not the mask, rejects it)."""
    return ftopt.tree.map(lambda p: isinstance(p, torch.Tensor) and p.ndim >= 2, params)


def _odd_mask(params: Any) -> Any:
    return ftopt.tree.map(lambda p: isinstance(p, torch.Tensor) and p.numel() % 2 == 1,
                          params)


MASKS: dict[str, Callable | None] = {"none": None, "ndim": _ndim_mask, "odd": _odd_mask}
FREEZE_MASKS: dict[str, Any] = {"nothing": False, "ndim": _ndim_mask, "odd": _odd_mask}


def _halve(updates: Any, params: Any) -> Any:
    del params
    return ftopt.tree.map(lambda u: u * 0.5, updates)


def _schedule_from(value: float, schedule: str) -> Callable:
    """A schedule starting at ``value`` (``schedule``: linear, cosine or join)."""
    s = ftopt.schedules
    made = {"linear": lambda: s.linear_schedule(value, 0.5 * value, 3),
            "cosine": lambda: s.cosine_decay_schedule(value, 4, 0.1),
            "join": lambda: s.join_schedules([s.constant_schedule(value),
                                              s.linear_schedule(value, 0.1 * value, 2)], [1])}
    return made[schedule]()


def _sched_lr(learning_rate: float, schedule: str = "linear",
              **kw) -> GradientTransformation:
    """A scheduled (so counted) learning rate starting at ``learning_rate``."""
    return ftopt.scale_by_learning_rate(_schedule_from(learning_rate, schedule), **kw)


def _sched_decay(fn: Callable) -> Callable:
    """``fn`` (a weight decay taking ``weight_decay`` and ``mask``) with a scheduled decay
    starting at ``weight_decay``."""
    def make(weight_decay: float, schedule: str = "linear", mask: str = "none"):
        return fn(_schedule_from(weight_decay, schedule), MASKS[mask])
    return make


def _sched_scale(step_size: float, schedule: str = "linear") -> GradientTransformation:
    """``scale_by_schedule`` of a schedule starting at ``step_size`` (any sign)."""
    s, a = ftopt.schedules, step_size
    made = {"linear": lambda: s.linear_schedule(a, 0.5 * a, 3),
            "cosine": lambda: s.cosine_decay_schedule(a, 4, 0.1),
            "join": lambda: s.join_schedules([s.constant_schedule(a),
                                              s.linear_schedule(a, 0.1 * a, 2)], [1])}
    return ftopt.scale_by_schedule(made[schedule]())


def _ademamix_sched(b1: float, b2: float, b3: float, alpha: float, eps: float,
                    warmup: int, **kw) -> GradientTransformation:
    """AdEMAMix with bitsandbytes' warm-ups of alpha and b3 (schedules of t)."""
    b1c = min(max(b1, 0.05), 0.95)
    b3c = min(max(b3, b1c + 0.01), 0.9999)
    return ftopt.scale_by_ademamix(b1, b2, ftopt.ademamix_b3_warmup(b1c, b3c, warmup),
                                   ftopt.ademamix_alpha_warmup(alpha, warmup), eps, **kw)


def _mask_kw(fn: Callable, key: str = "mask") -> Callable:
    """``fn`` with its mask option given by name (see :data:`MASKS`)."""
    def make(**kw):
        if key in kw:
            kw[key] = MASKS[kw[key]] if kw[key] in MASKS else kw[key]
        return fn(**kw)
    return make


def _lars(trust_ratio_mask: str = "all", weight_decay_mask: str = "all", **kw):
    masks = {"all": True, **{k: v for k, v in MASKS.items() if v is not None}}
    return ftopt.lars(trust_ratio_mask=masks[trust_ratio_mask],
                      weight_decay_mask=masks[weight_decay_mask], **kw)


_MUON_FIELDS = dict(
    floats={"learning_rate": LR, "beta": BETA, "eps": EPS, "weight_decay": WD},
    options={"ns_dtype": (torch.float32,), "nesterov": (True, False),
             "adaptive": (False, True), "weight_decay_mask": ("none", "ndim")},
    kind="alias", states=("mu", "nu"), counted=True, uses_params=True, eight_bit=True,
    mixes=True, example={"learning_rate": 1e-2, "beta": 0.95, "weight_decay": 0.01})


def _last_two(params):
    return ftopt.tree.map(lambda p: ftopt.MuonDimensionNumbers(-2, -1)
                          if isinstance(p, torch.Tensor) and p.ndim >= 2 else None, params)


def _muon_last_two(**kw):
    return ftopt.muon(muon_weight_dimension_numbers=_last_two, **kw)


def _normuon_last_two(**kw):
    return ftopt.normuon(muon_weight_dimension_numbers=_last_two, **kw)


_NORMUON_FIELDS = dict(
    floats={"learning_rate": LR, "beta": BETA, "beta2": HP(0.0, 0.99, tensor=False),
            "eps": EPS, "weight_decay": WD, "normuon_scale": HP(0.05, 1.0, tensor=False)},
    options={"ns_dtype": (torch.float32,), "nesterov": (True, False),
             "weight_decay_mask": ("none", "ndim")},
    kind="alias", states=("mu", "nu"), counted=True, uses_params=True, eight_bit=True,
    mixes=True, example={"learning_rate": 1e-2, "beta": 0.95, "weight_decay": 0.01})

_ADAM_FLOATS = {"b1": BETA, "b2": BETA, "eps": EPS, "eps_root": EPS_ROOT}

# What the snapshot entry measures of the updates.
_MEASURES: dict[str, Callable] = {"norm": ftopt.tree.norm, "max": ftopt.tree.max,
                                  "sum": ftopt.tree.sum}

TRANSFORMS: list[Entry] = [
    # ---- chain building blocks (SPEC §2)
    Entry("scale", ftopt.scale, floats={"step_size": HP(-2.0, 2.0)}, keeps_zero=True,
          example={"step_size": 0.5}),
    Entry("scale_by_learning_rate", ftopt.scale_by_learning_rate,
          floats={"learning_rate": HP(1e-4, 1e-1, log=True)},
          options={"flip_sign": (True, False)}, keeps_zero=True,
          example={"learning_rate": 1e-2}),
    Entry("scale_by_learning_rate[schedule]", _sched_lr, export="scale_by_learning_rate",
          floats={"learning_rate": HP(1e-4, 1e-1, log=True, tensor=False)},
          options={"flip_sign": (True, False), "schedule": ("linear", "cosine", "join")},
          counted=True, keeps_zero=True,
          example={"learning_rate": 1e-2}),
    Entry("add_decayed_weights", _mask_kw(ftopt.add_decayed_weights),
          floats={"weight_decay": WD}, options={"mask": ("none", "ndim", "odd")},
          uses_params=True,
          example={"weight_decay": 0.1}),
    Entry("add_decayed_weights[schedule]", _sched_decay(ftopt.add_decayed_weights),
          export="add_decayed_weights", floats={"weight_decay": HP(0.0, 0.1, tensor=False)},
          options={"schedule": ("linear", "cosine", "join"), "mask": ("none", "ndim")},
          counted=True, uses_params=True, example={"weight_decay": 0.1}),
    # optax.contrib's cautious weight decay: u + wd·p where sign(u)·sign(p) >= 0
    Entry("add_cautious_weight_decay", _mask_kw(ftopt.add_cautious_weight_decay),
          floats={"weight_decay": WD}, options={"mask": ("none", "ndim", "odd")},
          uses_params=True, example={"weight_decay": 0.1}),
    Entry("add_cautious_weight_decay[schedule]", _sched_decay(ftopt.add_cautious_weight_decay),
          export="add_cautious_weight_decay",
          floats={"weight_decay": HP(0.0, 0.1, tensor=False)},
          options={"schedule": ("linear", "cosine", "join"), "mask": ("none", "ndim")},
          counted=True, uses_params=True, example={"weight_decay": 0.1}),
    Entry("weight_decay", _mask_kw(ftopt.weight_decay), floats={"weight_decay": WD},
          options={"mask": ("none", "ndim")}, uses_params=True,
          example={"weight_decay": 0.1}),
    Entry("scale_by_adam", ftopt.scale_by_adam, floats=_ADAM_FLOATS,
          options={"nesterov": (False, True)}, states=("mu", "nu"), counted=True,
          eight_bit=True,
          example={"b1": 0.9, "b2": 0.999, "eps": 1e-8}),
    Entry("scale_by_ademamix", ftopt.scale_by_ademamix,
          floats={**_ADAM_FLOATS, "b3": HP(0.0, 0.9999), "alpha": HP(0.0, 10.0)},
          states=("m1", "m2", "nu"), counted=True, eight_bit=True,
          example={"b1": 0.9, "b2": 0.999, "b3": 0.999, "alpha": 5.0, "eps": 1e-8}),
    Entry("scale_by_ademamix[warmup]", _ademamix_sched, export="scale_by_ademamix",
          floats={"b1": BETA, "b2": BETA, "b3": HP(0.5, 0.9999, tensor=False),
                  "alpha": HP(0.0, 10.0, tensor=False), "eps": EPS},
          options={"warmup": (1, 3, 10)}, states=("m1", "m2", "nu"), counted=True,
          eight_bit=True,
          example={"b1": 0.9, "b2": 0.999, "b3": 0.999, "alpha": 5.0, "eps": 1e-8}),
    Entry("scale_by_adamax", ftopt.scale_by_adamax,
          floats={"b1": BETA, "b2": BETA, "eps": EPS}, states=("mu", "nu"), counted=True,
          eight_bit=True,
          example={"b1": 0.9, "b2": 0.999, "eps": 1e-8}),
    Entry("scale_by_amsgrad", ftopt.scale_by_amsgrad, floats=_ADAM_FLOATS,
          options={"bias_correction_mu": (True, False), "bias_correction_nu": (True, False)},
          states=("mu", "nu", "nu_max"), counted=True, eight_bit=True,
          example={"b1": 0.9, "b2": 0.999, "eps": 1e-8}),
    Entry("scale_by_radam", ftopt.scale_by_radam,
          floats={**_ADAM_FLOATS, "threshold": HP(4.0, 10.0)},
          options={"nesterov": (False, True)}, states=("mu", "nu"), counted=True,
          eight_bit=True,
          example={"b1": 0.9, "b2": 0.99, "eps": 1e-8, "threshold": 5.0}),
    # b1 from 0.1: with b1 = 0 the prediction error u - mu is 0, nu stays at eps_root and
    # the update is u/eps (1e16·u at eps = 1e-16): a valid but degenerate optimizer whose
    # overflow to inf the backends need not agree on.
    # (eps from 1e-8: the first steps divide by the root of one gradient's square)
    Entry("scale_by_acprop", ftopt.scale_by_acprop,
          floats={"b1": BETA, "b2": BETA, "eps": HP(1e-8, 1e-3, log=True),
                  "eps_root": HP(0.0, 1e-6)},
          states=("mu", "nu"), counted=True, eight_bit=True,
          example={"b1": 0.9, "b2": 0.999, "eps": 1e-8, "eps_root": 1e-16}),
    Entry("scale_by_belief", ftopt.scale_by_belief,
          floats={"b1": BELIEF_B1, "b2": BETA, "eps": HP(1e-16, 1e-3, log=True),
                  "eps_root": HP(0.0, 1e-6)},
          options={"nesterov": (False, True)}, states=("mu", "nu"), counted=True,
          eight_bit=True,
          example={"b1": 0.9, "b2": 0.999, "eps": 1e-16, "eps_root": 1e-16}),
    Entry("scale_by_yogi", ftopt.scale_by_yogi,
          floats={**_ADAM_FLOATS, "initial_accumulator_value": HP(0.0, 1.0, tensor=False)},
          states=("mu", "nu"), counted=True, eight_bit=True,
          example={"b1": 0.9, "b2": 0.999, "eps": 1e-3, "initial_accumulator_value": 1e-6}),
    Entry("scale_by_adopt", ftopt.scale_by_adopt,
          floats={"b1": BETA, "b2": BETA, "eps": EPS},
          options={"use_clipping": (True, False), "nesterov": (False, True)},
          states=("mu", "nu"), counted=True, eight_bit=True,
          example={"b1": 0.9, "b2": 0.999, "eps": 1e-6}),
    Entry("scale_by_simplified_ademamix", ftopt.scale_by_simplified_ademamix,
          floats={**_ADAM_FLOATS, "alpha": HP(0.0, 10.0)}, states=("m", "n"), counted=True,
          eight_bit=True,
          example={"b1": 0.9, "b2": 0.95, "alpha": 2.0, "eps": 1e-8}),
    Entry("scale_by_adadelta", ftopt.scale_by_adadelta, floats={"rho": DECAY, "eps": EPS},
          states=("e_g", "e_x"), keeps_zero=True, eight_bit=True,
          example={"rho": 0.9, "eps": 1e-6}),
    Entry("ema", ftopt.ema, floats={"decay": DECAY}, options={"debias": (True, False)},
          states=("ema",), counted=True, eight_bit=True,
          example={"decay": 0.9}),
    Entry("scale_by_optimistic_gradient", ftopt.scale_by_optimistic_gradient,
          floats={"alpha": HP(0.0, 2.0), "beta": HP(0.0, 2.0)},
          states=("previous_gradient",), counted=True, eight_bit=True,
          example={"alpha": 1.0, "beta": 1.0}),
    Entry("scale_by_sign", ftopt.scale_by_sign, keeps_zero=True),
    # A matrix stage (ftopt.matrix): the elementwise stages around it fuse in segments.
    Entry("scale_by_row_norm", ftopt.scale_by_row_norm, floats={"eps": HP(0.0, 1e-3)},
          norms="row", keeps_zero=True, example={"eps": 1e-8}),
    # A matrix stage that reads the params (per-unit norms of update and param).
    Entry("adaptive_grad_clip", ftopt.adaptive_grad_clip,
          floats={"clipping": HP(0.01, 2.0, log=True), "eps": HP(0.0, 1e-2)},
          norms="row", uses_params=True, keeps_zero=True,
          example={"clipping": 0.05, "eps": 1e-3}),
    Entry("scale_by_lion", ftopt.scale_by_lion, floats={"b1": BETA, "b2": BETA},
          states=("mu",), counted=True, eight_bit=True,
          example={"b1": 0.9, "b2": 0.99}),
    # optax.contrib's Ano: the momentum's sign, the gradient's magnitude, a Yogi-like nu
    Entry("scale_by_ano", ftopt.scale_by_ano,
          floats={"b1": BETA, "b2": HP(0.5, 0.999), "eps": EPS},
          options={"logarithmic_schedule": (False, True)}, states=("mu", "nu"),
          counted=True, eight_bit=True, example={"b1": 0.92, "b2": 0.99, "eps": 1e-8}),
    # optax.contrib's MARS: Adam on a variance-reduced gradient clipped to a global norm
    Entry("scale_by_mars", ftopt.scale_by_mars,
          floats={"b1": HP(0.0, 0.99), "b2": BETA, "eps": EPS, "gamma": HP(0.0, 0.5)},
          options={"clip_threshold": (1.0, None)}, states=("last_grad", "mu", "nu"),
          counted=True, norms="global", norm_after_state=True, eight_bit=True,
          example={"b1": 0.95, "b2": 0.99, "gamma": 0.025}),
    Entry("trace", ftopt.trace, floats={"decay": DECAY}, options={"nesterov": (False, True)},
          states=("trace",), eight_bit=True,
          example={"decay": 0.9}),
    Entry("scale_by_rms", ftopt.scale_by_rms,
          floats={"decay": DECAY, "eps": EPS, "initial_scale": HP(0.0, 1.0, tensor=False)},
          options={"eps_in_sqrt": (True, False)}, states=("nu",), keeps_zero=True,
          eight_bit=True,
          example={"decay": 0.9, "eps": 1e-8, "initial_scale": 0.1}),
    Entry("scale_by_stddev", ftopt.scale_by_stddev,
          floats={"decay": DECAY, "eps": EPS, "initial_scale": HP(0.0, 1.0, tensor=False)},
          options={"eps_in_sqrt": (True, False)}, states=("mu", "nu"), keeps_zero=True,
          eight_bit=True,
          example={"decay": 0.9, "eps": 1e-8, "initial_scale": 0.1}),
    Entry("scale_by_stddev[bias_correction]",
          lambda **kw: ftopt.scale_by_stddev(**kw, bias_correction=True),
          export="scale_by_stddev",
          # (initial_scale > 0: with 0 the first step's centered variance is 0 - g² + g²,
          # rounding's, as in optax)
          floats={"decay": BETA, "eps": EPS, "initial_scale": HP(0.05, 1.0, tensor=False)},
          options={"eps_in_sqrt": (True, False)}, states=("mu", "nu"), counted=True,
          keeps_zero=True, eight_bit=True,
          example={"decay": 0.9, "eps": 1e-8, "initial_scale": 0.1}),
    Entry("scale_by_rss", ftopt.scale_by_rss,
          floats={"initial_accumulator_value": HP(0.0, 1.0, tensor=False), "eps": EPS},
          options={"eps_in_sqrt": (True, False)}, states=("sum_of_squares",),
          keeps_zero=True, eight_bit=True,
          example={"initial_accumulator_value": 0.1, "eps": 1e-7}),
    Entry("scale_by_trust_ratio", ftopt.scale_by_trust_ratio,
          floats={"min_norm": HP(0.0, 0.1), "trust_coefficient": HP(1e-3, 1.0, log=True),
                  "eps": HP(0.0, 1e-3)},
          norms="leaf", uses_params=True, keeps_zero=True,
          example={"trust_coefficient": 0.1}),
    Entry("clip_by_param_norm_ratio", ftopt.clip_by_param_norm_ratio,
          floats={"max_ratio": HP(1e-2, 10.0, log=True)}, norms="leaf", uses_params=True,
          keeps_zero=True,
          example={"max_ratio": 0.5}),
    Entry("clip_by_global_norm", ftopt.clip_by_global_norm,
          floats={"max_norm": HP(0.1, 10.0, log=True)}, norms="global", keeps_zero=True,
          example={"max_norm": 1.0}),
    Entry("identity", ftopt.identity, keeps_zero=True),
    Entry("skip_zeros", ftopt.skip_zeros, kind="marker", keeps_zero=True),
    Entry("set_to_zero", ftopt.set_to_zero, keeps_zero=True, moves=False),
    # ---- utilities without an elementwise rule: they run eagerly
    Entry("stateless", lambda: ftopt.stateless(_halve), keeps_zero=True, fusible=False),
    Entry("stateless_with_tree_map",
          lambda: ftopt.stateless_with_tree_map(lambda u, p: u * 0.5), keeps_zero=True,
          fusible=False),
    Entry("with_extra_args_support", lambda inner=(): ftopt.with_extra_args_support(*inner),
          kind="combinator", inner=("scale_by_adam",)),
    # ---- combinators: ``make`` takes the inner transforms
    Entry("chain", lambda inner=(): ftopt.chain(*inner), kind="combinator",
          inner=("scale_by_adam", "add_decayed_weights")),
    Entry("named_chain",
          lambda inner=(): ftopt.named_chain(*[(f"t{i}", t) for i, t in enumerate(inner)]),
          kind="combinator",
          inner=("scale_by_adam", "add_decayed_weights")),
    Entry("masked", lambda inner=(), mask="ndim": ftopt.masked(inner[0], MASKS[mask]),
          options={"mask": ("ndim", "odd")}, kind="combinator", fusible=False,
          inner=("scale_by_adam",)),
    Entry("partition",
          lambda inner=(), labels="ndim": ftopt.partition(
              {"lab_a": inner[0], "lab_b": inner[1]},
              lambda p: ftopt.tree.map(
                  lambda x: "lab_a" if MASKS[labels](x) else "lab_b", p)),
          options={"labels": ("ndim", "odd")}, kind="combinator", fusible=False,
          inner=("scale_by_adam", "trace")),
    Entry("multi_transform",  # optax's older name of partition
          lambda inner=(), labels="ndim": ftopt.multi_transform(
              {"lab_a": inner[0], "lab_b": inner[1]},
              lambda p: ftopt.tree.map(
                  lambda x: "lab_a" if MASKS[labels](x) else "lab_b", p)),
          options={"labels": ("ndim", "odd")}, kind="combinator", fusible=False,
          inner=("trace", "scale_by_adam")),
    Entry("selective_transform",
          lambda inner=(), freeze_mask="nothing": ftopt.selective_transform(
              inner[0], freeze_mask=FREEZE_MASKS[freeze_mask]),
          # (the suites' defaults train every leaf: they look for each leaf's state; the
          # drawn options freeze some, and tests/test_freezing.py checks what they do)
          options={"freeze_mask": ("nothing", "ndim", "odd")}, kind="combinator",
          fusible=False,
          inner=("scale_by_adam",)),
    Entry("conditionally_transform",
          lambda inner=(), every=1: ftopt.conditionally_transform(
              inner[0], lambda step: step % every == 0),
          options={"every": (1, 2)}, kind="combinator", fusible=False,
          inner=("scale_by_adam",), bookkeeping=True),
    Entry("conditionally_mask",
          lambda inner=(), every=1: ftopt.conditionally_mask(
              inner[0], lambda step: step % every == 0),
          options={"every": (1, 2)}, kind="combinator", fusible=False,
          inner=("scale_by_adam",), bookkeeping=True),
    Entry("apply_if_finite",
          lambda inner=(), max_consecutive_errors=2: ftopt.apply_if_finite(
              inner[0], max_consecutive_errors),
          options={"max_consecutive_errors": (0, 2)}, kind="combinator", fusible=False,
          inner=("scale_by_adam",), bookkeeping=True),
    # optax.contrib's cautious: the update kept where it opposes the gradient, each leaf
    # scaled by n / (kept + eps) (a count over the leaf, as a norm)
    Entry("cautious", lambda inner=(), eps=1e-8: ftopt.cautious(inner[0], eps),
          floats={"eps": HP(1e-8, 1.0, log=True, tensor=False)}, kind="combinator",
          fusible=False, inner=("adam",), example={"eps": 1e-8}),
    Entry("quantize_states",
          lambda inner=(), bits=8, min_size=0, state_dtype=None: ftopt.quantize_states(
              inner[0], bits=bits, min_size=min_size, state_dtype=state_dtype),
          options={"bits": (8, 32), "state_dtype": (None, torch.bfloat16, torch.float16)},
          kind="combinator", inner=("scale_by_adam",)),
    # ---- aliases (SPEC §4): each also takes skip_zeros= and state_bits=
    Entry("sgd", ftopt.sgd, floats={"learning_rate": LR}, kind="alias", keeps_zero=True,
          example={"learning_rate": 0.1}),
    Entry("sgd[momentum]", ftopt.sgd, export="sgd",
          floats={"learning_rate": LR, "momentum": DECAY},
          options={"nesterov": (False, True)}, kind="alias", states=("trace",),
          eight_bit=True,
          example={"learning_rate": 0.1, "momentum": 0.9}),
    Entry("adam", ftopt.adam, floats={"learning_rate": LR, **_ADAM_FLOATS},
          options={"nesterov": (False, True)}, kind="alias", states=("mu", "nu"),
          counted=True, eight_bit=True,
          example={"learning_rate": 1e-2, "b1": 0.9, "b2": 0.999, "eps": 1e-8}),
    Entry("adamw", _mask_kw(ftopt.adamw),
          floats={"learning_rate": LR, **_ADAM_FLOATS, "weight_decay": WD},
          options={"nesterov": (False, True), "mask": ("none", "ndim")}, kind="alias",
          states=("mu", "nu"), counted=True, uses_params=True, eight_bit=True,
          example={"learning_rate": 1e-2, "weight_decay": 0.1}),
    Entry("lion", _mask_kw(ftopt.lion),
          floats={"learning_rate": LR, "b1": BETA, "b2": BETA, "weight_decay": WD},
          options={"mask": ("none", "odd")}, kind="alias", states=("mu",), counted=True,
          uses_params=True, eight_bit=True,
          example={"learning_rate": 1e-3, "b1": 0.9, "weight_decay": 0.1}),
    Entry("ano", ftopt.ano,
          floats={"learning_rate": LR, "b1": BETA, "b2": HP(0.5, 0.999), "eps": EPS,
                  "weight_decay": WD},
          options={"logarithmic_schedule": (False, True)}, kind="alias", states=("mu", "nu"),
          counted=True, uses_params=True, eight_bit=True,
          example={"learning_rate": 1e-3, "weight_decay": 0.01}),
    Entry("mars", _mask_kw(ftopt.mars, "weight_decay_mask"),
          floats={"learning_rate": LR, "b1": HP(0.0, 0.99), "b2": BETA, "eps": EPS,
                  "gamma": HP(0.0, 0.5), "weight_decay": WD},
          options={"clip_threshold": (1.0, None), "weight_decay_mask": ("none", "ndim")},
          kind="alias", states=("last_grad", "mu", "nu"), counted=True, norms="global",
          uses_params=True, eight_bit=True,
          example={"learning_rate": 3e-3, "weight_decay": 0.1}),
    Entry("rmsprop", ftopt.rmsprop,
          floats={"learning_rate": LR, "decay": DECAY, "eps": EPS,
                  "initial_scale": HP(0.0, 1.0, tensor=False)},
          options={"eps_in_sqrt": (True, False)}, kind="alias", states=("nu",),
          keeps_zero=True, eight_bit=True,
          example={"learning_rate": 1e-2, "decay": 0.9}),
    Entry("rmsprop[centered]", lambda **kw: ftopt.rmsprop(**kw, centered=True),
          export="rmsprop",
          floats={"learning_rate": LR, "decay": DECAY, "eps": EPS,
                  "initial_scale": HP(0.0, 1.0, tensor=False)},
          options={"eps_in_sqrt": (False, True)}, kind="alias", states=("mu", "nu"),
          keeps_zero=True, eight_bit=True,
          example={"learning_rate": 1e-2, "decay": 0.9}),
    Entry("rmsprop[momentum]", ftopt.rmsprop, export="rmsprop",
          floats={"learning_rate": LR, "decay": DECAY, "eps": EPS, "momentum": DECAY},
          options={"eps_in_sqrt": (True, False), "nesterov": (False, True)}, kind="alias",
          states=("nu", "trace"), eight_bit=True,
          example={"learning_rate": 1e-2, "decay": 0.9, "momentum": 0.9}),
    Entry("adagrad", ftopt.adagrad,
          floats={"learning_rate": LR, "initial_accumulator_value": HP(0.0, 1.0, tensor=False),
                  "eps": EPS},
          kind="alias", states=("sum_of_squares",), keeps_zero=True, eight_bit=True,
          example={"learning_rate": 1e-2, "eps": 1e-7}),
    Entry("lamb", _mask_kw(ftopt.lamb),
          floats={"learning_rate": LR, **_ADAM_FLOATS, "weight_decay": WD},
          options={"mask": ("none", "ndim")}, kind="alias", states=("mu", "nu"),
          counted=True, norms="leaf", uses_params=True, eight_bit=True,
          example={"learning_rate": 1e-2, "weight_decay": 0.01}),
    Entry("lars", _lars,
          floats={"learning_rate": LR, "weight_decay": WD,
                  "trust_coefficient": HP(1e-4, 1.0, log=True), "eps": HP(0.0, 1e-3),
                  "momentum": DECAY},
          options={"nesterov": (False, True), "weight_decay_mask": ("all", "ndim")},
          kind="alias", states=("trace",), norms="leaf", uses_params=True, eight_bit=True,
          example={"learning_rate": 0.1, "weight_decay": 0.01}),
    Entry("lars[masked]", _lars, export="lars",
          floats={"learning_rate": LR, "weight_decay": WD, "momentum": DECAY},
          options={"trust_ratio_mask": ("ndim", "odd")}, kind="alias", states=("trace",),
          norms="leaf", uses_params=True, eight_bit=True,
          example={"learning_rate": 0.1, "weight_decay": 0.01}),
    Entry("ademamix", _mask_kw(ftopt.ademamix),
          floats={"learning_rate": LR, **_ADAM_FLOATS, "b3": HP(0.0, 0.9999),
                  "alpha": HP(0.0, 10.0), "weight_decay": WD},
          options={"mask": ("none", "ndim")}, kind="alias", states=("m1", "m2", "nu"),
          counted=True, uses_params=True, eight_bit=True,
          example={"learning_rate": 1e-2, "b3": 0.999, "alpha": 5.0, "weight_decay": 0.01}),
]

# ---- more of optax's elementwise optimizers (ftopt.alias_variants)
TRANSFORMS += [
    Entry("adamax", ftopt.adamax, floats={"learning_rate": LR, "b1": BETA, "b2": BETA,
                                          "eps": EPS},
          kind="alias", states=("mu", "nu"), counted=True, eight_bit=True,
          example={"learning_rate": 1e-2}),
    Entry("adamaxw", _mask_kw(ftopt.adamaxw),
          floats={"learning_rate": LR, "b1": BETA, "b2": BETA, "eps": EPS, "weight_decay": WD},
          options={"mask": ("none", "ndim")}, kind="alias", states=("mu", "nu"), counted=True,
          uses_params=True, eight_bit=True,
          example={"learning_rate": 1e-2, "weight_decay": 0.1}),
    Entry("amsgrad", ftopt.amsgrad, floats={"learning_rate": LR, **_ADAM_FLOATS},
          options={"bias_correction_mu": (True, False), "bias_correction_nu": (True, False)},
          kind="alias", states=("mu", "nu", "nu_max"), counted=True, eight_bit=True,
          example={"learning_rate": 1e-2}),
    Entry("nadam", ftopt.nadam, floats={"learning_rate": LR, **_ADAM_FLOATS}, kind="alias",
          states=("mu", "nu"), counted=True, eight_bit=True,
          example={"learning_rate": 1e-2}),
    Entry("nadamw", _mask_kw(ftopt.nadamw),
          floats={"learning_rate": LR, **_ADAM_FLOATS, "weight_decay": WD},
          options={"mask": ("none", "ndim")}, kind="alias", states=("mu", "nu"), counted=True,
          uses_params=True, eight_bit=True,
          example={"learning_rate": 1e-2, "weight_decay": 0.1}),
    Entry("radam", ftopt.radam,
          floats={"learning_rate": LR, **_ADAM_FLOATS, "threshold": HP(4.0, 10.0)},
          options={"nesterov": (False, True)}, kind="alias", states=("mu", "nu"),
          counted=True, eight_bit=True,
          example={"learning_rate": 1e-2, "b2": 0.99}),
    Entry("acprop", _mask_kw(ftopt.acprop),
          floats={"learning_rate": LR, "b1": BETA, "b2": BETA,
                  "eps": HP(1e-8, 1e-3, log=True), "eps_root": HP(0.0, 1e-6),
                  "weight_decay": WD},
          options={"mask": ("none", "ndim")},
          kind="alias", states=("mu", "nu"), counted=True, uses_params=True, eight_bit=True,
          example={"learning_rate": 1e-2, "eps": 1e-8, "weight_decay": 0.01}),
    Entry("adabelief", _mask_kw(ftopt.adabelief, "weight_decay_mask"),
          floats={"learning_rate": LR, "b1": BELIEF_B1, "b2": BETA,
                  "eps": HP(1e-16, 1e-3, log=True), "eps_root": HP(0.0, 1e-6),
                  "weight_decay": WD},
          options={"weight_decay_mask": ("none", "ndim"), "nesterov": (False, True)},
          kind="alias", states=("mu", "nu"), counted=True, uses_params=True, eight_bit=True,
          example={"learning_rate": 1e-2, "weight_decay": 0.01}),
    Entry("yogi", ftopt.yogi, floats={"learning_rate": LR, "b1": BETA, "b2": BETA, "eps": EPS},
          kind="alias", states=("mu", "nu"), counted=True, eight_bit=True,
          example={"learning_rate": 1e-2}),
    Entry("adadelta", _mask_kw(ftopt.adadelta, "weight_decay_mask"),
          floats={"learning_rate": HP(1e-2, 10.0, log=True, schedule=True), "rho": DECAY,
                  "eps": EPS, "weight_decay": WD},
          options={"weight_decay_mask": ("none", "ndim")}, kind="alias",
          states=("e_g", "e_x"), uses_params=True, eight_bit=True,
          example={"learning_rate": 1.0, "weight_decay": 0.01}),
    Entry("sign_sgd", ftopt.sign_sgd, floats={"learning_rate": LR}, kind="alias",
          keeps_zero=True,
          example={"learning_rate": 1e-2}),
    Entry("signum", ftopt.signum, floats={"learning_rate": LR, "beta": DECAY}, kind="alias",
          states=("ema",), counted=True, eight_bit=True,
          example={"learning_rate": 1e-2, "beta": 0.9}),
    Entry("optimistic_gradient_descent", ftopt.optimistic_gradient_descent,
          floats={"learning_rate": LR, "alpha": HP(0.0, 2.0), "beta": HP(0.0, 2.0)},
          kind="alias", states=("previous_gradient",), counted=True, eight_bit=True,
          example={"learning_rate": 1e-2}),
    Entry("optimistic_adam", ftopt.optimistic_adam,
          floats={"learning_rate": HP(1e-4, 1e-1, log=True, schedule=False),
                  "optimism": HP(0.0, 1e-1), "b1": BETA, "b2": BETA, "eps": EPS},
          options={"nesterov": (True, False)}, kind="alias",
          states=("mu", "nu", "previous_gradient"), counted=True, eight_bit=True,
          example={"learning_rate": 1e-2}),
    Entry("optimistic_adam_v2", ftopt.optimistic_adam_v2,
          floats={"learning_rate": LR, "alpha": HP(0.0, 2.0), "beta": HP(0.0, 2.0),
                  "b1": BETA, "b2": BETA, "eps": EPS},
          options={"nesterov": (True, False)}, kind="alias",
          states=("mu", "nu", "previous_gradient"), counted=True, eight_bit=True,
          example={"learning_rate": 1e-2}),
    Entry("adopt", ftopt.adopt, floats={"learning_rate": LR, "b1": BETA, "b2": BETA, "eps": EPS},
          options={"use_clipping": (True, False), "nesterov": (False, True)}, kind="alias",
          states=("mu", "nu"), counted=True, eight_bit=True,
          example={"learning_rate": 1e-2, "b2": 0.999}),
    Entry("simplified_ademamix", _mask_kw(ftopt.simplified_ademamix),
          floats={"learning_rate": LR, **_ADAM_FLOATS, "alpha": HP(0.0, 10.0),
                  "weight_decay": WD},
          options={"mask": ("none", "ndim")}, kind="alias", states=("m", "n"), counted=True,
          uses_params=True, eight_bit=True,
          example={"learning_rate": 1e-3, "b1": 0.9, "alpha": 2.0, "weight_decay": 0.01}),
]

# ---- optax's everyday utilities (ftopt.transforms.utility)
TRANSFORMS += [
    Entry("scale_by_schedule", _sched_scale,
          floats={"step_size": HP(-2.0, 2.0, tensor=False)},
          options={"schedule": ("linear", "cosine", "join")}, counted=True, keeps_zero=True,
          example={"step_size": 0.5}),
    Entry("normalize_by_update_norm", ftopt.normalize_by_update_norm,
          floats={"scale_factor": HP(0.1, 2.0), "eps": EPS}, norms="global", keeps_zero=True,
          example={"scale_factor": 1.0}),
    Entry("normalize", ftopt.normalize, norms="global", keeps_zero=True),
    Entry("apply_every", ftopt.apply_every, options={"k": (2, 1, 3)}, states=("grad_acc",),
          counted=True, eight_bit=True),
    Entry("freeze", _mask_kw(ftopt.freeze), options={"mask": ("ndim", "odd")},
          keeps_zero=True),
    Entry("zero_nans", ftopt.zero_nans, keeps_zero=True),
    Entry("clip", ftopt.clip, floats={"max_delta": HP(1e-3, 10.0, log=True)}, keeps_zero=True,
          example={"max_delta": 0.5}),
    Entry("keep_params_nonnegative", ftopt.keep_params_nonnegative, uses_params=True),
    # A matrix stage (whole-leaf means): the elementwise stages around it fuse.
    Entry("centralize", ftopt.centralize, norms="row"),  # (a mean of each row)
    # Matrix stages that pass the updates on and keep measurements of them in the state
    # (ftopt.monitoring): the elementwise stages around them fuse.
    Entry("snapshot", lambda measure="norm": ftopt.snapshot("measured", _MEASURES[measure]),
          options={"measure": tuple(_MEASURES)}, keeps_zero=True, bookkeeping=True),
    Entry("monitor",
          lambda decay=0.9, debias=True: ftopt.monitor({
              "norm": ftopt.tree.norm,
              "large": ftopt.measure_with_ema(lambda u: ftopt.tree.max(u) > 0.5, decay,
                                              debias)}),
          floats={"decay": DECAY}, options={"debias": (True, False)}, counted=True,
          keeps_zero=True, bookkeeping=True, example={"decay": 0.9}),
    # Wrappers (ftopt.wrappers): eager bookkeeping around an inner transform.
    Entry("MultiSteps",
          lambda inner=(), every_k_schedule=2, use_grad_mean=True: ftopt.MultiSteps(
              inner[0], every_k_schedule, use_grad_mean).gradient_transformation(),
          options={"every_k_schedule": (2, 1, 3), "use_grad_mean": (True, False)},
          kind="combinator", fusible=False, inner=("scale_by_adam",), bookkeeping=True,
          calls_per_step=2),
    Entry("inject_hyperparams",
          lambda inner=(), learning_rate=1e-2, b1=0.9: ftopt.inject_hyperparams(ftopt.adam)(
              learning_rate=learning_rate, b1=b1),
          floats={"learning_rate": HP(1e-4, 1e-1, log=True, tensor=False), "b1": BETA},
          kind="combinator", fusible=False, states=("mu", "nu"), bookkeeping=True,
          example={"learning_rate": 1e-2, "b1": 0.9}),
    # A stateful schedule's state beside the hyperparameters (ftopt.inject)
    Entry("inject_stateful_hyperparams",
          lambda inner=(), learning_rate=1e-2, b1=0.9: ftopt.inject_stateful_hyperparams(
              ftopt.adam)(learning_rate=ftopt.WrappedSchedule(ftopt.linear_schedule(
                  learning_rate, learning_rate / 2, 10)), b1=b1),
          floats={"learning_rate": HP(1e-4, 1e-1, log=True, tensor=False), "b1": BETA},
          kind="combinator", fusible=False, states=("mu", "nu"), bookkeeping=True,
          example={"learning_rate": 1e-2, "b1": 0.9}),
]

# ---- more of optax's catalogue (ftopt.alias_more)
TRANSFORMS += [
    Entry("scale_by_adan", ftopt.scale_by_adan,
          floats={"b1": BETA, "b2": BETA, "b3": BETA, "eps": EPS, "eps_root": EPS_ROOT},
          states=("m", "v", "n", "g"), counted=True, eight_bit=True,
          example={"b1": 0.9, "b2": 0.9, "b3": 0.99, "eps": 1e-8}),
    Entry("adan", _mask_kw(ftopt.adan),
          floats={"learning_rate": LR, "b1": BETA, "b2": BETA, "b3": BETA, "eps": EPS,
                  "eps_root": EPS_ROOT, "weight_decay": WD},
          options={"mask": ("none", "ndim")}, kind="alias", states=("m", "v", "n", "g"),
          counted=True, uses_params=True, eight_bit=True,
          example={"learning_rate": 1e-2, "weight_decay": 0.01}),
    # MADGRAD's update moves the params itself (the learning rate is inside it). Its x0
    # (a copy of the params) stays fp32 under state_bits=8 and state_dtype (wide).
    Entry("scale_by_madgrad", ftopt.scale_by_madgrad,
          floats={"learning_rate": LR, "momentum": BETA, "eps": EPS},
          states=("grad_sum_sq", "s", "x0"), counted=True, uses_params=True,
          eight_bit=True, wide_states=("x0",),
          example={"learning_rate": 1e-2, "momentum": 0.9, "eps": 1e-6}),
    Entry("scale_by_cocob", ftopt.scale_by_cocob,
          floats={"alpha": HP(1.0, 200.0, log=True), "eps": HP(1e-6, 1e-2, log=True,
                                                              tensor=False)},
          states=("init_particles", "cumulative_gradients", "scale", "subgradients",
                  "reward"), uses_params=True, eight_bit=True, wide_states=("init_particles",),
          example={"alpha": 100.0, "eps": 1e-3}),
    Entry("cocob", _mask_kw(ftopt.cocob),
          floats={"learning_rate": HP(0.1, 1.0, tensor=False), "alpha": HP(1.0, 200.0, log=True),
                  "eps": HP(1e-6, 1e-2, log=True, tensor=False), "weight_decay": WD},
          options={"mask": ("none", "ndim")}, kind="alias",
          states=("init_particles", "cumulative_gradients", "scale", "subgradients",
                  "reward"), uses_params=True, eight_bit=True, wide_states=("init_particles",),
          example={"learning_rate": 1.0, "eps": 1e-3}),
    Entry("madgrad", ftopt.madgrad,
          floats={"learning_rate": LR, "momentum": BETA, "weight_decay": WD, "eps": EPS},
          kind="alias", states=("grad_sum_sq", "s", "x0"), counted=True, uses_params=True,
          eight_bit=True, wide_states=("x0",),
          example={"learning_rate": 1e-2, "weight_decay": 0.01}),
    Entry("scale_by_rprop", ftopt.scale_by_rprop,
          floats={"learning_rate": HP(1e-4, 1e-1, log=True, tensor=False),
                  "eta_minus": HP(0.1, 0.9), "eta_plus": HP(1.0, 2.0),
                  "min_step_size": HP(0.0, 1e-5), "max_step_size": HP(1e-2, 50.0, log=True)},
          states=("step_sizes", "prev_updates"), eight_bit=True,
          example={"learning_rate": 1e-2}),
    Entry("rprop", ftopt.rprop,
          floats={"learning_rate": HP(1e-4, 1e-1, log=True, tensor=False),
                  "eta_minus": HP(0.1, 0.9), "eta_plus": HP(1.0, 2.0),
                  "min_step_size": HP(0.0, 1e-5), "max_step_size": HP(1e-2, 50.0, log=True)},
          kind="alias", states=("step_sizes", "prev_updates"), eight_bit=True,
          example={"learning_rate": 1e-2}),
]

# ---- Schedule-Free (ftopt.schedule_free): chain(base, stage), the stage an elementwise
# rule whose averaging weights are running 0-d scalars of its state (bookkeeping); z, a copy
# of the params, stays in their dtype under state_bits=8 (wide), and under quantize_states'
# state_dtype; the aliases' own state_dtype keyword stores it as asked (as optax).
_SF_FLOATS = {"learning_rate": LR, "b1": HP(0.1, 1.0, tensor=False),
              "weight_lr_power": HP(0.0, 3.0)}
TRANSFORMS += [
    Entry("schedule_free_sgd", ftopt.schedule_free_sgd,
          floats={**_SF_FLOATS, "weight_decay": WD}, kind="alias", states=("z",),
          counted=True, uses_params=True, bookkeeping=True, wide_states=("z",),
          wide_follow_state_dtype=True,
          example={"learning_rate": 0.1, "weight_decay": 0.01}),
    Entry("schedule_free_adamw", ftopt.schedule_free_adamw,
          floats={**_SF_FLOATS, "b2": BETA, "eps": EPS, "weight_decay": WD}, kind="alias",
          states=("mu", "nu", "z"), counted=True, uses_params=True, eight_bit=True,
          wide_states=("z",), wide_follow_state_dtype=True, bookkeeping=True,
          example={"learning_rate": 1e-2, "weight_decay": 0.01}),
    Entry("schedule_free",
          lambda inner=(), b1=0.9: ftopt.schedule_free(
              ftopt.chain(inner[0], ftopt.scale_by_learning_rate(0.01)), 0.01, b1),
          options={"b1": (0.9, 0.5)}, kind="combinator", states=("z",), counted=True,
          uses_params=True, wide_states=("z",), bookkeeping=True, inner=("scale_by_rms",)),
]

# ---- per-leaf norm optimizers (ftopt.alias_norms): NovoGrad's per-leaf second moment is
# a stage with torch ops before its fused momentum rule; Fromage is a trust ratio and a rule
TRANSFORMS += [
    Entry("scale_by_novograd", ftopt.scale_by_novograd,
          floats={"b1": BETA, "b2": BETA, "eps": EPS, "eps_root": EPS_ROOT,
                  "weight_decay": WD},
          states=("mu",), counted=True, norms="leaf", uses_params=True, eight_bit=True,
          example={"b1": 0.9, "b2": 0.25, "eps": 1e-6, "weight_decay": 0.01}),
    Entry("novograd", ftopt.novograd,
          floats={"learning_rate": LR, "b1": BETA, "b2": BETA, "eps": EPS,
                  "eps_root": EPS_ROOT, "weight_decay": WD},
          kind="alias", states=("mu",), counted=True, norms="leaf", uses_params=True,
          eight_bit=True, example={"learning_rate": 1e-2, "weight_decay": 0.01}),
    Entry("fromage", ftopt.fromage,
          floats={"learning_rate": LR, "min_norm": HP(0.0, 1e-3)},
          kind="alias", norms="leaf", uses_params=True,
          example={"learning_rate": 1e-2}),
]

# ---- Prodigy (ftopt.alias_prodigy): one rule (its global dot product and L1 norm are
# global sums of the fused reduction pass, d and its numerator running scalars the main
# kernel stores). Under state_bits=8 / state_dtype its m, v and s are stored as asked and
# params0, a copy of the params, stays in their dtype (wide, as MADGRAD's x0).
TRANSFORMS += [
    # Distance over gradients: a copy of the initial params, global norms, running scalars.
    Entry("scale_by_dog", ftopt.scale_by_dog, floats={"eps": HP(1e-8, 1e-4, log=True)},
          options={"init_step": (("distance", 1e-2), ("heuristic", 1e-6),
                                 ("learning_rate", 1e-3))},
          states=("init_params",), counted=True, norms="global", uses_params=True,
          keeps_zero=True, wide_states=("init_params",), bookkeeping=True,
          running_scale=True),
    Entry("dog", ftopt.dog,
          floats={"learning_rate": HP(0.1, 1.0, schedule=True),
                  "eps": HP(1e-8, 1e-4, log=True), "weight_decay": WD},
          options={"init_step": (("distance", 1e-2), ("heuristic", 1e-6),
                                 ("learning_rate", 1e-3))},
          kind="alias", states=("init_params",), counted=True, norms="global",
          uses_params=True, wide_states=("init_params",), bookkeeping=True,
          running_scale=True, example={"learning_rate": 1.0}),
    Entry("scale_by_dowg", ftopt.scale_by_dowg,
          floats={"init_estim_sq_dist": HP(1e-6, 1e-2, log=True),
                  "eps": HP(1e-6, 1e-3, log=True)},
          states=("init_params",), norms="global", uses_params=True, keeps_zero=True,
          wide_states=("init_params",), bookkeeping=True, running_scale=True,
          example={"init_estim_sq_dist": 1e-2}),
    Entry("scale_by_distance_over_gradients", ftopt.scale_by_distance_over_gradients,
          floats={"reps_rel": HP(1e-6, 1e-2, log=True), "eps": HP(1e-8, 1e-4, log=True),
                  "global_scale": HP(0.5, 1.0)},
          states=("init_params",), norms="leaf", uses_params=True, keeps_zero=True,
          wide_states=("init_params",), example={"reps_rel": 1e-3}),
    Entry("dowg", ftopt.dowg,
          floats={"learning_rate": HP(0.1, 1.0, schedule=True),
                  "eps": HP(1e-6, 1e-3, log=True), "weight_decay": WD},
          kind="alias", states=("init_params",), norms="global", uses_params=True,
          wide_states=("init_params",), bookkeeping=True, running_scale=True,
          example={"learning_rate": 1.0}),
    Entry("dadapt_adamw", ftopt.dadapt_adamw,
          floats={"learning_rate": HP(0.1, 1.0, schedule=True), "eps": EPS,
                  "estim_lr0": HP(1e-6, 1e-2, log=True, tensor=False), "weight_decay": WD},
          options={"betas": ((0.9, 0.999), (0.8, 0.99))},
          kind="alias", states=("exp_avg", "exp_avg_sq", "grad_sum"), counted=True,
          norms="global", uses_params=True, eight_bit=True, bookkeeping=True,
          running_scale=True, example={"learning_rate": 1.0, "estim_lr0": 1e-3}),
    Entry("prodigy", ftopt.prodigy,
          floats={"learning_rate": HP(0.1, 1.0, schedule=True), "eps": EPS,
                  "estim_lr0": HP(1e-6, 1e-2, log=True, tensor=False),
                  "estim_lr_coef": HP(0.5, 1.0), "weight_decay": WD},
          options={"betas": ((0.9, 0.999), (0.8, 0.99)), "safeguard_warmup": (False, True)},
          kind="alias", states=("exp_avg", "exp_avg_sq", "grad_sum", "params0"),
          counted=True, norms="global", uses_params=True, eight_bit=True,
          wide_states=("params0",), bookkeeping=True, running_scale=True,
          example={"learning_rate": 1.0, "estim_lr0": 1e-3}),
]

# ---- matrix-stage optimizers and their parts (ftopt.transforms.factored, .muon)
TRANSFORMS += [
    # A stateful matrix stage: its row/column means are not per-element states. The
    # suites' default does not factor their small leaves (a transposed (4, 5) leaf has the
    # row and column means of a (5, 4) one, so only ``v`` can tell them apart); the fuzz
    # and tests/test_matrix_optimizers.py factor.
    Entry("scale_by_factored_rms", ftopt.scale_by_factored_rms,
          floats={"decay_rate": HP(0.0, 1.0, tensor=False),
                  "epsilon": HP(1e-30, 1e-6, log=True, tensor=False)},
          options={"min_dim_size_to_factor": (128, 2), "factored": (True, False)},
          states=("v",), counted=True, keeps_zero=True,
          mixes=True,
          example={"decay_rate": 0.8}),
    # SM3's accumulators: one vector per dim of a leaf (min over the covers, max back).
    Entry("scale_by_sm3", ftopt.scale_by_sm3,
          floats={"b1": BETA, "b2": HP(0.5, 1.0), "eps": EPS},
          states=("nu",), mixes=True, example={"b1": 0.9, "b2": 1.0}),
    Entry("sm3", ftopt.sm3, floats={"learning_rate": LR, "momentum": BETA},
          kind="alias", states=("nu",), mixes=True,
          example={"learning_rate": 1e-2, "momentum": 0.9}),
    Entry("clip_by_block_rms", ftopt.clip_by_block_rms,
          floats={"threshold": HP(0.1, 10.0, log=True)}, norms="leaf", keeps_zero=True,
          example={"threshold": 1.0}),
    Entry("scale_by_param_block_rms", ftopt.scale_by_param_block_rms,
          floats={"min_scale": HP(0.0, 0.1)}, norms="leaf", uses_params=True,
          keeps_zero=True, example={"min_scale": 1e-3}),
    Entry("scale_by_param_block_norm", ftopt.scale_by_param_block_norm,
          floats={"min_scale": HP(0.0, 0.1)}, norms="leaf", uses_params=True,
          keeps_zero=True, example={"min_scale": 1e-3}),
    Entry("scale_by_shape", ftopt.scale_by_shape, options={"consistent_rms": (None, 0.2)},
          keeps_zero=True),
    # Newton-Schulz in fp32 here, so that fused and eager agree to fp32 rounding on a GPU
    # too (bf16 iterations would amplify the last-bit differences of the momentum).
    Entry("scale_by_muon", ftopt.scale_by_muon, floats={"beta": BETA, "eps": EPS},
          options={"ns_dtype": (torch.float32,), "nesterov": (True, False),
                   "adaptive": (False, True), "ns_steps": (5, 2)},
          states=("mu",), counted=True, eight_bit=True,
          mixes=True,
          example={"beta": 0.95}),
    # NorMuon: Muon's stages, then a stateful matrix stage (one second moment a row)
    Entry("scale_by_normuon", ftopt.scale_by_normuon,
          floats={"beta": BETA, "eps": EPS, "beta2": HP(0.0, 0.99, tensor=False),
                  "normuon_scale": HP(0.05, 1.0, tensor=False)},
          options={"ns_dtype": (torch.float32,), "nesterov": (True, False),
                   "ns_coeffs": (ftopt.transforms.muon.DEFAULT_NS_COEFFS, "dion")},
          states=("mu",), counted=True, eight_bit=True, mixes=True,
          example={"beta": 0.95, "beta2": 0.95}),
    # SOAP: Adam in the eigenbasis of Shampoo's factors (a stateful matrix stage; its
    # moments are rotated, so no element of them is a param's: tests/test_soap.py)
    Entry("scale_by_soap", ftopt.scale_by_soap,
          floats={"b1": HP(0.0, 0.99, tensor=False), "b2": HP(0.5, 0.99, tensor=False),
                  "eps": HP(1e-8, 1e-3, log=True, tensor=False)},
          options={"precondition_frequency": (10, 1, 3), "max_precond_dim": (10000, 4),
                   "precondition_1d": (False, True)},
          states=("exp_avg", "exp_avg_sq"), counted=True, mixes=True,
          example={"b1": 0.9, "b2": 0.95}),
    Entry("soap", _mask_kw(ftopt.soap),
          floats={"learning_rate": LR, "b1": HP(0.0, 0.99, tensor=False),
                  "b2": HP(0.5, 0.99, tensor=False), "weight_decay": WD},
          options={"precondition_frequency": (10, 2), "mask": ("none", "ndim")},
          kind="alias", states=("exp_avg", "exp_avg_sq"), counted=True, uses_params=True,
          mixes=True, example={"learning_rate": 1e-2, "weight_decay": 0.01}),
    Entry("adafactor", _mask_kw(ftopt.adafactor, "weight_decay_mask"),
          floats={"learning_rate": LR, "decay_rate": HP(0.0, 1.0, tensor=False),
                  "weight_decay_rate": WD},
          options={"min_dim_size_to_factor": (128, 2), "momentum": (None, 0.9),
                   "multiply_by_parameter_scale": (True, False),
                   "clipping_threshold": (1.0, None),
                   "weight_decay_mask": ("none", "ndim")},
          kind="alias", states=("v",), counted=True, norms="leaf", uses_params=True,
          mixes=True,
          example={"learning_rate": 1e-2, "weight_decay_rate": 0.01}),
    # optax's routing: a partition (2-D leaves Muon, others AdamW), fused in segments.
    Entry("muon", _mask_kw(ftopt.muon, "weight_decay_mask"), **_MUON_FIELDS),
    # Muon over every leaf of rank >= 2, its leading axes batch axes (a stack of matrices
    # each orthogonalised on its own), the others AdamW (optax's dimension numbers)
    Entry("muon[dims]", _mask_kw(_muon_last_two, "weight_decay_mask"), export="muon",
          **_MUON_FIELDS),
    Entry("normuon", _mask_kw(ftopt.normuon, "weight_decay_mask"), **_NORMUON_FIELDS),
    Entry("normuon[dims]", _mask_kw(_normuon_last_two, "weight_decay_mask"), export="normuon",
          **_NORMUON_FIELDS),
    # GaLore: the base optimizer (scale_by_adam) runs on low-rank projections of the 2-D
    # leaves; its states have the projected shapes (tests/test_galore.py).
    Entry("scale_by_galore", ftopt.scale_by_galore, floats={"scale": HP(0.1, 2.0)},
          options={"rank": (2, 128), "update_proj_gap": (1, 200)}, states=("mu", "nu"),
          counted=True, fusible=False, mixes=True, example={"rank": 2}),
    Entry("galore", ftopt.galore, floats={"learning_rate": LR, "weight_decay": WD},
          options={"rank": (2, 128), "update_proj_gap": (1, 200)}, kind="alias",
          states=("mu", "nu"), counted=True, uses_params=True, fusible=False, mixes=True,
          example={"learning_rate": 1e-2, "rank": 2}),
]

# ---- gradient noise (ftopt.transforms.noise, ftopt.alias_noise)
NOISE = {"eta": HP(0.0, 0.1), "gamma": HP(0.0, 1.0)}
TRANSFORMS += [
    Entry("add_noise", ftopt.add_noise, floats=NOISE, options={"seed": (0, 2**32 - 1)},
          counted=True, positional=True, example={"eta": 0.01}),
    Entry("noisy_sgd", ftopt.noisy_sgd, floats={"learning_rate": LR, **NOISE},
          options={"seed": (0, 123456)}, kind="alias", counted=True, positional=True,
          example={"learning_rate": 1e-2}),
]

# The 8-bit map of each state (SPEC §5): signed for states that can be negative, unsigned
# for the others. ``tests/test_registry.py`` checks that every state an entry stores in 8
# bits is in one of the two.
SIGNED_STATES: frozenset[str] = frozenset({
    "mu", "trace", "m1", "m2", "m", "ema", "previous_gradient", "v", "g", "s", "x0",
    "prev_updates", "z", "exp_avg", "grad_sum", "params0", "grad_acc", "init_particles",
    "last_grad",
    "cumulative_gradients"})
UNSIGNED_STATES: frozenset[str] = frozenset({
    "nu", "sum_of_squares", "nu_max", "n", "e_g", "e_x", "grad_sum_sq", "step_sizes",
    "exp_avg_sq", "scale", "subgradients", "reward"})

# State fields that hold no element of a param's own, as (state class, field): NorMuon's
# row moments (one value a row), SOAP's moments (in a rotated basis) and its factors. They
# are not per-element slots: 8-bit and 16-bit storage leave them in the compute dtype,
# skip_zeros lets them advance (SPEC §3), and as they are computed from a matrix stage's
# output, fused and eager agree within its rounding rather than bit for bit.
LEAF_STATES: frozenset[tuple[str, str]] = frozenset({
    ("NorMuonState", "row_nu"), ("SoapState", "exp_avg"), ("SoapState", "exp_avg_sq"),
    ("SoapState", "gg"), ("SoapState", "q")})


def leaf_state(node: Any, field: str) -> bool:
    """Whether ``field`` of the state ``node`` is one of :data:`LEAF_STATES`."""
    return (type(node).__name__, field) in LEAF_STATES

# Entries that do not run under ``torch.func.vmap`` (an ensemble of models in one call),
# and why; every other entry's vmapped step equals a loop over the members
# (tests/test_func_catalogue.py, which also checks that these still fail).
_NONE_IN_STATE = "its state holds None for the leaves a branch leaves out"
_HOST_COUNT = "it reads its step count on the host to choose a branch"
_LIVE = "it copies the state's hyperparameters into the inner transform's tensors"
NOT_UNDER_VMAP: dict[str, str] = {
    "masked": _NONE_IN_STATE, "partition": _NONE_IN_STATE,
    "multi_transform": _NONE_IN_STATE, "muon": _NONE_IN_STATE,
    "muon[dims]": _NONE_IN_STATE, "normuon": _NONE_IN_STATE,
    "normuon[dims]": _NONE_IN_STATE, "MultiSteps": _HOST_COUNT,
    "scale_by_soap": _HOST_COUNT, "soap": _HOST_COUNT, "scale_by_galore": _HOST_COUNT,
    "galore": _HOST_COUNT, "inject_hyperparams": _LIVE,
    "inject_stateful_hyperparams": _LIVE,
}

# Entries whose update is not differentiated through by the registry suite
# (tests/test_func_catalogue.py), and why.
NOT_DIFFERENTIATED: dict[str, str] = {
    "scale_by_soap": "eigh's derivative is infinite where a factor has repeated "
                     "eigenvalues, as the rank-deficient factors of the first steps do",
    "soap": "as scale_by_soap",
}

BY_NAME: dict[str, Entry] = {e.name: e for e in TRANSFORMS}
assert len(BY_NAME) == len(TRANSFORMS), "registry names must be unique"

# Transforms no registry suite can drive, each with the test file that covers its
# contract instead: params that are not the gradients' tree (lookahead: a
# LookaheadParams pair of fast and slow weights, the gradients those of the fast ones),
# or an update that needs more than the gradients (reduce_on_plateau, the Polyak step:
# the loss, as ``value=``; sam's opaque mode: ``grad_fn=``), or a wrapper whose params move
# where the gradient is zero (sam's return to its cache, mechanize's learned scale).
PARAMS_WRAPPERS: dict[str, str] = {"lookahead": "tests/test_lookahead.py",
                                   "reduce_on_plateau": "tests/test_plateau.py",
                                   "scale_by_polyak": "tests/test_polyak.py",
                                   "polyak_sgd": "tests/test_polyak.py",
                                   "momo": "tests/test_momo.py",
                                   "momo_adam": "tests/test_momo.py",
                                   "differentially_private_aggregate":
                                       "tests/test_privacy.py",
                                   "dpsgd": "tests/test_privacy.py",
                                   "split_real_and_imaginary":
                                       "tests/test_complex_valued.py",
                                   # L-BFGS refuses skip_zeros (its state and direction mix
                                   # all elements) and the line searches read value_fn=.
                                   "scale_by_lbfgs": "tests/test_lbfgs.py",
                                   "lbfgs": "tests/test_lbfgs.py",
                                   "scale_by_backtracking_linesearch":
                                       "tests/test_linesearch.py",
                                   "scale_by_zoom_linesearch": "tests/test_linesearch.py",
                                   "sam": "tests/test_sam.py",
                                   "mechanize": "tests/test_mechanize.py",
                                   "sophia": "tests/test_sophia.py",
                                   "scale_by_sophia": "tests/test_sophia.py",
                                   "hutchinson_estimator_diag_hessian": "tests/test_sophia.py",
                                   # (its update gives a measurement, not updates)
                                   "measure_with_ema": "tests/test_monitoring.py",
                                   # (its inner state is over one flat vector)
                                   "flatten": "tests/test_layouts.py"}

# Exported names that build no GradientTransformation (or only a wrapped one's schedule).
NOT_TRANSFORMS: frozenset[str] = frozenset({
    "ApplyIfFiniteState", "InjectHyperparamsState", "LookaheadParams", "LookaheadState",
    "InjectStatefulHyperparamsState", "StatefulSchedule", "WrappedSchedule", "CautiousState",
    "MuonDimensionNumbers", "GradientTransformationExtraArgs", "OptState", "Params", "ArrayTree",
    "ScalarOrSchedule", "Schedule",
    "TransformInitFn", "TransformUpdateExtraArgsFn", "TransformUpdateFn", "Updates",
    "AdaptiveGradClipState", "AddDecayedWeightsState", "ApplyEvery", "ClipByGlobalNormState",
    "ClipState", "MultiTransformState", "NonNegativeParamsState", "ScaleByTrustRatioState",
    "ScaleState", "NormalizeState", "MaskOrFn", "ShouldSkipUpdateFunction", "MarsCorrectionState",
    "WeightDecaySchedule", "NorMuonState", "SoapState",
    "WrappedScheduleState",
    "MultiStepsState", "EmptyState",
    "GradientTransformation", "MaskedState",
    "PartitionState",
    "ScaleByAdamState", "ScaleByAdemamixState", "ScaleByLionState", "ScaleByRmsState",
    "ScaleByRssState", "ScaleByScheduleState", "TraceState",
    "ScaleByAmsgradState", "ScaleByBeliefState", "ScaleByAdaDeltaState",
    "ScaleBySimplifiedAdEMAMixState", "EmaState", "ScaleByOptimisticGradientState",
    "ScaleByAdanState", "MadgradState", "ScaleByRpropState",
    "ScheduleFreeState", "schedule_free_eval_params", "ProdigyState",
    "LeafSecondMomentState", "NovogradMomentumState",
    "apply_updates", "step", "explain", "schedules", "tree", "projections", "microbatching",
    "microbatch", "perturbations", "assignment", "contrib", "experimental",
    "tree_utils", "losses", "convex_kl_divergence", "cosine_distance", "cosine_similarity",
    "ctc_loss", "ctc_loss_with_forward_probs", "generalized_kl_divergence", "hinge_loss",
    "huber_loss", "kl_divergence", "l2_loss", "log_cosh", "ntxent",
    "safe_softmax_cross_entropy", "sigmoid_binary_cross_entropy", "sigmoid_focal_loss",
    "smooth_labels", "softmax_cross_entropy", "softmax_cross_entropy_with_integer_labels",
    "squared_error", "tree_map_params",
    "bias_correction", "update_moment", "update_infinity_moment", "update_moment_per_elem_norm",
    "Optimizer", "from_torch_state_dict", "to_torch_state_dict", "state_dict",
    "from_bnb_state_dict", "to_bnb_state_dict",
    "load_state_dict",
    "ademamix_alpha_warmup", "ademamix_b3_warmup", "constant_schedule",
    "cosine_decay_schedule", "exponential_decay", "join_schedules", "linear_schedule",
    "piecewise_constant_schedule", "polynomial_schedule", "warmup_constant_schedule",
    "warmup_cosine_decay_schedule", "warmup_exponential_decay_schedule",
    "piecewise_interpolate_schedule", "linear_onecycle_schedule", "cosine_onecycle_schedule",
    "sgdr_schedule",
    "ApplyEveryState", "COCOBState", "ReduceLROnPlateauState", "ScaleByRStdDevState",
    "ScaleByRStdDevWithCountState", "ScaleBySM3State", "DoGState", "DoWGState",
    "ScaleByDistanceOverGradientsState",
    "MomoState", "MomoAdamState", "DAdaptAdamWState",
    "DifferentiallyPrivateAggregateState", "per_example_global_norm_clip",
    "per_example_layer_norm_clip",
    "SplitRealAndImaginaryArrays", "SplitRealAndImaginaryState",
    "abs_sq", "safe_norm", "safe_root_mean_squares", "safe_increment", "safe_int32_increment",
    "init_empty_state", "scale_gradient",
    "ConditionallyTransformState", "ConditionallyMaskState",
    "skip_not_finite", "skip_large_updates",
    "global_norm", "incremental_update", "periodic_update",
    "FactoredState", "MuonMomentumState",
    "AddNoiseState",
    "ScaleByLBFGSState", "ScaleByBacktrackingLinesearchState", "BacktrackingLinesearchInfo",
    "ScaleByZoomLinesearchState", "ZoomLinesearchInfo", "value_and_grad_from_state",
    "SAMState", "MechanicState",
    "SophiaState", "HutchinsonState", "GaLoreState", "GaLoreDimensionNumbers",
    "power_iteration", "matrix_inverse_pth_root", "nnls", "multi_normal",
    "SnapshotState", "MonitorState", "unitwise_norm", "unitwise_clip",
})


def by_trait(**traits: Any) -> list[Entry]:
    """Entries whose traits equal the given values, e.g. ``by_trait(kind="alias",
    fusible=True)``; ``states=True`` selects entries with at least one state slot."""
    def ok(e: Entry) -> bool:
        for k, v in traits.items():
            got = getattr(e, k)
            if v is True and k == "states":
                if not got:
                    return False
            elif got != v:
                return False
        return True
    return [e for e in TRANSFORMS if ok(e)]


def entry(name: str) -> Entry:
    return BY_NAME[name]


STANDALONE_LR = 1e-2


def standalone(e: Entry | str, *, skip_zeros: bool = False, state_bits: int = 32,
               state_dtype: torch.dtype | None = None,
               **overrides: Any) -> GradientTransformation:
    """``e`` as a whole optimizer, with :meth:`Entry.defaults` updated by ``overrides``.

    An alias is built as it is (``skip_zeros=`` and ``state_bits=`` are its keywords);
    anything else is ``chain(e, scale_by_learning_rate(STANDALONE_LR))`` so that params
    move (a combinator wraps its ``inner`` entries, built from their defaults), followed
    by the ``skip_zeros()`` marker when asked and wrapped in ``quantize_states(bits=8)``
    (min_size 4096, as the aliases' ``state_bits=8``) for 8-bit states; ``state_dtype``
    (bf16/fp16 storage of the float states) is an alias's keyword or passed to
    ``quantize_states``.
    """
    e = BY_NAME[e] if isinstance(e, str) else e
    hp = {**e.defaults(), **overrides}
    if e.kind == "alias":
        if state_dtype is not None:
            hp["state_dtype"] = state_dtype
        return e.make(**hp, skip_zeros=skip_zeros, state_bits=state_bits)
    if e.kind == "combinator" and "inner" not in hp:
        hp["inner"] = [BY_NAME[n].make(**BY_NAME[n].defaults()) for n in e.inner]
    parts = [e.make(**hp), ftopt.scale_by_learning_rate(STANDALONE_LR)]
    if skip_zeros:
        parts.append(ftopt.skip_zeros())
    tx = ftopt.chain(*parts)
    if state_bits == 32 and state_dtype is None:
        return tx
    return ftopt.quantize_states(tx, bits=state_bits, state_dtype=state_dtype)


def names(entries: Sequence[Entry]) -> list[str]:
    return [e.name for e in entries]


def fusible() -> list[Entry]:
    """Entries whose standalone optimizer fuses (combinators: with fusible inner ones)."""
    return [e for e in TRANSFORMS if e.fusible and all(BY_NAME[n].fusible for n in e.inner)]


def eight_bit() -> list[Entry]:
    """Entries with per-element float states that ``quantize_states`` stores in 8 bits."""
    return by_trait(eight_bit=True)


def stateful() -> list[Entry]:
    """Entries whose standalone optimizer keeps per-element state."""
    return [e for e in TRANSFORMS if e.stateful]


def norms() -> list[Entry]:
    """Entries that read a reduction of the update (per row, per leaf or global)."""
    return [e for e in TRANSFORMS if e.norms]


def require(table: dict, name: str, what: str, where: str) -> Any:
    """``table[name]``, or a failure (not a skip) saying what to add where: for suites that
    need per-entry data the registry does not hold (a reference formula, a measured bound)."""
    if name not in table:
        import pytest

        pytest.fail(f"registry entry {name!r} has no {what}: add one keyed {name!r} to "
                    f"{where}", pytrace=False)
    return table[name]
