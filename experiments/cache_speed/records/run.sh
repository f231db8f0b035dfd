# The benchmark behind experiments/cache_speed/README.md: decode speed and peak cache bytes of the packed 2-bit cache
# against DynamicCache, fp32 and bf16 at batch 1 and a left-padded fp32 batch of 4, prompts of 512, 4096 and 8192
# tokens. Run from the repository root, from a clean tree, with nothing else running on the machine (~51 min on
# 2 threads):
#   bash experiments/cache_speed/records/run.sh [OUT]
# OUT (default experiments/cache_speed/records-<UTC time>, a new folder) receives one table (.md), one JSON and one
# stderr log (.err) per setting and length, and commit.txt (the commit, then any uncommitted change). The records beside
# this script were written to /tmp/r16, the folder their headers name, and copied here with the script's own output
# and trace (run.log); their .err files were not committed.
set -x
P=.venv/bin/python
O="${1:-experiments/cache_speed/records-$(date -u +%Y%m%d-%H%M)}"
mkdir -p $O
git log -1 --format='commit %H' > $O/commit.txt
git status --short >> $O/commit.txt
b() { name=$1; shift; echo "== $name $(date -u +%H:%M:%S)"; $P scripts/bench_cache.py "$@" --json $O/$name.json > $O/$name.md 2> $O/$name.err; echo "== done $name $(date -u +%H:%M:%S) rc=$?"; }
b fp32_b1_8192 --settings fp32-b1 --lengths 8192 --only "R128 (cpu)" "preRoPE (cpu)" "hadamard (cpu)" --repeats 2 --new-tokens 60 --warmup 8
b fp32_b1_4096 --settings fp32-b1 --lengths 4096 --only "R128 (cpu)" "preRoPE (cpu)" "hadamard (cpu)" --repeats 2 --new-tokens 60 --warmup 8
b fp32_b1_512 --settings fp32-b1 --lengths 512 --only "R128 (cpu)" "preRoPE (cpu)" "hadamard (cpu)" --repeats 3 --new-tokens 120 --warmup 8
b fp32_b4_512 --settings fp32-b4 --lengths 512 --only "R128 (cpu)" "preRoPE (cpu)" --repeats 2 --new-tokens 100 --warmup 8
b fp32_b4_4096 --settings fp32-b4 --lengths 4096 --only "R128 (cpu)" "preRoPE (cpu)" --repeats 1 --new-tokens 60 --warmup 8
b fp32_b4_8192 --settings fp32-b4 --lengths 8192 --only "R128 (cpu)" "preRoPE (cpu)" --repeats 1 --new-tokens 40 --warmup 8
b bf16_b1_512 --settings bf16-b1 --lengths 512 --only "R128 (cpu)" "preRoPE (cpu)" --repeats 3 --new-tokens 200 --warmup 8
b bf16_b1_4096 --settings bf16-b1 --lengths 4096 --only "R128 (cpu)" "preRoPE (cpu)" --repeats 3 --new-tokens 60 --warmup 8
b bf16_b1_8192 --settings bf16-b1 --lengths 8192 --only "R128 (cpu)" "preRoPE (cpu)" --repeats 3 --new-tokens 60 --warmup 8
echo ALLDONE
