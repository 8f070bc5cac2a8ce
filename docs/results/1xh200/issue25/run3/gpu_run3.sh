# One H200 (run from the repository root with $OUT set): the harness's overhead on gpt-1b's DDP after the
# heartbeat is rewritten in place; the micro-batch scaling tests on fake CUDA tensors; the GPU tests.
set -x
( time timeout 170 zerolens bench --nproc 1 --device cuda --preset gpt-1b --strategies ddp --out /tmp/bench ) > $OUT/bench-gpt-1b-ddp.log 2>&1
cp /tmp/bench/bench.json $OUT/bench-gpt-1b-ddp.json
timeout 60 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_micro_batches.py 2>&1 | tail -4 > $OUT/pytest_micro_batches.txt
timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider -n 0 tests/test_gpu.py 2>&1 | tail -5 > $OUT/pytest_gpu.txt
git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
