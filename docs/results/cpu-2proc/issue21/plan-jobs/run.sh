#!/usr/bin/env bash
# Wall time of plan (gpt-1b, 8 ranks, 24 GiB) before (BASE: a checkout of b1fa7f7, this session's start) and
# after this session's changes (this tree), alternating, on this 2-core machine with nothing else running;
# and whether the two JSONs agree but for `seconds` and the expandable-segments figures of what fits (no
# longer replayed: None).
# From the repository root: BASE=/path/to/checkout-of-b1fa7f7 ROUNDS=3 bash docs/results/cpu-2proc/issue21/plan-jobs/run.sh
set -u
here=docs/results/cpu-2proc/issue21/plan-jobs
args=(plan --gpu-memory 24GiB --nproc 8 --preset gpt-1b --json)
: > $here/times.log
for round in $(seq "${ROUNDS:-3}"); do
  for tree in "$BASE" "$PWD"; do
    tag=$(git -C "$tree" rev-parse --short HEAD)
    start=$(date +%s.%N)
    (cd "$tree" && PYTHONPATH=$tree/src python3 -m zerolens "${args[@]}") > /tmp/planjobs-$tag.json 2>/dev/null
    rc=$? end=$(date +%s.%N)
    seconds=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1])).get('seconds'))" /tmp/planjobs-$tag.json)
    echo "{\"round\": $round, \"tree\": \"$tag\", \"command\": \"zerolens ${args[*]}\", \"exit_code\": $rc, \"wall_s\": $(echo "$end - $start" | bc), \"printed_s\": $seconds}" >> $here/times.log
  done
done
python3 - "$(git -C "$BASE" rev-parse --short HEAD)" "$(git rev-parse --short HEAD)" >> $here/times.log <<'PY'
import json, sys
EXPANDABLE = ("needs_expandable_bytes", "fits_with_expandable_segments", "runs_in_memory_expandable")
def strip(d, fitting=False):
    if isinstance(d, dict):
        return {k: strip(v, fitting or k == "fits") for k, v in d.items()
                if k != "seconds" and not (fitting and k in EXPANDABLE)}
    return [strip(x, fitting) for x in d] if isinstance(d, list) else d
before, after = (json.load(open(f"/tmp/planjobs-{tag}.json")) for tag in sys.argv[1:])
print(json.dumps({"same_json_but_seconds_and_expandable_of_what_fits": strip(before) == strip(after),
                  "fitting_rows_not_replayed_with_expandable": sum(r["needs_expandable_bytes"] is None
                                                                    for r in after["fits"]),
                  "fitting_rows": len(after["fits"])}))
PY
cat $here/times.log
