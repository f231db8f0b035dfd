#!/bin/bash
# Gemma-3-270M, sliding-window layers skipped or not (experiments/policies/README.md): the packed cache as the
# long-context study runs it (R=128, G=32), 2-bit K-C/V-T; fidelity at 4096 tokens and the needle at 8192.
set -u
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
COMMON="experiment=policies model=gemma3-270m mode=packed exact_window=128 group_size=32 quant=2bit_KC_VT logger=none"
FID="task=fidelity task.source=gsm8k task.context_tokens=4096 task.eval_tokens=256 task.windows=1"
NEEDLE="task=retrieval task.kind=needle task.samples=3 task.context_tokens=8192 task.prompt=plain"
for task in "$FID" "$NEEDLE"; do
  for skip in none sliding_window; do
    echo "== $skip $(date +%T)"
    .venv/bin/python run.py $COMMON $task skip_layers=$skip 2>&1 | grep -E "^\[|^error|record:"
  done
done
echo "== 16-bit needle $(date +%T)"  # the needle's reference row
.venv/bin/python run.py $COMMON $NEEDLE quant=fp16 2>&1 | grep -E "^\[|^error|record:"
