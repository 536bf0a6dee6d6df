"""The fuzzed contract: random chains, hyperparameters and pytrees, fused against eager.

Hypothesis draws a structure from ``tests/registry.py`` (1-5 fusible transforms in any
order, an alias alone or after a wrapper, or a chain through an eager-only combinator;
skip_zeros off or on in each way it can be asked for; 32-bit or 8-bit states; float or
0-d tensor or scheduled hyperparameters), a nested pytree (0-d, empty and odd-sized
leaves; fp32/fp16/bf16; ``None`` gradients; zero rows, scattered zeros, all-zero leaves,
-0.0) and 2-3 steps, then checks one property per test (see ``tests/fuzz_checks.py``).
Fused kernels run in Triton's interpreter on a CPU, so the examples are small and few;
``benchmarks/fuzz.py`` runs the same checks by the ten thousand on a GPU.

Environment: ``FTOPT_FUZZ_EXAMPLES`` (examples per test, default: each test's own),
``FTOPT_FUZZ_SEED`` (a seed instead of the default derandomized run),
``FTOPT_FUZZ_SHRINK=1`` (shrink a failing example: slow under the interpreter).
Gradients are finite: non-finite gradients with 8-bit states are covered elsewhere.
"""

from __future__ import annotations

import os

import fuzz_checks as checks
import optree
import pytest
import torch
from fuzz_cases import DTYPES, HypothesisSource, draw_case, draw_structure
from fuzz_pins import pinned
from fuzz_pins import runner as fuzz_runner
from hypothesis import HealthCheck, Phase, given, note, seed, settings
from hypothesis import strategies as st

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_SEED = os.environ.get("FTOPT_FUZZ_SEED")
# Shrinking re-runs interpreted kernels hundreds of times (minutes): opt in with
# FTOPT_FUZZ_SHRINK=1. A failure prints its drawn case (structure, hparams, leaves, seed).
_PHASES = tuple(p for p in Phase if p != Phase.shrink or os.environ.get("FTOPT_FUZZ_SHRINK"))


def fuzz(default_examples: int):
    """Hypothesis settings of one fuzz test (examples and seed from the environment)."""
    n = int(os.environ.get("FTOPT_FUZZ_EXAMPLES", default_examples))

    def wrap(fn):
        fn = settings(max_examples=n, deadline=None, derandomize=_SEED is None,
                      database=None, print_blob=True, phases=_PHASES,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                             HealthCheck.filter_too_much])(fn)
        return seed(int(_SEED))(fn) if _SEED is not None else fn
    return wrap


def _case(data, fusible: bool = False, skip: bool = False):
    src = HypothesisSource(data)
    case = draw_case(src, draw_structure(src, fusible=fusible, skip=skip), DEVICE,
                     max_leaves=4)
    note(case.describe())
    return src, case


@fuzz(30)
@given(st.data())
def test_fused_matches_eager(data):
    """SPEC §6: ``step`` (and ``update``) on both backends within rounding."""
    _, case = _case(data, fusible=True)
    checks.fused_vs_eager(case)


@fuzz(30)
@given(st.data())
def test_skip_zeros_exact(data):
    """SPEC §3/§5: zero-gradient elements bit-identical, the rest as the plain chain."""
    src, case = _case(data, skip=True)
    checks.skip_zeros_exact(case, src.choice(checks.backends(case)))


@fuzz(20)
@given(st.data())
def test_purity_and_donate(data):
    """SPEC §1: donate=False modifies nothing; donate=True returns the given tensors,
    with the bits of donate=False."""
    src, case = _case(data)
    backend = src.choice(checks.backends(case))
    checks.purity(case, backend)
    checks.donate(case, backend)


@fuzz(20)
@given(st.data())
def test_checkpoint_round_trip(data):
    """SPEC §1: ``torch.save``/``torch.load(weights_only=True)`` continues bit-identically."""
    src, case = _case(data)
    checks.checkpoint(case, src.choice(checks.backends(case)))


@pytest.mark.parametrize("prop", ["fused_vs_eager", "skip_zeros", "donate", "checkpoint",
                                  "purity"])
