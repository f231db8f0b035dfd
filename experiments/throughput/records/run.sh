#!/bin/bash
# The throughput study's runs (from the repo root, clean tree, idle machine). Run 1: every cache, with the curves of
# the figure; run 2: DynamicCache and the packed 2-bit cache again, for the headline ratios' repeatability.
# Run 3: the same pair at an 8 GiB budget (8192 tokens). Then a profile of one batched step of each at 2 GiB.
set -euo pipefail
OUT=experiments/throughput/records
PY=${PY:-.venv/bin/python}
$PY scripts/bench_throughput.py --budget 2GiB --lengths 4096 8192 --new-tokens 8 --warmup 2 --repeats 1 --curve \
    --json $OUT/fp32_2GiB_run1.json | tee $OUT/fp32_2GiB_run1.md
$PY scripts/bench_throughput.py --budget 2GiB --lengths 4096 8192 --new-tokens 8 --warmup 2 --repeats 1 \
    --only "2b K-C V-T G32 R128 (" --json $OUT/fp32_2GiB_run2.json | tee $OUT/fp32_2GiB_run2.md
$PY scripts/bench_throughput.py --budget 8GiB --lengths 8192 --new-tokens 6 --warmup 2 --repeats 1 \
    --only "2b K-C V-T G32 R128 (" --json $OUT/fp32_8GiB.json | tee $OUT/fp32_8GiB.md
$PY experiments/throughput/profile_step.py --length 8192 --budget 2GiB > $OUT/profile_8192.txt 2>&1
