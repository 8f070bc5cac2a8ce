# One GPU (run from the repository root with $OUT set), issue 25 run8:
# 1. the GPU tests on this tree;
# 2. step_profile.py: plain loops (DDP wrapper; DeepSpeed's own loop for ZeRO-2, with and without bf16's
#    overflow check, and with overlap_comm), where ZeRO-2's step time goes at N=1.
set -x
nvidia-smi -L > $OUT/device.txt; git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
( time timeout 400 python3 -m pytest -m gpu -q -p no:cacheprovider -n 0 --durations=0 tests/test_gpu.py ) > $OUT/pytest_gpu.txt 2>&1
( time timeout 170 python3 docs/results/1xh100/issue25/run8/step_profile.py $OUT/step_profile.json ) > $OUT/step_profile.log 2>&1