def test_checks_catch_a_planted_bug(prop, monkeypatch):
    """The checks can fail: a fused step that perturbs one element of one param, or of
    the state after a torch.load, is caught by each property that looks at it."""
    from fuzz_cases import Case, Part, Structure

    import ftopt

    structure = Structure((Part("adam", (("nesterov", False),)),), skip="wrap")
    gen = torch.Generator().manual_seed(7)
    params = {"w0": torch.randn(5, 3, generator=gen), "w1": [torch.randn(4, generator=gen)]}
    grads = [ftopt.tree.map(lambda p: torch.randn(p.shape, generator=gen), params)
             for _ in range(2)]
    grads[0]["w0"][1] = 0.0
    params, grads = ftopt.tree.map(lambda x: x.to(DEVICE), (params, grads))
    case = Case(structure, [{"learning_rate": 0.01}], params, grads, DEVICE, 0)
    real_step, real_load = ftopt.step, torch.load

    def broken_step(tx, p, g, s, **kw):
        new_p, new_s = real_step(tx, p, g, s, **kw)
        if {"fused_vs_eager": kw.get("backend") == "fused", "skip_zeros": True,
                "donate": kw.get("donate", False)}.get(prop, False):
            new_p["w0"].view(-1)[3] += 1.0  # an element whose gradient is zero
        if prop == "purity":
            g["w1"][0].view(-1)[2] += 1.0  # (a grad of a donate=False call, in place)
        return new_p, new_s

    def broken_load(*args, **kw):
        state = real_load(*args, **kw)
        state[0][0].nu["w0"].view(-1)[0] += 1.0
        return state

    monkeypatch.setattr(ftopt, "step", broken_step)
    monkeypatch.setattr(torch, "load", broken_load)
    if prop == "purity":  # (p, then g: g's w1[0] is the snapshot's fourth tensor)
        with pytest.raises(checks.PurityError, match=r"input tensor 3 \(torch.float32\(4,\)"):
            checks.purity(case, "eager")
        return
    # (a donated step's failure names how its bits differ)
    match = r"differs in its bits \(1 of 15 elements, up to \d+ ulps" if prop == "donate" else None
    with pytest.raises(AssertionError, match=match):
        if prop == "fused_vs_eager":
            checks.fused_vs_eager(case)
        elif prop == "skip_zeros":
            checks.skip_zeros_exact(case, "eager")
        elif prop == "donate":
            checks.donate(case, "fused")

        else:
            checks.checkpoint(case, "eager")


def test_skip_check_holds_a_finite_norm_chain_exact_off_the_zeros(monkeypatch):
    """Chains with a norm are held to the zeros only where a NaN or an infinity is in play
    (``Structure.reads_others``, CPU fuzz seed 268): with every value finite, a
    skip_zeros step of a global-norm chain one ulp off the plain chain's at a non-zero
    gradient fails, and the same step unbroken passes."""
    from fuzz_cases import Case, Part, Structure

    import ftopt

    structure = Structure((Part("clip_by_global_norm", ()), Part("adam", (("nesterov", False),))),
                          skip="marker", skip_at=1)
    assert structure.reads_others and structure.exact_off_zeros
    gen = torch.Generator().manual_seed(11)
    params = {"w": torch.randn(6, 5, generator=gen)}
    grads = [{"w": torch.randn(6, 5, generator=gen)} for _ in range(2)]
    grads[0]["w"][2] = grads[1]["w"][4] = 0.0
    params, grads = ftopt.tree.map(lambda x: x.to(DEVICE), (params, grads))
    case = Case(structure, [{"max_norm": 1.0}, {"learning_rate": 0.01}], params, grads,
                DEVICE, 0)
    checks.skip_zeros_exact(case, "eager")
    real_step, calls = ftopt.step, []

    def broken_step(tx, p, g, s, **kw):
        new_p, new_s = real_step(tx, p, g, s, **kw)
        calls.append(tx)
        if len(calls) % 2:  # (the skip_zeros run; the plain chain's comes second)
            w = new_p["w"].view(-1)
            w[0] = torch.nextafter(w[0], torch.tensor(float("inf"), device=w.device))
        return new_p, new_s

    monkeypatch.setattr(ftopt, "step", broken_step)
    with pytest.raises(AssertionError, match="differs from the plain chain off the zeros"):
        checks.skip_zeros_exact(case, "eager")


