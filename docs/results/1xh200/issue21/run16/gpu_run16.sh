# One H200: tests/test_without_gpu.py's fixture recorded again after the trace's changes of run15 (DDP's
# broadcast buckets, autograd's in-place sums, the cuBLAS workspaces at the first matrix product, the
# embedding backward's buffers); then plan --check on gpt-1b's DDP at its new predicted smallest cap.
set -x
timeout 100 python3 scripts/trace_without_gpu.py --out "$OUT/traces.json" --jobs 15 \
  --points case-study-mb16,hf-gpt2-tiny-mb4,hf-llama-tiny-mb4 \
  --fixture tests/fixtures/gpu_trace/peaks.json > "$OUT/traces.log" 2>&1
cp tests/fixtures/gpu_trace/peaks.json "$OUT/peaks.json"; tail -n 5 "$OUT/traces.log"
timeout 130 zerolens plan --nproc 1 --preset gpt-1b --gpu-memory 140GiB --strategies ddp --micro-batches 8 \
  --no-depth --check 1 --json > $OUT/plan-check-gpt-1b-ddp.json 2> $OUT/plan-check-gpt-1b-ddp.log
python3 -c "
import json; d = json.load(open('$OUT/plan-check-gpt-1b-ddp.json'))
for c in d.get('checked', []): print(json.dumps(c))
"
git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
