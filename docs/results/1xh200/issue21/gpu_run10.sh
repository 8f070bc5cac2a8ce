# One H200, N=1: plan --check on two Hugging Face models (GPT-2 at sequence 1024, micro-batch 8; TinyLlama-1.1B,
# micro-batch 4), ddp and fsdp2-grad, under the allocator setting given as $1 ("" = default, or
# expandable_segments:True), models as $2 (gpt2 | tinyllama). Each candidate runs at its predicted smallest cap
# and 1% below it.
set -x
conf=$1
tag=$([ -z "$conf" ] && echo default || echo expandable)
case $2 in
  gpt2) model=(--model hf:gpt2 --micro-batch 8 --seq-len 1024 --micro-batches 8) ;;
  tinyllama) model=(--model hf:examples/hf/tinyllama-1.1b.json --micro-batch 4 --micro-batches 4) ;;
esac
PYTORCH_CUDA_ALLOC_CONF=$conf timeout 270 zerolens plan --nproc 1 --gpu-memory 140GiB --no-depth --check 2 \
  --strategies ddp,fsdp2-grad "${model[@]}" --json --out /tmp/plan-$2-$tag > $OUT/plan-check-$2-$tag.json 2> $OUT/plan-check-$2-$tag.err
python3 - "$OUT/plan-check-$2-$tag.json" <<'PY'
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
tail -n 3 $OUT/plan-check-$2-$tag.err
