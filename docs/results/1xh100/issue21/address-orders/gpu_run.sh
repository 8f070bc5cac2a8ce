# One GPU (run from the repository root with $OUT set), issue 21: which address order the allocator model
# should follow where the two disagree. gpt-1b's DDP at N=1, micro-batch 4, bf16, no compile, foreach AdamW
# (the settings orders.py traced): its smallest cap with each new segment below the last is 24316477440
# bytes, above it 23794286592 (498 MiB less; orders-gpt-1b-n1-cpu.jsonl). bench at each cap: does it run?
set -x
nvidia-smi -L > $OUT/device.txt; git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
for cap in 23794286592 24316477440; do
  gib=$(python3 -c "print($cap / 2**30)")
  ( time timeout 140 zerolens bench --nproc 1 --device cuda --preset gpt-1b --strategies ddp --micro-batch 4 \
      --no-compile --no-fused-adam --warmup 2 --steps 2 --rounds 1 --no-reference --memory-limit-gib $gib \
      --out /tmp/bench-cap-$cap ) > $OUT/bench-ddp-mb4-cap-$cap.log 2>&1
  cp /tmp/bench-cap-$cap/bench.json $OUT/bench-ddp-mb4-cap-$cap.json 2>/dev/null
  tail -4 $OUT/bench-ddp-mb4-cap-$cap.log
done
