set -x
cd /tmp/wt
P=/work/main/.venv/bin/python
O=/tmp/r13/run13b
b() { name=$1; shift; echo "== $name $(date -u +%H:%M:%S)"; $P scripts/bench_cache.py "$@" --json $O/$name.json > $O/$name.md 2> $O/$name.err; echo "== done $name $(date -u +%H:%M:%S) rc=$?"; }
b bf16_b1_4096 --settings bf16-b1 --lengths 4096 --only "R128 (cpu)" "preRoPE (cpu)" --repeats 1 --new-tokens 60 --warmup 8
b bf16_b1_8192 --settings bf16-b1 --lengths 8192 --only "R128 (cpu)" "preRoPE (cpu)" --repeats 1 --new-tokens 60 --warmup 8
echo ALLDONE
