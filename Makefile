# The README's commands. `make demo` and `make test` set up .venv on first use.
# TORCH_SPEC picks the torch build: the default is the CPU build this project is tested
# with; GPU users install their CUDA/ROCm/XPU torch first and run `make TORCH_SPEC= test`.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

$(VENV)/.ready: pyproject.toml
	python3 -m venv $(VENV)
	$(if $(TORCH_SPEC),$(PY) -m pip install -q "$(TORCH_SPEC)")
	$(PY) -m pip install -q -e '.[test,integration]'
	touch $@

.PHONY: demo test lint bench fuzz catalogue
demo: $(VENV)/.ready
	$(PY) -m ftopt demo

# Every run starts with an empty Triton cache under build/, as on a new machine: a warm
# cache hides failures in Triton's code generator (compiled kernels are cache hits).
TEST_CACHE := $(CURDIR)/build/triton-cache
# Test files run in parallel, one process per core up to 4 (pytest-xdist; a file's tests
# stay in one process, in order): 2 cores, about 6-7 min (2026-12-07: 352 s of tests).
# Handing out single tests instead (`--dist worksteal`) took 11 min: each process then
# builds every file's kernels and fixtures again. Files are handed out longest first
# (tests/conftest.py's LONGEST_FIRST), not by their number of tests (xdist's default
# reorder).
TEST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)

test: $(VENV)/.ready
	rm -rf $(TEST_CACHE) && mkdir -p $(TEST_CACHE)
	TRITON_CACHE_DIR=$(TEST_CACHE) $(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder

lint: $(VENV)/.ready
	$(VENV)/bin/ruff check ftopt tests benchmarks

bench: $(VENV)/.ready
	$(PY) benchmarks/eager_cpu.py

# The fuzzed contract (tests/fuzz_checks.py) by the ten thousand on a GPU; on a CPU run
# `TRITON_INTERPRET=1 $(PY) benchmarks/fuzz.py --examples 50`.
fuzz: $(VENV)/.ready
	$(PY) benchmarks/fuzz.py

# The README's catalogue table, from tests/registry.py (tests/test_catalogue.py checks it).
catalogue: $(VENV)/.ready
	PYTHONPATH=. $(PY) -m tests.catalogue
