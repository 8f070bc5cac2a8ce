# One H200 (run from the repository root with $OUT set), issue 25 run7, right after run6 on the same machine:
# gpt-1b bench at micro-batch 32 with bench's other defaults (fused AdamW, compiled blocks), ddp and zero2,
# one round, no reference loop: does ZeRO-2's fixed per-step cost at N=1 fall below 50% MFU's margin there?
set -x
( time timeout 170 zerolens bench --nproc 1 --device cuda --preset gpt-1b --micro-batch 32 --rounds 1 --no-reference \
    --out /tmp/bench-32 ) > $OUT/bench-gpt-1b-mb32.log 2>&1
cp /tmp/bench-32/bench.json $OUT/bench-gpt-1b-mb32.json
git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
