# Issue 25, run2, on one H200 (run from the repository root with $OUT set): the GPU tests, and where
# gpt-1b's step time goes under ddp and zero2 (one round, N=1).
set -x
python3 -m pytest -m gpu -q -p no:cacheprovider -n 0 tests/test_gpu.py 2>&1 | tail -5 > $OUT/pytest_gpu.txt
zerolens bench --nproc 1 --device cuda --preset gpt-1b --rounds 1 --out /tmp/gpt1b > $OUT/gpt1b_breakdown.log 2>&1
cp /tmp/gpt1b/bench.json $OUT/gpt1b_breakdown_bench.json; cp /tmp/gpt1b/bench.md $OUT/gpt1b_breakdown_bench.md
git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
