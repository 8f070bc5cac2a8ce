# One GPU (run from the repository root with $OUT set), issue 25 run9, after bench's speed defaults on GPUs
# turned DeepSpeed's bf16 overflow check off:
# 1. gpt-1b bench with bench's defaults (ddp and zero2, 3 interleaved rounds, each beside its reference loop);
# 2. the two 1-GPU tests run8's time limit cut (bench with its defaults on gpt-tiny; one GPU visible).
set -x
nvidia-smi -L > $OUT/device.txt; git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
( time timeout 400 zerolens bench --nproc 1 --device cuda --preset gpt-1b --out /tmp/bench-1b ) \
    > $OUT/bench-gpt-1b-defaults.log 2>&1
cp /tmp/bench-1b/bench.json $OUT/bench-gpt-1b-defaults.json; cp /tmp/bench-1b/bench.md $OUT/bench-gpt-1b-defaults.md
( time timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider -n 0 --durations=0 tests/test_gpu.py \
    -k "bench_on_one_gpu or one_gpu_visible" ) > $OUT/pytest_gpu.txt 2>&1
