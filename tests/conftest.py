"""Test configuration: without a GPU, Triton kernels run in the interpreter."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402
import step_checks  # noqa: E402

# The files that take longest, longest first (seconds of tests on 2 cores under the
# interpreter, 2026-12-05): they start first, so that with the Makefile's one file a
# process (`--dist loadfile --no-loadscope-reorder`) the last files handed out are short
# ones and no process waits on another's long file at the end.
# The first five are first for a GPU's sake: there, where kernels compile, they hold the
# slowest tests (an H100, 2026-12-06: the fuzz's two files 302 s and 484 s,
# test_quant_arith.py 372 s, fuzz seed 102's pinned case 204 s, now in
# test_register_cap.py, and test_fused.py's 8-bit half 341 of its 447 s, now
# test_fused_8bit.py). Started together on 16 processes of one H100 they each ran 25-50%
# longer (benchmarks/RESULTS.md, 2026-12-06 23:33): there one file a process leaves the
# suite as long as its slowest file, and single tests are handed out instead
# (`--dist worksteal`, which gives each process a contiguous stretch of the order to start
# with and moves the ends of long queues to idle ones): dealt round-robin (see
# pytest_collection_modifyitems), each process's stretch starts with a share of the long
# files' tests rather than one process holding them all (H100, 2026-12-07: 63 tests left
# at 390 s, among them the fuzz's longest, 292 s).
LONGEST_FIRST = ("test_fuzz.py", "test_fuzz_pinned.py", "test_quant_arith.py",
                 "test_register_cap.py", "test_fused_8bit.py", "test_skip_watch.py",
                 "test_state_dtype.py", "test_fused.py", "test_gpu_compile.py",
                 "test_skip_tiles.py", "test_distributed.py", "test_skip_zeros.py",
                 "test_frontend.py", "test_fused_update.py", "test_word_selects.py",
                 "test_matrix_optimizers.py", "test_pytrees.py", "test_knobs.py",
                 "test_sophia.py")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """(pytest-xdist, in the controlling process) Tells each worker how tests are handed
    out: a worker's own ``dist`` option reads "no"."""
    node.workerinput["ftopt_dist"] = node.config.getoption("dist")


def pytest_collection_modifyitems(config, items):
    """The tests of LONGEST_FIRST's files first, in its order, then the others; each
    file's tests in their own order. Where pytest-xdist hands out single tests by work
    stealing, that order dealt round-robin over its processes (every process collects
    the same order)."""
    rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    worker = getattr(config, "workerinput", {})
    if worker.get("ftopt_dist") == "worksteal":
        n = worker["workercount"]
        items[:] = [item for k in range(n) for item in items[k::n]]


def pytest_runtest_setup(item):
    step_checks.SEEDS.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test that drew fresh random data says how to draw it again."""
    report = (yield).get_result()
    if report.failed and step_checks.SEEDS:
        seeds = ",".join(map(str, step_checks.SEEDS))
        report.sections.append(("random seeds", f"to draw this data again: "
                                f"FTOPT_TEST_SEEDS={seeds} pytest '{item.nodeid}'"))


@pytest.fixture(scope="session")
def native_checks():
    """The native tensor check (:mod:`ftopt.lowering.native`), built on first use into the
    user's cache (~12 s once per torch version). Without a C++ compiler or Python's
    headers the tests that need it are skipped, saying so: ftopt then runs the other
    checks."""
    from ftopt.lowering import native

    lacking = native.missing()
    if lacking is not None:
        pytest.skip(f"the native tensor check cannot be built here: {lacking}")
    module = native.module(wait=True)
    assert module is not None, native.status()
    return module


@pytest.fixture(params=["native", "guards", "python"])
def tensor_checks(request, monkeypatch):
    """Runs a test with each way the fused paths check new tensors against their cached
    tables: the native one-call check, torch's C++ guards plus Python pointer reads, and
    the per-property Python passes."""
    from ftopt.lowering import checks

    if request.param == "native":
        request.getfixturevalue("native_checks")
    monkeypatch.setattr(checks, "USE_NATIVE", request.param == "native")
    monkeypatch.setattr(checks, "USE_GUARDS", request.param == "guards")
    return request.param


@pytest.fixture(scope="module")
def one_thread():
    """Small tensors: intra-op threads only add overhead (and spin on a busy machine).
    Modules use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def kernel_launches(monkeypatch):
    """Every main or reduction kernel launched from now on, through ``launch._launch`` or
    a bound launch of a cached donated step (``launch.bind_main``): a list that grows by
    one per launch."""
    from ftopt.lowering import launch

    calls: list = []
    real = launch._launch
    monkeypatch.setattr(launch, "_launch",
                        lambda *a, **k: (calls.append(a[0]), real(*a, **k))[1])
    real_bind = launch.bind_main

    def counting_bind(*args, **kwargs):
        bound = real_bind(*args, **kwargs)
        for b in bound or ():
            b.runner = (lambda *a, _run=b.runner, _group=b.group, **k:
                        (calls.append(_group), _run(*a, **k))[1])
        return bound

    monkeypatch.setattr(launch, "bind_main", counting_bind)
    return calls


class _Interpreted:
    """(bound_calls) A stand-in for a compiled kernel: ``[grid]`` gives a runner of the
    kernel."""

    def __init__(self, kernel, constants, calls):
        self.kernel, self.constants, self.calls = kernel, dict(constants), calls

    def __getitem__(self, grid):
        from ftopt.lowering import interpreter

        def runner(*args, stream=None):  # (a stream is the device's: none here)
            self.calls.append(grid)
            with interpreter.patches_undone():
                self.kernel[grid[:1]](*args, **self.constants)
        return runner


@pytest.fixture
def bound_calls(monkeypatch):
    """Bound launches enabled on every machine; the list of bound runs made. (On a CPU
    the interpreter has no compiled launcher to bind, so a runner stands in that
    launches the interpreted kernel with the bound arguments.)"""
    from ftopt.lowering import launch

    calls: list = []
    if launch.tiles.INTERPRETING:
        real = launch._launch

        def recording(kernel, grid, args, constants, device, key=()):
            # Launched as before (interpreted); registered as compiled for bind_main only.
            launch._COMPILED.pop((kernel, constants, device, key), None)
            real(kernel, grid, args, constants, device, key)
            launch._COMPILED[(kernel, constants, device, key)] = (
                _Interpreted(kernel, constants, calls), [])

        monkeypatch.setattr(launch, "_DIRECT", True)
        monkeypatch.setattr(launch, "_COMPILED", {})
        monkeypatch.setattr(launch, "_launch", recording)
    else:
        real_bind = launch.bind_main

        def counting(*args, **kwargs):
            bound = real_bind(*args, **kwargs)
            for b in bound or ():
                runner = b.runner

                def run(*a, _runner=runner, **k):
                    calls.append(None)
                    _runner(*a, **k)
                b.runner = run
            return bound

        monkeypatch.setattr(launch, "bind_main", counting)
    return calls
