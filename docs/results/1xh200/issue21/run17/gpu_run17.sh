# One H200, N=1, at a188ce8's tree: the GPU tests first (not run since 99c941a), then plan --check on gpt-1b
# (micro-batch 8, default allocator) for ZeRO-1, ZeRO-2 and FSDP2: each runs at its predicted smallest cap
# and 1% below it. ZeRO-1's cap moved by 1 GiB with the cuBLAS workspaces' placement (run15/16): checked here.
set -x
timeout 330 python3 -m pytest -m gpu -q -n 0 -p no:cacheprovider > $OUT/pytest_gpu.txt 2>&1; tail -n 4 $OUT/pytest_gpu.txt
timeout 240 zerolens plan --nproc 1 --preset gpt-1b --gpu-memory 140GiB --strategies zero1,zero2,fsdp2-grad \
  --micro-batches 8 --no-depth --check 3 --json --out /tmp/plan-zero > $OUT/plan-check-gpt-1b-zero.json 2> $OUT/plan-check-gpt-1b-zero.err
python3 - "$OUT/plan-check-gpt-1b-zero.json" <<'PY'
import json, sys
try:
    plan = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(f"{sys.argv[1]}: no JSON ({e})")
print(plan["command"], "| allocator:", plan["allocator_setting"], "| predicted in", plan["seconds"], "s")
for c in plan.get("checked", []):
    print(c["strategy"], "mb", c["micro_batch"], "ckpt", c["checkpointing"], "cap", c["predicted_cap_bytes"],
          "at cap:", c["runs_at_cap"], "1% below:", c["runs_below_cap"], "measured reserved",
          c.get("measured_reserved_peak_bytes"), "measured peak", c.get("measured_peak_bytes"),
          "predicted peak", c["predicted_peak_bytes"])
PY
tail -n 3 $OUT/plan-check-gpt-1b-zero.err
git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
