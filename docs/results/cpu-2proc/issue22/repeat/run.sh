#!/usr/bin/env bash
# Wall time of plan (gpt-1b, 8 ranks, 24 GiB) and estimate (Llama-2-70B's shape, 64 ranks, every strategy)
# before (BASE: a checkout of 22f73f3, whose traces take three steps) and after predict/repeat.py (this tree),
# one after the other on this 2-core machine, nothing else running, and whether the JSONs agree.
# From the repository root: BASE=/path/to/checkout-of-22f73f3 bash docs/results/cpu-2proc/issue22/repeat/run.sh
set -u
here=docs/results/cpu-2proc/issue22/repeat
: > $here/times.log
for tree in "$BASE" "$PWD"; do
  tag=$(git -C "$tree" rev-parse --short HEAD)
  for job in plan estimate70b; do
    if [ $job = plan ]; then args=(plan --gpu-memory 24GiB --nproc 8 --preset gpt-1b --json)
    else args=(estimate --model hf:examples/hf/llama2-70b.json --nproc 64 --micro-batch 1 --seq-len 4096 --precision bf16 --json); fi
    start=$(date +%s.%N)
    PYTHONPATH=$tree/src python3 -m zerolens "${args[@]}" > /tmp/repeat-$job-$tag.json 2>/dev/null
    rc=$? end=$(date +%s.%N)
    echo "{\"tree\": \"$tag\", \"job\": \"$job\", \"command\": \"zerolens ${args[*]}\", \"exit_code\": $rc, \"wall_s\": $(echo "$end - $start" | bc)}" >> $here/times.log
  done
done
python3 - "$(git -C "$BASE" rev-parse --short HEAD)" "$(git rev-parse --short HEAD)" >> $here/times.log <<'PY'
import json, sys
def strip(d):
    if isinstance(d, dict):
        return {k: strip(v) for k, v in d.items() if k != "seconds"}
    return [strip(x) for x in d] if isinstance(d, list) else d
for job in ("plan", "estimate70b"):
    a, b = (json.load(open(f"/tmp/repeat-{job}-{tag}.json")) for tag in sys.argv[1:])
    print(json.dumps({"job": job, "seconds": [a.get("seconds"), b.get("seconds")],
                      "same_json_but_seconds": strip(a) == strip(b)}))
PY
cat $here/times.log
