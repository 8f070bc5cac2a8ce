# One H200 (run from the repository root with $OUT set), issue 25 run6:
# 1. the GPU tests;
# 2. gpt-1b bench with bench's defaults on a GPU (ddp and zero2; fused AdamW, compiled blocks, micro-batch 16;
#    each beside its reference loop), one round for the device time left.
# (step_profile.py, where ZeRO-2's and DDP's step time goes, was left out for the device time left)
set -x
( time timeout 290 python3 -m pytest -m gpu -q -p no:cacheprovider -n 0 tests/test_gpu.py ) > $OUT/pytest_gpu.txt 2>&1
( time timeout 185 zerolens bench --nproc 1 --device cuda --preset gpt-1b --rounds 1 --out /tmp/bench-1b ) \
    > $OUT/bench-gpt-1b-defaults.log 2>&1
cp /tmp/bench-1b/bench.json $OUT/bench-gpt-1b-defaults.json
git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
