# One H200, issue 21: why gpt-1b's DDP runs out of memory at its predicted smallest cap. The allocator
# recorded under zerolens's DDP beside the peak trace (kernel buffers included), the embedding
# backward's own requests, and the GPU tests. Run from the repository root with $OUT set.
set -x
timeout 200 python3 scripts/record_strategy_allocator.py --strategy ddp --model gpt-1b --micro-batch 8 \
  --out "$OUT/gpt-1b-ddp.json.gz" > $OUT/record.log 2>&1; tail -4 $OUT/record.log
timeout 60 python3 scripts/embedding_backward_events.py --out $OUT/embedding_backward.json > $OUT/embedding.log 2>&1; tail -3 $OUT/embedding.log
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider > $OUT/pytest_gpu.txt 2>&1; tail -4 $OUT/pytest_gpu.txt
git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
