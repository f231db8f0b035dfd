# Run 16: the issue's rows on the final code of this pass (run 15's rows, repeats and steps), from a clean tree at
# the commit named in each record's header ("code: ..."), nothing else running:
#   bash experiments/cache_speed/issue14/run16/run.sh        (from the repository root; writes /tmp/r16)
# The same rows, repeats and steps as run 15 (run15/run.sh), for the record of the code this pass ends on.
set -x
P=.venv/bin/python
O=/tmp/r16
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
