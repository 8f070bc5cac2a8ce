#!/usr/bin/env bash
# plan gpt-1b at 8 GPUs of 24 GiB with two trees alternated, ROUNDS times, on this 2-core machine with
# nothing else running: BASE (a checkout of 2fa5e9a, this session's start) and HEAD (this tree, 29f0dbd).
# Records the seconds plan printed, the wall time and the CPU time (user + sys, workers included), and
# whether the two JSONs agree but for `seconds`.
# From the repository root: BASE=/path/to/checkout-of-2fa5e9a HEAD=$PWD ROUNDS=3 bash docs/results/cpu-2proc/issue21/plan-cache/run.sh
set -u
here=${HERE:-$PWD/docs/results/cpu-2proc/issue21/plan-cache}  # where times.log goes (plan-keys/run.sh sets its own)
args=(plan --gpu-memory 24GiB --nproc 8 --preset gpt-1b --json)
: > $here/times.log
for round in $(seq "${ROUNDS:-3}"); do
  for tree in "$BASE" "$HEAD"; do
    tag=$(git -C "$tree" rev-parse --short HEAD)
    /usr/bin/time -f "%e %U %S" -o /tmp/plancache-time.txt \
      bash -c "cd $tree && PYTHONPATH=$tree/src python3 -m zerolens ${args[*]} > /tmp/plancache-$tag.json 2>/dev/null"
    read -r wall user sys < /tmp/plancache-time.txt
    printed=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1])).get('seconds'))" /tmp/plancache-$tag.json)
    echo "{\"round\": $round, \"tree\": \"$tag\", \"command\": \"zerolens ${args[*]}\", \"printed_s\": $printed, \"wall_s\": $wall, \"cpu_s\": $(echo "$user + $sys" | bc)}" >> $here/times.log
  done
done
python3 - "$(git -C "$BASE" rev-parse --short HEAD)" "$(git -C "$HEAD" rev-parse --short HEAD)" >> $here/times.log <<'PY'
import json, sys
before, after = (json.load(open(f"/tmp/plancache-{tag}.json")) for tag in sys.argv[1:])
before.pop("seconds"), after.pop("seconds")
print(json.dumps({"same_json_but_seconds": before == after}))
PY