def test_bit_diff_names_the_elements_and_their_ulps():
    a = torch.tensor([1.0, 2.0, 3.0, -0.0])
    b = a.clone()
    b[1] = torch.nextafter(b[1], torch.tensor(9.0))
    b[3] = 0.0  # -0.0 and +0.0 differ in their bits
    assert checks._bit_diff(a, b) == (
        "(2 of 4 elements, up to 2147483648 ulps; element 1: 2.0 vs 2.000000238418579)")
    assert checks._bit_diff(a[:3].bfloat16(), (a[:3] + 0.5).bfloat16()).startswith(
        "(3 of 3 elements, up to 64 ulps")
    assert checks._bit_diff(a, a.clone()) == "(no element differs)"


def test_reference_spread_tells_ill_conditioned_chains_from_bugs():
    """The float64 reference's spread (what one-ulp moves of the inputs do to the result)
    is tiny for Adam, where a 1e-5 error is then rejected, and large for Yogi at b1 = b2 =
    0 with v ≈ g² (v − g² cancels), where a one-rounding difference is admitted."""
    import ftopt

    gen = torch.Generator().manual_seed(11)
    p = {"w": torch.randn(64, generator=gen)}
    sign = torch.where(torch.rand(64, generator=gen) < 0.5, -1.0, 1.0)
    g = {"w": sign * (0.999 + 1e-4 * torch.rand(64, generator=gen))}
    spec = ftopt.tree.flatten_with_paths(p)[2]
    spreads, results = {}, {}
    for name, tx in (("adam", ftopt.scale_by_adam()),
                     ("yogi", ftopt.scale_by_yogi(b1=0.0, b2=0.0,
                                                  initial_accumulator_value=1.0))):
        ref = checks.Reference(tx, p, g, tx.init(p))
        r, spreads[name] = ref.update(spec, 0)
        results[name] = (tx.update(g, tx.init(p), p, backend="eager")[0]["w"], r)
    assert spreads["adam"] < 1e-7 < 1e-5 < spreads["yogi"]
    e, r = results["adam"]
    assert not checks._as_accurate(e * (1 + 1e-5), e, r, spreads["adam"])
    e, r = results["yogi"]
    assert checks._as_accurate(e * (1 + 2e-5), e, r, spreads["yogi"])


def test_fp32_spread_sees_roundings_inside_a_chain():
    """The fp32 spread (eager rerun from inputs moved by one fp32 ulp) sees what the
    float64 spread cannot: a rounding early in a chain amplified later in it. The H200's
    fuzz found such a chain (seed 17 example 8920, yogi -> adan -> rms -> adan: on a GPU,
    where eager runs torch's CUDA kernels, fused gave a state leaf 2.4e-6 from eager's,
    which the float64 spread, 2.6e-7, did not admit). That leaf moves by far more in
    fp32, and the difference is admitted; Adam's state moves by ~1e-7, and a 1e-5
    difference is refused."""
    import ftopt

    case = pinned(17, 8920, "cpu")
    ill = case.tx()
    p1, s1 = ftopt.step(ill, case.params, case.grads[0], ill.init(case.params),
                        backend="eager")
    gen = torch.Generator().manual_seed(12)
    w = {"w": torch.randn(300, generator=gen)}
    adam = ftopt.adam(1e-3)
    got = {}
    for name, tx, p, g, s, i in (("ill", ill, p1, case.grads[1], s1, 37),
                                 ("adam", adam, w, {"w": torch.randn(300, generator=gen)},
                                  adam.init(w), None)):
        ref = checks.Reference(tx, p, g, s)
        e = checks._state_leaves(ftopt.step(tx, p, g, s, backend="eager")[1])
        i = i if i is not None else max(range(len(e)), key=lambda k: e[k].numel())
        moved = [m[i] for m in ref.moved_states("step")]
        got[name] = max(checks._rel(m, e[i]) for m in moved)
        got[name + " admits"] = [checks._within_fp32_spread(e[i] * (1 + d), e[i],
                                                            lambda m=moved: m)
                                 for d in (1e-5, 2.4e-6)]
    assert got["adam"] < 1e-6 < got["ill"], got
    assert got["adam admits"] == [False, False] and got["ill admits"][1], got


