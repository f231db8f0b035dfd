# Quickstart:  make run   (set up, then the default job)     make test   (set up, then the test suite)
DATA ?= $(abspath ../shared/data)
PY := .venv/bin/python
ARGS ?=

.PHONY: setup run test test-all lint
setup:
	@bash scripts/setup.sh

run: setup
	KVQ_DATA_DIR=$${KVQ_DATA_DIR:-$(DATA)} $(PY) run.py $(ARGS)

test: setup
	KVQ_DATA_DIR=$${KVQ_DATA_DIR:-$(DATA)} $(PY) -m pytest -q $(ARGS)

lint: setup
	.venv/bin/ruff check . && .venv/bin/ruff format --check .
