# One H200 (run from the repository root with $OUT set), issue 25 run4 and issue 21's TinyLlama check:
# 1. gpt-1b's step time knob by knob in a plain loop (mfu_knobs.py);
# 2. zerolens bench of gpt-1b, ddp and zero2, with --fused-adam --compile (one round, no reference loop);
# 3. issue 21: TinyLlama-1.1B's DDP (micro-batch 4) capped at run19's predicted smallest cap plus 64 MiB
#    (31910264832 + 67108864 bytes = 29.78125 GiB): does it run there?
set -x
timeout 300 python3 docs/results/1xh200/issue25/run4/mfu_knobs.py $OUT/mfu_knobs.json > $OUT/mfu_knobs.log 2>&1
( time timeout 200 zerolens bench --nproc 1 --device cuda --preset gpt-1b --strategies ddp,zero2 --fused-adam --compile \
    --rounds 1 --no-reference --out /tmp/bench-fc ) > $OUT/bench-gpt-1b-fused-compile.log 2>&1
cp /tmp/bench-fc/bench.json $OUT/bench-gpt-1b-fused-compile.json
( time timeout 120 zerolens bench --nproc 1 --device cuda --model hf:examples/hf/tinyllama-1.1b.json --micro-batch 4 \
    --strategies ddp --rounds 1 --no-reference --memory-limit-gib 29.78125 --out /tmp/bench-tl ) > $OUT/tinyllama-cap-plus-64MiB.log 2>&1
cp /tmp/bench-tl/bench.json $OUT/tinyllama-cap-plus-64MiB.json
git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