@pytest.mark.filterwarnings("ignore:.*8-bit codes differ")
def test_codes_far_apart_only_where_eager_is_far_from_float64():
    """8-bit codes more than one apart are refused, unless eager's own codes are as far
    from the float64 reference's (a near-tie that rounding decides, such as Yogi's
    sign(v - g²)) or move by as much when the inputs move by one fp32 ulp."""
    from ftopt.rules import QuantizedSlot

    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 256, (512,), generator=gen, dtype=torch.uint8)
    absmax = torch.rand(2, generator=gen) + 0.5
    eager = {"w": QuantizedSlot(codes, absmax)}
    off = codes.clone()
    off[7] = (int(off[7]) + 127) % 256
    fused = {"w": QuantizedSlot(off, absmax.clone())}
    like_eager = lambda: ([eager["w"]], [0.0])  # noqa: E731
    with pytest.raises(AssertionError, match="differ by 127 > 1"):
        checks._close_states(fused, eager, "planted", like_eager)
    far = codes.clone()
    far[7] = (int(far[7]) + 100) % 256
    far_ref = lambda: ([QuantizedSlot(far, absmax)], [0.0])  # noqa: E731
    checks._close_states(fused, eager, "near-tie", far_ref)  # admitted
    one = codes.clone()
    one[7] = (int(one[7]) + 1) % 256  # eager one code from float64: rounding, not a tie
    with pytest.raises(AssertionError, match="differ by 127 > 1"):
        checks._close_states(fused, eager, "planted", lambda: ([QuantizedSlot(one, absmax)],
                                                               [0.0]))
    moved = lambda: [[QuantizedSlot(off, absmax)]]  # noqa: E731
    checks._close_states(fused, eager, "moved", like_eager, moved)  # admitted
    with pytest.raises(AssertionError, match="differ by 127 > 2"):
        checks._close_states(fused, eager, "moved by 1", like_eager,
                             lambda: [[QuantizedSlot(torch.where(
                                 torch.arange(512) == 9, codes ^ 1, codes), absmax)]])


# ------------------------------------------------------------------------------------------
# The GPU runner's bookkeeping (benchmarks/fuzz.py): shards, dtypes per structure, merge
# ------------------------------------------------------------------------------------------


def test_runner_shards_are_disjoint_and_draw_the_same_cases():
    runner = fuzz_runner()
    shards = [list(runner.shard_indices(50, (k, 3))) for k in range(3)]
    assert sorted(i for s in shards for i in s) == list(range(50))
    pool = runner.structure_pool(1, 6, dtypes=2)
    for _, names in pool:
        assert len(names) == 2 and set(names) <= set(runner.DTYPE_NAMES)
    for index in (0, 7, 31):  # the same case whichever worker or shard draws it
        a, b = (runner.example(1, index, pool, "cpu") for _ in range(2))
        assert a.describe() == b.describe()
        names = dict((id(s), n) for s, n in pool)[id(a.structure)]
        leaves = optree.tree_leaves(a.params, namespace="ftopt")
        assert {p.dtype for p in leaves} <= {DTYPES[n] for n in names}


def test_runner_merge_sums_shards_and_refuses_overlaps(tmp_path):
    import json

    runner = fuzz_runner()
    base = {"seeds": [0], "examples_per_seed": 10, "structures": 30, "dtypes": 2,
            "torch": torch.__version__, "replay_flags": "--structures 30 --dtypes 2",
            "device": "X", "gpus": 1, "workers": 2, "code_diff_elements": 1,
            "failures": []}
    parts = [{**base, "shards": ["0/2"], "examples": 5, "seconds": 10.0,
              "checked": {"donate": 5}, "failed": {}},
             {**base, "shards": ["1/2"], "examples": 5, "seconds": 12.0,
              "checked": {"donate": 5, "purity": 5}, "failed": {"purity": 1},
              "failures": [{"property": "purity", "message": "m", "case": "c",
                            "replay": "0:3"}]}]
    paths = []
    for i, part in enumerate(parts):
        paths.append(tmp_path / f"p{i}.json")
        paths[-1].write_text(json.dumps(part))
    merged = runner.merge([str(p) for p in paths])
    assert merged["examples"] == 10 and merged["seconds"] == 22.0
    assert merged["workers"] == 2 and len(merged["calls"]) == 2
    assert merged["checked"] == {"donate": 10, "purity": 5}
    assert merged["failed"] == {"purity": 1} and merged["code_diff_elements"] == 2
    assert runner.report(merged, tmp_path / "merged") == 1
    assert "| purity | 5 | 1 |" in (tmp_path / "merged.md").read_text()
    with pytest.raises(SystemExit, match="not disjoint"):
        runner.merge([str(paths[0]), str(paths[0])])


