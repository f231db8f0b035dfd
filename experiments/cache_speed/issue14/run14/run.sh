# Run 14: the A/A test of the step order, then the issue's rows, from a clean worktree of 881cd65
# (package code dcd77d8d168d5b2d, the same as at 622d27f):
#   git worktree add /tmp/wt14 881cd65 && bash experiments/cache_speed/issue14/run14/run.sh
set -x
cd /tmp/wt14
P=/work/main/.venv/bin/python
O=/tmp/r14
mkdir -p $O
a() { name=$1; shift; echo "== $name $(date -u +%H:%M:%S)"; $P experiments/cache_speed/issue14/run14/aa_test.py "$@" > $O/$name.txt 2> $O/$name.err; echo "== done $name $(date -u +%H:%M:%S)"; }
b() { name=$1; shift; echo "== $name $(date -u +%H:%M:%S)"; $P scripts/bench_cache.py "$@" --json $O/$name.json > $O/$name.md 2> $O/$name.err; echo "== done $name $(date -u +%H:%M:%S) rc=$?"; }
a aa_fixed_bf16_4096 --length 4096 --dtype bf16 --repeats 2 --new-tokens 100 --fixed-order
a aa_orders_bf16_4096 --length 4096 --dtype bf16 --repeats 2 --new-tokens 100
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
