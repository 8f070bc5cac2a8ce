# One H200 (run from the repository root with $OUT set), issue 25 run6:
# 1. gpt-1b bench with bench's defaults on a GPU (ddp and zero2; fused AdamW, compiled blocks, micro-batch 16;
#    each beside its reference loop), one round for the call's time;
# 2. the GPU tests;
# (step_profile.py, where ZeRO-2's and DDP's step time goes, was left out for the device time left)
set -x
( time timeout 210 zerolens bench --nproc 1 --device cuda --preset gpt-1b --rounds 1 --out /tmp/bench-1b ) \
    > $OUT/bench-gpt-1b-defaults.log 2>&1
cp /tmp/bench-1b/bench.json $OUT/bench-gpt-1b-defaults.json
( time timeout 290 python3 -m pytest -m gpu -q -p no:cacheprovider -n 0 tests/test_gpu.py ) > $OUT/pytest_gpu.txt 2>&1
# (step_profile.py left out of this call for its device time)
git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