def test_plain_state_of_a_keyword_skip_zeros_partition():
    """An alias' ``skip_zeros=True`` may put its marker at the end of each branch's chain
    (Muon's partition: H200 fuzz, seed 21), not only at the end of its own: the control
    run's state is the plain alias' layout, the same tensors."""
    from fuzz_cases import Structure, plain_state

    import ftopt

    gen = torch.Generator().manual_seed(3)
    p = {"w": torch.randn(4, 5, generator=gen), "b": torch.randn(5, generator=gen)}
    skip, plain = ftopt.muon(1e-2, skip_zeros=True), ftopt.muon(1e-2)
    s = skip.init(p)
    s = ftopt.step(skip, p, {k: torch.randn_like(v) for k, v in p.items()}, s)[1]
    like = plain.init(p)
    got = plain_state(Structure(parts=(), skip="keyword"), s, like)
    assert optree.tree_structure(got, namespace="ftopt") == \
        optree.tree_structure(like, namespace="ftopt")
    assert all(a is b for a, b in zip(optree.tree_leaves(got, namespace="ftopt"),
                                      optree.tree_leaves(s, namespace="ftopt")))
    ftopt.step(plain, p, {k: torch.randn_like(v) for k, v in p.items()}, got)


def test_16bit_params_get_the_ill_conditioning_rules():
    """A 16-bit param more than one ulp from eager's is refused, unless fused is as
    accurate against float64 as eager or eager moves as much by itself when its inputs
    move by one fp32 ulp (H200 fuzz, seed 20 example 1753: Muon then Yogi, fp16, fused
    7.5e-4 from float64 where eager was 1.4e-3)."""
    e = torch.tensor([-107.125, 116.4375, 3.0], dtype=torch.float16)
    f = torch.tensor([-107.0, 116.25, 3.0], dtype=torch.float16)
    old = torch.tensor([-100.0, 110.0, 3.0], dtype=torch.float16)
    r = torch.tensor([-107.03, 116.3, 3.0], dtype=torch.float64)
    with pytest.raises(AssertionError, match="beyond one ulp"):
        checks._close_param(f, e, old, "p")
    checks._close_param(f, e, old, "p", ref=lambda: (r, 0.0))
    checks._close_param(f, e, old, "p", moved=lambda: [f.clone()])
    far = torch.tensor([-106.5, 116.25, 3.0], dtype=torch.float16)
    with pytest.raises(AssertionError, match="beyond one ulp"):
        checks._close_param(far, e, old, "p", ref=lambda: (r, 0.0))


