# The second call (same machine kind): gpt-1b's DDP as gpu_run.sh, at 1% below the downward order's cap
# (24316477440 x 0.99 bytes): does it run out of memory, as plan --check expects there?
set -x
nvidia-smi -L > $OUT/device.txt; git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
cap=24073312665
gib=$(python3 -c "print($cap / 2**30)")
( time timeout 140 zerolens bench --nproc 1 --device cuda --preset gpt-1b --strategies ddp --micro-batch 4 \
    --no-compile --no-fused-adam --warmup 2 --steps 2 --rounds 1 --no-reference --memory-limit-gib $gib \
    --out /tmp/bench-cap-$cap ) > $OUT/bench-ddp-mb4-cap-$cap.log 2>&1
cp /tmp/bench-cap-$cap/bench.json $OUT/bench-ddp-mb4-cap-$cap.json 2>/dev/null
tail -4 $OUT/bench-ddp-mb4-cap-$cap.log
