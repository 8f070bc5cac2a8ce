#!/usr/bin/env bash
# Re-runs the two commands whose verdicts scripts/gpu_verify.sh found FAIL, after the fixes
# described in docs/results/2xh200/README.md. Same set-up and output conventions.
set -uo pipefail
out=${OUT:-gpu-results}
runs=$(mktemp -d)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{
  for spec in "all|--strategies ddp,zero0,zero1,zero2,zero3" \
              "130m|--preset case-study-130m --strategies ddp,zero0,zero1,zero2,zero3"; do
    name=${spec%%|*}; flags=${spec#*|}
    echo "=== zerolens verify $flags"
    start=$(date +%s.%N)
    # shellcheck disable=SC2086
    zerolens verify $flags --out "$runs/$name"
    echo "exit code $? after $(python3 -c "print(round($(date +%s.%N) - $start, 1))") s"
    cp "$runs/$name/summary.json" "$out/${name}_summary.json"
    cp "$runs/$name/report.md" "$out/${name}_report.md"
  done
} 2>&1 | tee "$out/gpu_verify_followup.log"
