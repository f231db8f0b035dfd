# Quickstart:  make run   (set up, then the default job)     make test   (set up, then the test suite)
# Edit loop:   make check (the fast subset, no real model: 2.6 min on 2 cores on 2026-12-07)   make lint
DATA ?= $(abspath ../shared/data)
PY := .venv/bin/python
ARGS ?=
# one pytest worker per core (pytest-xdist); a worker takes the next test as it frees, so long tests do not queue.
# PAR= runs in one process (a debugger, -x on the first failure in order)
PAR ?= -n auto --dist worksteal
# make check leaves out what make test still runs: the real model (`slow`), end-to-end runs in subprocesses
# (test_run, test_faults, test_cache_tasks), the Triton interpreter and GPU compile, and the C kernel's build matrix
CHECK := -m "not slow" \
	--ignore=tests/run/test_run.py --ignore=tests/run/test_faults.py --ignore=tests/tasks/test_cache_tasks.py \
	--ignore=tests/kernels/test_triton.py --ignore=tests/kernels/test_triton_compile.py --ignore=tests/kernels/test_bench_kernels.py \
	--ignore=tests/kernels/test_cpu_kernel.py

.PHONY: setup run test check lint test-slurm
setup:
	@bash scripts/setup.sh

run: setup
	KVQ_DATA_DIR=$${KVQ_DATA_DIR:-$(DATA)} $(PY) run.py $(ARGS)

test: setup
	KVQ_DATA_DIR=$${KVQ_DATA_DIR:-$(DATA)} $(PY) -m pytest -q $(PAR) $(ARGS)

check: setup
	KVQ_DATA_DIR=$${KVQ_DATA_DIR:-$(DATA)} $(PY) -m pytest -q -p no:cacheprovider $(PAR) $(CHECK) $(ARGS)

# the SLURM launcher on a local single-node cluster (scripts/slurm_local.sh; installs Debian's slurm-wlm): minutes
test-slurm: setup
	KVQ_DATA_DIR=$${KVQ_DATA_DIR:-$(DATA)} $(PY) -m pytest -q -m slurm tests/run/test_slurm_cluster.py $(ARGS)

lint: setup
	.venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/lint-imports
