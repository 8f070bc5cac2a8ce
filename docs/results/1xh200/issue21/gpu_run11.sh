# One H200: the fixture of tests/test_without_gpu.py recorded again now that the trace numbers each allocation's
# stream (FSDP2's side streams change its smallest caps at N=2), with the CPU trace beside the GPU's on more points.
set -x
timeout 500 python3 scripts/trace_without_gpu.py --out "$OUT/traces-streams.json" --jobs 15 \
  --points case-study-mb16,hf-gpt2-tiny-mb4,hf-llama-tiny-mb4,gpt-100m-mb8,gpt-100m-mb16-ckpt,gpt-1b-mb8 \
  --fixture tests/fixtures/gpu_trace/peaks.json > "$OUT/traces-streams.log" 2>&1
cp tests/fixtures/gpu_trace/peaks.json "$OUT/peaks.json"
tail -n 12 "$OUT/traces-streams.log"