def test_host_eager_runs_the_same_step_on_the_cpu():
    """:meth:`Reference.host_leaf` (the GPU's fuzz admits fused as accurate as the CPU's
    eager, where CUDA's eager may contract multiply-adds) copies params, grads and a
    state with 8-bit slots to the CPU and runs eager there: on a CPU case, eager's own
    bits. A well-conditioned Adam 1e-5 away from that is refused."""
    import functools

    import ftopt

    case = pinned(22, 644, "cpu")
    assert case.structure.bits == 8 and not case.structure.tensors
    tx = case.tx()
    p, g = case.params, case.grads[0]
    s = tx.init(p)
    ref = checks.Reference(tx, p, g, s, case.moved_tx, host_eager=True)
    spec = ftopt.tree.flatten_with_paths(p)[2]
    eager = spec.flatten_up_to(tx.update(g, s, p, backend="eager")[0])
    stepped = spec.flatten_up_to(ftopt.step(tx, p, g, s, backend="eager")[0])
    for j in range(len(eager)):
        if eager[j] is not None:
            assert torch.equal(ref.host_leaf("update", spec, j), eager[j])
        assert torch.equal(ref.host_leaf("step", spec, j), stepped[j])
    states = checks._state_leaves(ftopt.step(tx, p, g, s, backend="eager")[1])
    host_states = ref.host_states("step")
    assert len(host_states) == len(states)
    for a, b in zip(host_states, states):
        if isinstance(b, checks.QuantizedSlot):
            assert torch.equal(a.codes, b.codes) and torch.equal(a.absmax, b.absmax)
        else:
            assert torch.equal(a, b)
    gen = torch.Generator().manual_seed(14)
    w = {"w": torch.randn(300, generator=gen)}
    gw = {"w": torch.randn(300, generator=gen)}
    adam = ftopt.scale_by_adam()
    ref = checks.Reference(adam, w, gw, adam.init(w), host_eager=True)
    e = adam.update(gw, adam.init(w), w, backend="eager")[0]["w"]
    spec = ftopt.tree.flatten_with_paths(w)[2]
    upd = functools.partial(ref.update, spec, 0)
    host = functools.partial(ref.host_leaf, "update", spec, 0)
    assert checks._as_accurate_as_host(e, upd, host)
    assert not checks._as_accurate_as_host(e * (1 + 1e-5), upd, host)
    assert not checks._as_accurate_as_host(e, upd, lambda: None)


def test_state_check_admits_fused_as_accurate_as_the_cpus_eager():
    """A float state 3e-6 from CUDA's eager (which may contract a multiply-add, so sit
    nearer float64) passes where it equals eager run on the CPU, and only then."""
    exact = torch.tensor([0.25, -1.5, 3.0])
    fused = exact * (1 + 3e-6)
    ref = lambda: ([exact.double()], [0.0])  # noqa: E731
    checks._close_states([fused], [exact], "s", ref, None, lambda: [fused.clone()])
    for host in (None, lambda: None, lambda: [exact.clone()]):
        with pytest.raises(AssertionError, match="relative error"):
            checks._close_states([fused], [exact], "s", ref, None, host)


def test_state_check_admits_fused_as_near_float64_as_eagers_draws():
    """Seed 197's snapshot sum (a cancellation): fused on the other side of float64 from
    eager, farther from eager than its draws reach but no farther from float64 than
    twice theirs, passes; twice as far again does not."""
    r = torch.tensor(-7.0933009e-4, dtype=torch.float64)
    eager = torch.tensor(-7.0941448e-4)
    draws = [torch.tensor(x) for x in (-7.0935488e-4, -7.0947409e-4, -7.0953369e-4)]
    ref = lambda: ([r], [1.6e-7])  # noqa: E731
    for fused, ok in ((-7.0905685e-4, True), (-7.0878e-4, False)):
        f = torch.tensor(fused)
        assert checks._as_near_float64_as_moved(f, lambda: (r, 1.6e-7), lambda: draws) == ok
        if ok:
            checks._close_states([f], [eager], "s", ref, lambda: [[d] for d in draws])
        else:
            with pytest.raises(AssertionError, match="relative error"):
                checks._close_states([f], [eager], "s", ref, lambda: [[d] for d in draws])


def test_param_check_judges_the_elements_beyond_an_ulp_alone():
    """A 16-bit param leaf whose largest difference is one ulp of a large element, and
    whose element beyond an ulp is a tiny one: it passes where eager's own draws scatter
    over that element as far (or fused is at float64 there), and only then. Seed 207's
    numbers."""
    bf16 = lambda *x: torch.tensor(x, dtype=torch.bfloat16)  # noqa: E731
    old = bf16(3.5, -0.0)
    eager = bf16(3.53125, -4.6798959e-8)
    fused = bf16(3.546875, -4.6333298e-8)  # (one ulp above eager, then two ulps)
    r = torch.tensor([3.5322, -4.6347030e-8], dtype=torch.float64)
    scattered = [bf16(3.53125, -4.6566129e-8), bf16(3.53125, -4.5867637e-8)]
    still = [eager.clone(), eager.clone()]
    checks._close_param(fused, eager, old, "p", lambda: (r, 0.0), lambda: scattered)
    checks._close_param(fused, eager, old, "p", lambda: (r, 0.0), lambda: still)
    far = eager.double()  # float64 at eager's values: fused is the one off
    with pytest.raises(AssertionError, match="beyond one ulp"):
        checks._close_param(fused, eager, old, "p", lambda: (far, 0.0), lambda: still)
    # Judged over the whole leaf, the large element's ulp outweighs the draws' spread.
    assert not checks._ill_conditioned(fused, eager, lambda: (r, 0.0), lambda: scattered,
                                       None, old)


