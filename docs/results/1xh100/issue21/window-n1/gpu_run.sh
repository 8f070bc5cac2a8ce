# One GPU (from the repository root, $OUT set): the allocator model's window of caps above the smallest cap
# (docs/results/cpu-2proc/issue21/window-n1/): gpt-1b DDP with activation checkpointing at micro-batch 16, N=1,
# bf16, foreach AdamW, no compile. Predicted: runs at its smallest cap (27355250688 bytes), out of memory in the
# window's middle (28101836800) in the third step, runs 32 MiB above the window (28365029376).
nvidia-smi -L > $OUT/device.txt; git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
mkdir -p /tmp/benches
for gib in 25.4765625 26.171875 26.416015625; do
  ( time timeout 150 zerolens bench --nproc 1 --device cuda --preset gpt-1b --strategies ddp --micro-batch 16 \
      --activation-checkpointing --no-compile --no-fused-adam --warmup 2 --steps 2 --rounds 1 --no-reference \
      --memory-limit-gib $gib --out /tmp/benches/cap-$gib ) > $OUT/bench-cap-$gib.log 2>&1
  tail -3 $OUT/bench-cap-$gib.log
done
tar czf $OUT/benches.tgz -C /tmp benches
