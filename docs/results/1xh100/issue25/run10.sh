# One GPU (run from the repository root with $OUT set), issue 25 run10:
# 1. (a call before) mfu_knobs2.py: gpt-1b in a plain loop, bench's run9 defaults against the loss compiled
#    and micro-batch 24 and 32: `torchrun --nproc-per-node 1 run10/mfu_knobs2.py $OUT/mfu_knobs2.json`;
# 2. then, with bench's new GPU defaults (loss compiled with the blocks, micro-batch 32): gpt-1b bench, ddp and
#    zero2 beside their reference loops, one round for the device time left, and the 1-GPU bench test.
set -x
nvidia-smi -L > $OUT/device.txt; git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
( time timeout 330 zerolens bench --nproc 1 --device cuda --preset gpt-1b --rounds 1 --out /tmp/bench-1b ) \
    > $OUT/bench-gpt-1b-defaults.log 2>&1
cp /tmp/bench-1b/bench.json $OUT/bench-gpt-1b-defaults.json; cp /tmp/bench-1b/bench.md $OUT/bench-gpt-1b-defaults.md
( time timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -n 0 --durations=0 tests/test_gpu.py \
    -k "bench_on_one_gpu" ) > $OUT/pytest_gpu.txt 2>&1
