# One H200, N=1: the model's smallest cap against the allocator for recordings with expandable segments and
# roundup_power2_divisions (allocator_caps.py), then plan --check on gpt-100m (default allocator) and on
# TinyLlama-1.1B (expandable segments): each candidate run at its predicted smallest cap and 1% below it.
set -x
timeout 150 python3 scripts/allocator_caps.py tests/fixtures/allocator/case-study-expandable.json.gz \
  tests/fixtures/allocator/gpt2-expandable.json.gz tests/fixtures/allocator/gpt2-roundup4.json.gz \
  --bisect 3 > $OUT/caps-options.json 2> $OUT/caps-options.err
timeout 200 zerolens plan --nproc 1 --preset gpt-100m --gpu-memory 140GiB --strategies ddp,zero2,fsdp2 \
  --micro-batches 8 --no-depth --check 3 --json --out /tmp/plan-gpt-100m > $OUT/plan-gpt-100m.json 2> $OUT/plan-gpt-100m.err
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 170 zerolens plan --nproc 1 \
  --model hf:examples/hf/tinyllama-1.1b.json --micro-batch 4 --gpu-memory 140GiB --strategies ddp,fsdp2 \
  --micro-batches 4 --no-depth --check 2 --json --out /tmp/plan-tinyllama > $OUT/plan-tinyllama-expandable.json 2> $OUT/plan-tinyllama.err
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
for name in ("plan-gpt-100m.json", "plan-tinyllama-expandable.json"):
    try:
        plan = json.load(open(f"{out}/{name}"))
    except Exception as e:
        print(name, "no JSON:", e); continue
    for c in plan.get("checked", []):
        print(name, c["strategy"], c["micro_batch"], "cap", c["predicted_cap_bytes"], "at cap:", c["runs_at_cap"],
              "1% below:", c["runs_below_cap"], "measured reserved", c.get("measured_reserved_peak_bytes"))
caps = json.load(open(f"{out}/caps-options.json"))
for path, e in caps.items():
    print(os.path.basename(path), e["alloc_conf"], "predicted", e["predicted_smallest_cap_bytes"], "at cap:", e["runs_at_cap"],
          "2 MiB below:", e["runs_2_MiB_below"], e.get("real_smallest_cap_above_and_at_most"))
PY
tail -n 3 $OUT/*.err
