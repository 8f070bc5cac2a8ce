#!/usr/bin/env bash
# estimate (Llama-2-70B's shape, every strategy, 64, 512 and 4096 ranks) and plan (gpt-1b, 8 GPUs of 24 GiB)
# before (BASE: a checkout of the commit before) and after (this tree), alternated, ROUNDS rounds (default 2),
# on this 2-core machine with nothing else running: wall time, the CPU time of the command and its workers
# (user + system, /usr/bin/time), the seconds the command prints, and whether each pair of JSONs agrees but
# for `seconds` and what says which traces were scaled from shallower ones (`same_figures`), and which
# strategies each tree scaled (`scaled`).
# From the repository root: BASE=/path/to/checkout JOBS="e64 e512 e4096" bash docs/results/cpu-2proc/issue22/parent-built/run.sh
set -u
here=docs/results/cpu-2proc/issue22/parent-built
jobs=${JOBS:-e64 e512 e4096 plan}
: > $here/times.log
for round in $(seq ${ROUNDS:-2}); do
  for job in $jobs; do
    for tree in "$BASE" "$PWD"; do
      tag=$(git -C "$tree" rev-parse --short HEAD)
      case $job in
        plan) args=(plan --gpu-memory 24GiB --nproc 8 --preset gpt-1b --json) ;;
        *) args=(estimate --model hf:examples/hf/llama2-70b.json --nproc ${job#e} --micro-batch 1 --seq-len 4096
                 --precision bf16 --json) ;;
      esac
      PYTHONPATH=$tree/src /usr/bin/time -f "%e %U %S" -o /tmp/time.txt python3 -m zerolens "${args[@]}" \
        > /tmp/parent-built-$job-$tag.json 2>/dev/null
      rc=$?
      read wall user sys < /tmp/time.txt
      printed=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['seconds'])" /tmp/parent-built-$job-$tag.json)
      echo "{\"round\": $round, \"tree\": \"$tag\", \"job\": \"$job\", \"command\": \"zerolens ${args[*]}\", \"exit_code\": $rc, \"wall_s\": $wall, \"cpu_s\": $(echo "$user + $sys" | bc), \"printed_s\": $printed}" >> $here/times.log
    done
  done
done
python3 - "$(git -C "$BASE" rev-parse --short HEAD)" "$(git rev-parse --short HEAD)" $jobs >> $here/times.log <<'PY'
import json, sys
SCALED = {"seconds", "depth_scaled_from", "why_not_depth_scaled", "depth_scaled_ranks"}
def strip(d, keys):
    if isinstance(d, dict):
        return {k: strip(v, keys) for k, v in d.items() if k not in keys}
    return [strip(x, keys) for x in d] if isinstance(d, list) else d
for job in sys.argv[3:]:
    a, b = (json.load(open(f"/tmp/parent-built-{job}-{tag}.json")) for tag in sys.argv[1:3])
    scaled = {tag: sorted(name for name, e in d.get("strategies", {}).items() if "depth_scaled_from" in e)
              for tag, d in zip(sys.argv[1:3], (a, b))}
    print(json.dumps({"job": job, "same_figures": strip(a, SCALED) == strip(b, SCALED), "scaled": scaled}))
PY
cat $here/times.log
