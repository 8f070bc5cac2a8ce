# One H200 (run from the repository root with $OUT set), issue 25 run6:
# 1. gpt-1b bench with bench's defaults on a GPU (ddp and zero2; fused AdamW, compiled blocks, micro-batch 16;
#    each beside its reference loop), one round for the call's time;
# 2. the GPU tests;
# 3. where ZeRO-2's and DDP's step time goes at N=1, micro-batch 8 (step_profile.py: plain loops, torch.profiler).
set -x
( time timeout 210 zerolens bench --nproc 1 --device cuda --preset gpt-1b --rounds 1 --out /tmp/bench-1b ) \
    > $OUT/bench-gpt-1b-defaults.log 2>&1
cp /tmp/bench-1b/bench.json $OUT/bench-gpt-1b-defaults.json
( time timeout 290 python3 -m pytest -m gpu -q -p no:cacheprovider -n 0 tests/test_gpu.py ) > $OUT/pytest_gpu.txt 2>&1
timeout 75 python3 docs/results/1xh200/issue25/run6/step_profile.py $OUT/step_profile.json > $OUT/step_profile.log 2>&1
git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
