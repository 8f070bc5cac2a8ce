# One H200, N=1: TinyLlama-1.1B's DDP (micro-batch 4, default allocator) benched at run19's predicted smallest cap
# (31910264832 bytes), where it ran out of memory: the log says in which phase and how many bytes it asked for.
timeout 150 zerolens bench --nproc 1 --device cuda --model hf:examples/hf/tinyllama-1.1b.json --micro-batch 4 \
  --strategies ddp --warmup 1 --steps 2 --rounds 1 --no-reference --memory-limit-gib 29.71875 --out /tmp/tl-cap \
  > $OUT/bench-tinyllama-ddp-at-cap.log 2>&1
echo "rc $?"; grep -h "out of GPU memory\|tried to allocate\|peak" $OUT/bench-tinyllama-ddp-at-cap.log | head -5
