#!/usr/bin/env bash
# The GPU check of the Triton kernels and the packed cache on CUDA, for a machine with a GPU but no network and no model
# weights. About 5-8 minutes on an H100 or H200 (each step has a time limit, 545 s in all); results go to
# experiments/kernels/.
#
#   1. on the development machine (no GPU needed; copies ~17 MB into the git-ignored .gpu_carry/):
#          bash scripts/gpu_check.sh prepare
#   2. on the GPU machine, in a copy of the working tree that includes .gpu_carry/, from the repo root (570 s is
#      enough):
#          bash scripts/gpu_check.sh OUT_FOLDER         (or with $OUT set)
#   3. back on the development machine: copy OUT_FOLDER's files into experiments/kernels/gpu_check/, read log.txt.
#
# On the GPU machine it writes six files into the folder given as $1 (or $OUT):
#   log.txt              versions, GPU, the carried commit, every step's output and exit status
#   results.json         scripts/bench_kernels.py: quantize+pack vs a copy; fused decode attention (each route, eager
#   quantize_pack.png      and graphed) vs the fastest fp16 attention at 4K-32K tokens for rope=post, rope=pre,
#   decode_attention.png   batch 8 and left-padded batches of 4; the tensor-core route's warps x stages sweep
#   throughput.json      scripts/bench_throughput.py --device cuda: sequences and aggregate tok/s in 8 GiB, packed
#   throughput.md          2-bit (Triton) vs DynamicCache, fp16, 8K and 32K tokens
# Step 1 of the GPU run is pytest of tests/kernels/test_triton.py (the kernels compiled for CUDA, no interpreter) and
# tests/kernels/test_cpu_kernel_configs.py (the C kernel, on that machine's CPU), output in log.txt.
#
# What cannot travel, and what stands in for it: the GPU machine has no network and takes 64 MiB of files, so the
# SmolLM2-135M weights (94 MB GGUF, 517 MB converted) stay here. bench_throughput runs a model of SmolLM2-135M's exact
# architecture (its config.json and tokenizer, carried) with random weights: the same shapes, bytes and kernels, so
# the same speed; greedy tokens of random weights say nothing about quality ("same greedy tokens" lines: ignore).
# The machine's Python has torch, triton and transformers but not this repo's pinned transformers (5.24): its wheel
# is carried and installed into /tmp/site (with --no-deps; its dependencies are there). kvq_lab runs from the tree
# (PYTHONPATH), not installed.
set -u -o pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CARRY=.gpu_carry
MODEL_NAME=smollm2-135m
TRANSFORMERS=5.24.0

if [[ "${1:-}" == "prepare" ]]; then
    PY="${PY:-.venv/bin/python}"
    mkdir -p "$CARRY/model" "$CARRY/whl"
    grep -qx "/$CARRY/" .git/info/exclude 2>/dev/null || echo "/$CARRY/" >>.git/info/exclude
    # the converted model's folder (kvq_lab.models.loading converts the GGUF on first load, ~1 min)
    src="$("$PY" -c "
from kvq_lab.models.loading import cache_dir, load_model
d = cache_dir() / '$MODEL_NAME'
if not (d / 'config.json').exists():
    load_model('$MODEL_NAME')
print(d)")" || { echo "gpu_check prepare: could not load $MODEL_NAME with $PY"; exit 1; }
    for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
        [[ -f "$src/$f" ]] && cp "$src/$f" "$CARRY/model/"
    done
    if ! ls "$CARRY/whl"/transformers-"$TRANSFORMERS"-*.whl >/dev/null 2>&1; then
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux2014_x86_64 -d "$CARRY/whl" "transformers==$TRANSFORMERS" \
            || echo "gpu_check prepare: no transformers wheel (the GPU run then uses the machine's transformers)"
    fi
    dirty=$(git status --porcelain --untracked-files=no | grep -q . && echo " (dirty: uncommitted changes)" || true)
    echo "$(git rev-parse HEAD)$dirty" >"$CARRY/commit.txt"
    echo "prepared $CARRY ($(du -sh "$CARRY" | cut -f1)), commit $(cat "$CARRY/commit.txt")"
    echo 'now: run(command="bash scripts/gpu_check.sh", carry=[".gpu_carry"], timeout_s=570)'
    exit 0