def test_state_check_judges_16bit_elements_beyond_an_ulp_alone():
    """The same for a 16-bit state leaf (``state_dtype``): fp16 subnormals six of their
    ulps from eager pass where eager's draws scatter as far, or fused is nearer float64;
    not where eager is at float64 and its draws stay. Seed 210's numbers."""
    fp16 = lambda *x: torch.tensor(x, dtype=torch.float16)  # noqa: E731
    eager = fp16(0.1378, -2.1100e-5, 7.7903e-5)
    fused = fp16(0.13792, -2.1458e-5, 7.7367e-5)  # (one ulp above eager, then six)
    r = torch.tensor([0.1378, -2.1945e-5, 7.7520e-5], dtype=torch.float64)
    scattered = [fp16(0.1378, -2.1756e-5, 7.7963e-5), fp16(0.1378, -2.1219e-5, 7.7546e-5)]
    still = [eager.clone(), eager.clone()]
    for draws, ref in ((scattered, r), (still, r), (scattered, eager.double())):
        checks._close_states([fused], [eager], "s", lambda ref=ref: ([ref], [0.0]),
                             lambda draws=draws: [[d] for d in draws])
    with pytest.raises(AssertionError, match="beyond one ulp"):
        checks._close_states([fused], [eager], "s", lambda: ([eager.double()], [0.0]),
                             lambda: [[d] for d in still])
    # Judged over the whole leaf, the large element's ulp outweighs the draws' spread.
    assert not checks._ill_conditioned(fused, eager, lambda: (r, 0.0),
                                       lambda: scattered)


def test_host_tx_moves_hyperparameter_tensors_to_the_cpu():
    """:meth:`Case.host_tx`: the same transformation with its hyperparameter tensors on
    the CPU (the fuzz's CPU eager run of a structure with tensor hyperparameters)."""
    import ftopt

    runner = fuzz_runner()
    pool = runner.structure_pool(26, 30, 2)
    case = next(c for c in (runner.example(26, i, pool, "cpu") for i in range(200))
                if c.structure.tensors and c.hparam_tensors())
    host = case.host_tx()
    p, g = case.params, case.grads[0]
    s = case.tx().init(p)
    want = ftopt.step(case.tx(), p, g, s, backend="eager")[0]
    got = ftopt.step(host, p, g, s, backend="eager")[0]
    for a, b in zip(ftopt.tree.flatten_with_paths(got)[1],
                    ftopt.tree.flatten_with_paths(want)[1]):
        assert torch.equal(a, b)


def test_stage_replay_names_every_prefix_of_the_chain():
    """``benchmarks/fuzz_stages.py`` (where fused and eager part, stage by stage) prints
    one line per prefix of the chain and leaf, each with the three distances."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "fuzz_stages.py"
    spec = importlib.util.spec_from_file_location("fuzz_stages", path)
    stages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stages)
    case = pinned(22, 2453, DEVICE)
    lines = stages.prefixes(case, 0)
    names = [part.entry.name for part in case.structure.parts]
    assert [line.split(" ")[1] for line in lines[::3]] == names
    assert all("fused-eager" in x and "fused-f64" in x and "eager-f64" in x for x in lines)


def test_more_draws_only_where_some_were_taken_and_once():
    import ftopt

    w = {"w": torch.randn(5, generator=torch.Generator().manual_seed(3))}
    tx = ftopt.adam(1e-3)
    ref = checks.Reference(tx, w, w, tx.init(w))
    assert not ref.more_draws()  # (none taken: nothing they could settle)
    assert len(ref.moved32("step")) == checks.Reference.DRAWS32
    assert ref.more_draws() and not ref.more_draws()
    runs = ref.moved32("step")
    assert len(runs) == checks.Reference.MORE32
    assert len({float(r[0]["w"][0]) for r in runs}) > 1  # (each draw its own)


