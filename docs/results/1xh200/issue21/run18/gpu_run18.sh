# One H200, N=1. run17's pytest ran out of its 330 s in the 10th test (the 9 before: 2 passed, 7 need 2 GPUs)
# and its plan --check out of 240 s while tracing. Here: the single-rank GPU test that did not finish, then
# the caps of gpt-1b's ZeRO-1, ZeRO-2 and FSDP2 (bf16, micro-batch 8, default allocator), predicted on the
# CPU machine beforehand (caps.sh: zerolens estimate ... --json, traced without a GPU for compute capability
# 9.0), each run as plan --check runs it: bench, one warm-up and two timed steps, the allocator capped at the
# predicted smallest cap and at 1% below it (rounded down to 2 MiB).
set -x
timeout 240 python3 -m pytest -m gpu -q -n 0 -p no:cacheprovider tests/test_gpu.py -k single_rank > $OUT/pytest_gpu_single_rank.txt 2>&1
tail -n 3 $OUT/pytest_gpu_single_rank.txt
while read strategy cap below; do
  for limit in $cap $below; do
    timeout 90 zerolens bench --nproc 1 --device cuda --preset gpt-1b --micro-batch 8 --strategies $strategy \
      --warmup 1 --steps 2 --memory-limit-gib $limit --out /tmp/cap-$strategy-$limit > $OUT/bench-$strategy-$limit.log 2>&1
    echo "$strategy limit $limit GiB: rc $?"; grep -h -o "out of memory[^.]*" $OUT/bench-$strategy-$limit.log | head -n 1
    cp /tmp/cap-$strategy-$limit/bench.json $OUT/bench-$strategy-$limit.json 2>/dev/null
  done
done <<'CAPS'
zero1 23.943359375 23.703125
zero2 24.716796875 24.46875
fsdp2-grad 23.427734375 23.193359375
CAPS
git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