fi

OUT="${1:-${OUT:-}}"
[[ -n "$OUT" ]] || { echo "gpu_check: give an output folder (\$1) or set \$OUT"; exit 2; }
[[ -d "$CARRY/model" ]] || { echo "gpu_check: $CARRY/model missing: run 'bash scripts/gpu_check.sh prepare' here first and carry $CARRY"; exit 2; }
mkdir -p "$OUT"
LOG="$OUT/log.txt"
PY="${PY:-python3}"  # the GPU machine's python3 holds torch; PY=.venv/bin/python for a dry run here
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT" TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
unset TRITON_INTERPRET
START=$SECONDS
declare -A RC

step() {  # step NAME LIMIT_S CMD...: run with a time limit, log its exit status, go on whatever it returns
    local name=$1 limit=$2
    shift 2
    echo
    echo "=== $name (limit ${limit}s, at $((SECONDS - START))s) ==="
    timeout --kill-after=10 "$limit" "$@"
    RC[$name]=$?
    echo "=== $name: exit ${RC[$name]} after $((SECONDS - START))s ==="
}

main() {
echo "# gpu_check $(date -u +%FT%TZ), commit $(cat "$CARRY/commit.txt" 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true
if ls "$CARRY"/whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$CARRY"/whl/*.whl \
        && export PYTHONPATH="$ROOT:/tmp/site"
fi
$PY -c "
import sys, torch, triton, transformers
print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__,
      '| transformers', transformers.__version__, '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"

# 1. the kernels' tests on CUDA, and the C kernel's; bench_cache's schema test needs quanto and hqq (not there)
xdist=()
$PY -c "import xdist" 2>/dev/null && xdist=(-n 8)
step pytest 180 $PY -m pytest -q -p no:cacheprovider "${xdist[@]}" tests/kernels/test_triton.py tests/kernels/test_cpu_kernel_configs.py \
    -k "not bench_cache_json" -rfE

# 2. kernel microbenchmarks: quantize+pack vs a copy; fused decode attention on each route vs the fastest fp16
#    attention (eager and CUDA graphs, GB/s and the copy's fraction), 4K-32K tokens; the tensor-core launch sweep
step bench_kernels 170 $PY scripts/bench_kernels.py --out "$OUT" --lengths 4096 8192 16384 32768 --sweep

# 3. whole-model decode at equal cache memory: SmolLM2-135M's architecture with random weights (see the header),
#    positions widened to 40960 so that 32K-token contexts fit; packed 2-bit K-C/V-T (Triton) vs DynamicCache, fp16
MODEL=/tmp/$MODEL_NAME-arch
step model 45 $PY -c "
import shutil, torch
from transformers import AutoConfig, AutoModelForCausalLM
shutil.copytree('$CARRY/model', '$MODEL', dirs_exist_ok=True)
torch.manual_seed(0)
cfg = AutoConfig.from_pretrained('$MODEL')
cfg.max_position_embeddings = 40960
AutoModelForCausalLM.from_config(cfg).save_pretrained('$MODEL')
print('random-weight', cfg.model_type, cfg.num_hidden_layers, 'layers at $MODEL')"
step bench_throughput 150 bash -c "set -o pipefail; $PY scripts/bench_throughput.py --device cuda --model $MODEL \
    --dtypes fp16 --budget 8GiB --lengths 8192 32768 --only 'packed 2b K-C V-T G32 R128 (' --new-tokens 16 --warmup 3 \
    --repeats 2 --json '$OUT/throughput.json' | tee '$OUT/throughput.md'"

echo
echo "=== summary after $((SECONDS - START))s ==="
fail=0
for name in pytest bench_kernels model bench_throughput; do
    echo "$name: exit ${RC[$name]:-not run}"
    [[ "${RC[$name]:-1}" == 0 ]] || fail=1
done
ls -la "$OUT"
return $fail
}

main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
