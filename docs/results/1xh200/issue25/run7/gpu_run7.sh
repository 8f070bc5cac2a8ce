# One H200 (run from the repository root with $OUT set), issue 25 run7, right after run6 on the same machine,
# gpt-1b with bench's defaults otherwise (fused AdamW, compiled blocks), one round, no reference loop:
# 1. zero2 at micro-batch 16 without DeepSpeed's bf16 overflow check (each gradient's amax/amin and a host
#    synchronisation before the step; bf16 needs no loss scaling, and DDP checks nothing);
# 2. ddp and zero2 at micro-batch 32: does ZeRO-2's fixed per-step cost at N=1 weigh less there?
set -x
( time timeout 90 zerolens bench --nproc 1 --device cuda --preset gpt-1b --strategies zero2 --rounds 1 --no-reference \
    --ds-override '{"bf16": {"check_grad_overflow": false}}' --out /tmp/bench-noov ) > $OUT/bench-gpt-1b-zero2-no-overflow-check.log 2>&1
cp /tmp/bench-noov/bench.json $OUT/bench-gpt-1b-zero2-no-overflow-check.json
( time timeout 130 zerolens bench --nproc 1 --device cuda --preset gpt-1b --micro-batch 32 --rounds 1 --no-reference \
    --out /tmp/bench-32 ) > $OUT/bench-gpt-1b-mb32.log 2>&1
cp /tmp/bench-32/bench.json $OUT/bench-gpt-1b-mb32.json
git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
