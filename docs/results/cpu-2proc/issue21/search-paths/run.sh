#!/usr/bin/env bash
# Wall time of plan (gpt-1b, 8 ranks, 24 GiB) and estimate (Llama-2-70B's shape, every strategy, at 64, 512
# and 4096 ranks) before (BASE: a checkout of 517814e, this session's start) and after this session's
# changes (this tree), the two trees alternating, two rounds of plan, on this 2-core machine with nothing
# else running; and whether each pair of JSONs agrees but for `seconds`.
# From the repository root: BASE=/path/to/checkout-of-517814e bash docs/results/cpu-2proc/issue21/search-paths/run.sh
set -u
here=docs/results/cpu-2proc/issue21/search-paths
: > $here/times.log
for job in plan plan e64 e512 e4096; do
  for tree in "$BASE" "$PWD"; do
    tag=$(git -C "$tree" rev-parse --short HEAD)
    case $job in
      plan) args=(plan --gpu-memory 24GiB --nproc 8 --preset gpt-1b --json) ;;
      *) args=(estimate --model hf:examples/hf/llama2-70b.json --nproc ${job#e} --micro-batch 1 --seq-len 4096
               --precision bf16 --json) ;;
    esac
    start=$(date +%s.%N)
    (cd "$tree" && PYTHONPATH=$tree/src python3 -m zerolens "${args[@]}") > /tmp/searchpaths-$job-$tag.json 2>/dev/null
    rc=$? end=$(date +%s.%N)
    seconds=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1])).get('seconds'))" /tmp/searchpaths-$job-$tag.json)
    echo "{\"tree\": \"$tag\", \"job\": \"$job\", \"command\": \"zerolens ${args[*]}\", \"exit_code\": $rc, \"wall_s\": $(echo "$end - $start" | bc), \"printed_s\": $seconds}" >> $here/times.log
  done
done
python3 - "$(git -C "$BASE" rev-parse --short HEAD)" "$(git rev-parse --short HEAD)" >> $here/times.log <<'PY'
import json, sys
def strip(d):
    if isinstance(d, dict):
        return {k: strip(v) for k, v in d.items() if k != "seconds"}
    return [strip(x) for x in d] if isinstance(d, list) else d
for job in ("plan", "e64", "e512", "e4096"):
    a, b = (json.load(open(f"/tmp/searchpaths-{job}-{tag}.json")) for tag in sys.argv[1:])
    print(json.dumps({"job": job, "same_json_but_seconds": strip(a) == strip(b)}))
PY
cat $here/times.log
