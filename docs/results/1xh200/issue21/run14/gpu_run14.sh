# One H200, issue 21: plan --check after the kernels' own buffers joined the allocator model (1f9b489's tree),
# the default allocator, N=1: the predicted smallest cap should run, 1% below it run out of memory.
# Run from the repository root with $OUT set.
set -x
timeout 230 zerolens plan --nproc 1 --preset gpt-1b --gpu-memory 140GiB --strategies ddp,zero2 --micro-batches 8 \
  --no-depth --check 2 --json > $OUT/plan-check-gpt-1b.json 2> $OUT/plan-check-gpt-1b.log
timeout 170 zerolens plan --nproc 1 --preset gpt-100m --gpu-memory 140GiB --strategies ddp,zero2,fsdp2 --micro-batches 8 \
  --no-depth --check 3 --json > $OUT/plan-check-gpt-100m.json 2> $OUT/plan-check-gpt-100m.log
timeout 110 zerolens plan --nproc 1 --gpu-memory 140GiB --no-depth --check 1 --strategies ddp --model hf:gpt2 --micro-batch 8 \
  --seq-len 1024 --micro-batches 8 --json > $OUT/plan-check-gpt2.json 2> $OUT/plan-check-gpt2.log
for f in $OUT/plan-check-*.json; do python3 -c "
import json,sys; d = json.load(open('$f'))
for c in d.get('checked', []): print('$f'.split('/')[-1], json.dumps(c)[:600])
"; done
git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
