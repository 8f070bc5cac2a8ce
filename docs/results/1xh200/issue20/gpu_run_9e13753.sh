# Issue 20 after the move, on one H200 (run from the repository root with $OUT set): the GPU tests,
# then the default verify (it must say in one line why it runs on CPU processes) and the single-rank
# GPU measurement it points to.
set -x
python3 -m pytest -m gpu -q -p no:cacheprovider -n 0 tests/test_gpu.py 2>&1 | tail -5 > $OUT/pytest_gpu.txt
( time zerolens verify --out /tmp/v-default ) > $OUT/verify-default.log 2>&1
( time zerolens verify --nproc 1 --device cuda --out /tmp/v-n1 ) > $OUT/verify-n1-cuda.log 2>&1
cp /tmp/v-n1/summary.json $OUT/verify-n1-cuda-summary.json
git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
