# One H200, issue 21 (micro-batch scaling on fake CUDA tensors), issue 20 (the default verify's peaks on torch 2.11),
# issue 25 (the harness's overhead against the reference loops). Run from the repository root with $OUT set.
set -x
R=docs/results/1xh200/issue21/run12
timeout 100 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_micro_batches.py 2>&1 | tail -4 > $OUT/pytest_micro_batches.txt
( time timeout 40 zerolens verify --out /tmp/v-default ) > $OUT/verify-default.log 2>&1
timeout 110 python3 $R/scaled_vs_traced.py gpt-1b 8 zero2,fsdp2,ddp > $OUT/scaled_vs_traced.jsonl 2> $OUT/scaled_vs_traced.err
( time timeout 320 zerolens bench --nproc 1 --device cuda --preset gpt-1b --strategies ddp,zero2 --out /tmp/bench ) > $OUT/bench-gpt-1b.log 2>&1
cp /tmp/bench/bench.json $OUT/bench-gpt-1b.json
git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
