# One GPU (run from the repository root with $OUT set), issue 25 run9, after bench's speed defaults on GPUs
# turned DeepSpeed's bf16 overflow check off:
# 1. gpt-1b bench with bench's defaults (ddp and zero2, each beside its reference loop) but one round,
#    not 3, for the device time left (the rounds change no MFU, only how many ratios there are);
# 2. the two 1-GPU tests run8's time limit cut (bench with its defaults on gpt-tiny; one GPU visible).
set -x
nvidia-smi -L > $OUT/device.txt; git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
( time timeout 290 zerolens bench --nproc 1 --device cuda --preset gpt-1b --rounds 1 --out /tmp/bench-1b ) \
    > $OUT/bench-gpt-1b-defaults.log 2>&1
cp /tmp/bench-1b/bench.json $OUT/bench-gpt-1b-defaults.json; cp /tmp/bench-1b/bench.md $OUT/bench-gpt-1b-defaults.md
( time timeout 230 python3 -m pytest -m gpu -q -p no:cacheprovider -n 0 --durations=0 tests/test_gpu.py \
    -k "bench_on_one_gpu or one_gpu_visible" ) > $OUT/pytest_gpu.txt 2>&1
