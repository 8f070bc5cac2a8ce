# One H200, N=1, after the peak trace numbers the stream each allocation is made on (FSDP2's all-gather
# and reduce-scatter streams): the GPU tests; FSDP2's real allocator histories beside the trace's
# (record_strategy_allocator.py, compare_trace.py); plan --check on gpt-100m's FSDP2 strategies.
set -x
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests > $OUT/pytest_gpu_run9.txt 2>&1; tail -n 3 $OUT/pytest_gpu_run9.txt
for s in fsdp2 fsdp2-grad; do
  timeout 120 python3 scripts/record_strategy_allocator.py --strategy $s --model gpt-100m --micro-batch 8 \
    --out "$OUT/gpt-100m-$s.json.gz" 2>&1 | grep -v WARN | tail -n 2
done
timeout 120 python3 docs/results/1xh200/issue21/compare_trace.py $OUT/gpt-100m-*.json.gz > $OUT/trace_vs_gpu_fsdp2.json
cat $OUT/trace_vs_gpu_fsdp2.json
timeout 200 zerolens plan --nproc 1 --preset gpt-100m --gpu-memory 140GiB --strategies fsdp2,fsdp2-grad \
  --micro-batches 8 --no-depth --check 2 --json --out /tmp/plan-fsdp2 > $OUT/plan-check-fsdp2.json 2> $OUT/plan-check-fsdp2.err
python3 - <<'PY'
import json, os
plan = json.load(open(os.environ["OUT"] + "/plan-check-fsdp2.json"))
for c in plan.get("checked", []):
    print(c["strategy"], "cap", c["predicted_cap_bytes"], "at cap:", c["runs_at_cap"], "1% below:", c["runs_below_cap"],
          "measured reserved", c.get("measured_reserved_peak_bytes"))
PY
tail -n 3 $OUT/plan-check-fsdp2.err
