#!/usr/bin/env bash
# ZeRO-1/2's gradient overflow check under each DeepSpeed line, on CPU (2 ranks, gloo, bf16): the case study
# scaled to case-study-130m at one layer, whose embedding and head (32.8M elements each) make rank 0's slice
# mostly one gradient, so 0.16-0.18's check (an fp32 copy and masks of each gradient in turn) is the step's
# peak. Each release in a virtual environment made as scripts/deepspeed_compat.sh makes them (VENVS, default
# /tmp/dsv/<release>; the installed DeepSpeed for 0.19.8). Run from the repository root:
#     bash docs/results/deepspeed-compat/issue22/overflow-check/run.sh [label]
# Writes verify-<release>-<check>[-label].txt and the peak checks of each run (peaks-*.json, gzipped afterwards for docs/results size) beside this file;
# from a checkout of another commit (a git worktree), HERE=<this folder in the main checkout> keeps them here.
set -uo pipefail
here=${HERE:-docs/results/deepspeed-compat/issue22/overflow-check}
label=${1:+-$1}
venvs=${VENVS:-/tmp/dsv}
run() {  # release, check flag (on|off|default)
  local release=$1 check=$2 python=python3 flag=
  [ "$release" = installed ] || python=$venvs/$release/bin/python
  [ "$check" = on ] && flag=--grad-overflow-check
  [ "$check" = off ] && flag=--no-grad-overflow-check
  local name=$release-$check$label out=/tmp/zerolens-overflow-check/$release-$check$label
  rm -rf "$out"
  TORCH_EXTENSIONS_DIR=$venvs/$release/ext PYTHONPATH=src DS_ACCELERATOR=cpu timeout 900 $python -m zerolens verify \
      --preset case-study-130m --depth 1 --strategies zero1,zero2 --steps 4 $flag --out "$out" 2>&1 \
      | grep -v -E '^\[[0-9-]+ [0-9:,]+\]|^(Emitting|Building|Loading|Time to load|ninja|\[[0-9]+/[0-9]+\])' > "$here/verify-$name.txt"
  python3 - "$out/summary.json" "$here/peaks-$name.json" "$(DS_ACCELERATOR=cpu $python -c 'import deepspeed; print(deepspeed.__version__)' 2>/dev/null | tail -1)" <<'PY'
import json, sys
summary, dest, version = sys.argv[1:]
try:
    s = json.load(open(summary))
except FileNotFoundError:  # a user error (exit code 2) writes nothing: its one line is in the .txt
    sys.exit(f"{dest} {version}: no summary.json")
checks = [{k: c.get(k) for k in ("name", "passed", "measured", "expected", "detail")}
          for c in s["checks"] if c["name"].startswith("peak as predicted")]
json.dump({"deepspeed": version, "verdict": s["verdict"], "peak_checks": checks}, open(dest, "w"), indent=1)
print(dest, version, s["verdict"], [c["detail"] for c in checks])
PY
}
for release in ${RELEASES:-0.16.9 0.17.6 0.18.9}; do for check in ${CHECKS:-on default}; do run $release $check; done; done
[ -n "${RELEASES:-}" ] || { run installed default; run installed off; }
