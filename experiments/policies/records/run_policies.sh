#!/bin/bash
# Usage: bash experiments/policies/records/run_policies.sh <coqa|fidelity|needle|vt> [context_tokens]
# One process per row and task, one torch thread each (two scripts ran side by side on the 2-core machine).
set -u
cd "$(dirname "$0")/../../.."
source experiments/policies/records/rows.sh
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
what=$1; ctx=${2:-4096}
case $what in
  coqa) TASK="task=coqa_turns limit=100" ;;
  fidelity) TASK="task=fidelity task.source=gsm8k task.context_tokens=2048 task.eval_tokens=256 task.windows=1" ;;
  needle) TASK="task=retrieval task.kind=needle task.samples=3 task.context_tokens=$ctx" ;;
  vt) TASK="task=retrieval task.kind=variable_tracking task.samples=3 task.context_tokens=$ctx" ;;
esac
for row in $ORDER; do
  [ "$what" = fidelity ] && [ "$row" = 16_fp16 ] && continue  # the reference itself
  echo "== $what $row $(date +%T)"
  .venv/bin/python run.py $COMMON $TASK ${ROWS[$row]} 2>&1 | grep -E "^\[|^error|record:"
done
