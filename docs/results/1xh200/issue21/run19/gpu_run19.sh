# One H200, N=1: plan --check of DDP with the default allocator on GPT-2 (sequence 1024, micro-batch 8) and
# TinyLlama-1.1B (micro-batch 4), against the trace as it is now (GPT-2's DDP ran out of memory at its
# predicted cap in hf-check/, before the cuBLAS workspaces' place and the counted allocated peak changed;
# TinyLlama's check never finished). Each runs at its predicted smallest cap and 1% below it.
for case in gpt2 tinyllama; do
  case $case in
    gpt2) model=(--model hf:gpt2 --micro-batch 8 --seq-len 1024 --micro-batches 8) ;;
    tinyllama) model=(--model hf:examples/hf/tinyllama-1.1b.json --micro-batch 4 --micro-batches 4) ;;
  esac
  timeout 250 zerolens plan --nproc 1 --gpu-memory 140GiB --no-depth --check 1 --strategies ddp "${model[@]}" \
    --json --out /tmp/plan-$case > $OUT/plan-check-$case-ddp-default.json 2> $OUT/plan-check-$case-ddp-default.err
  echo "$case: rc $?"
  python3 - "$OUT/plan-check-$case-ddp-default.json" <<'PY'
import json, sys
try:
    plan = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(f"{sys.argv[1]}: no JSON ({e})")
print(plan["command"], "| allocator:", plan["allocator_setting"], "| predicted in", plan["seconds"], "s")
for c in plan.get("checked", []):
    print(c["strategy"], "mb", c["micro_batch"], "cap", c["predicted_cap_bytes"], "at cap:", c["runs_at_cap"],
          "1% below:", c["runs_below_cap"], "measured reserved", c.get("measured_reserved_peak_bytes"),
          "measured peak", c.get("measured_peak_bytes"), "predicted peak", c["predicted_peak_bytes"])
PY
  tail -n 3 $OUT/plan-check-$case-ddp-default.err
done
git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
