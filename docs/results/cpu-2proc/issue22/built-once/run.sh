#!/usr/bin/env bash
# Wall time of estimate (Llama-2-70B's shape, every strategy, at 512 and 4096 ranks) and plan (gpt-1b, 8 ranks,
# 24 GiB) before (BASE: a checkout of 645e498) and after this session's changes (this tree), each job run by the two
# trees one after the other on this 2-core machine, nothing else running; and whether each pair of JSONs agrees but
# for `seconds` (`same_json_but_seconds`), and but for what says which ranks' traces were scaled from shallow ones
# (`same_figures`).
# From the repository root: BASE=/path/to/checkout-of-645e498 bash docs/results/cpu-2proc/issue22/built-once/run.sh
set -u
here=docs/results/cpu-2proc/issue22/built-once
: > $here/times.log
for job in e512 e4096 plan; do
  for tree in "$BASE" "$PWD"; do
    tag=$(git -C "$tree" rev-parse --short HEAD)
    case $job in
      plan) args=(plan --gpu-memory 24GiB --nproc 8 --preset gpt-1b --json) ;;
      *) args=(estimate --model hf:examples/hf/llama2-70b.json --nproc ${job#e} --micro-batch 1 --seq-len 4096
               --precision bf16 --json) ;;
    esac
    start=$(date +%s.%N)
    PYTHONPATH=$tree/src python3 -m zerolens "${args[@]}" > /tmp/builtonce-$job-$tag.json 2>/dev/null
    rc=$? end=$(date +%s.%N)
    echo "{\"tree\": \"$tag\", \"job\": \"$job\", \"command\": \"zerolens ${args[*]}\", \"exit_code\": $rc, \"wall_s\": $(echo "$end - $start" | bc)}" >> $here/times.log
  done
done
python3 - "$(git -C "$BASE" rev-parse --short HEAD)" "$(git rev-parse --short HEAD)" >> $here/times.log <<'PY'
import json, sys
DEPTH_KEYS = {"depth_scaled_from", "why_not_depth_scaled", "depth_scaled_ranks"}
def strip(d, keys):
    if isinstance(d, dict):
        return {k: strip(v, keys) for k, v in d.items() if k not in keys}
    return [strip(x, keys) for x in d] if isinstance(d, list) else d
for job in ("e512", "e4096", "plan"):
    a, b = (json.load(open(f"/tmp/builtonce-{job}-{tag}.json")) for tag in sys.argv[1:])
    print(json.dumps({"job": job, "seconds": [a.get("seconds"), b.get("seconds")],
                      "same_json_but_seconds": strip(a, {"seconds"}) == strip(b, {"seconds"}),
                      "same_figures": strip(a, {"seconds"} | DEPTH_KEYS) == strip(b, {"seconds"} | DEPTH_KEYS)}))
PY
cat $here/times.log
