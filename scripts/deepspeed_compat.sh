#!/usr/bin/env bash
# The census-against-layout tests under each DeepSpeed release given (the run behind src/zerolens/compat.py),
# and verify's peak checks under it. For each release (default: the newest of each supported line), a virtual
# environment with that DeepSpeed beside this machine's torch, then the census-versus-layout tests on CPU (gloo)
# against this checkout's source, and `zerolens verify --strategies ddp,zero0,zero1,zero2,zero3 --steps 4` (the
# case study on 2 CPU ranks: every peak as predicted, or said not modelled for that release). Writes one log
# per release, verify's terminal output (verify-<release>.txt) and compat.json into
# ${OUT:-docs/results/deepspeed-compat}/.
#     bash scripts/deepspeed_compat.sh                  # 0.16.9 0.17.6 0.18.9 0.19.8
#     bash scripts/deepspeed_compat.sh 0.18.0 0.18.9
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-docs/results/deepspeed-compat}
venvs=${VENVS:-/tmp/zerolens-deepspeed-compat}
releases=("$@")
[ ${#releases[@]} -gt 0 ] || releases=(0.16.9 0.17.6 0.18.9 0.19.8)
tests=(tests/test_census_distributed.py tests/test_baseline_optimizer.py tests/test_theory.py)
mkdir -p "$out" "$venvs"
for release in "${releases[@]}"; do
  venv="$venvs/$release"
  # torch (and pytest) come from the machine's own site-packages; DeepSpeed from this environment.
  [ -x "$venv/bin/python" ] || python3 -m venv --system-site-packages "$venv"
  DS_BUILD_OPS=0 "$venv/bin/python" -m pip install -q "deepspeed==$release" 2>&1 | grep -v -E "^(WARNING|ERROR: pip's dependency|zerolens)" || true
  start=$(date +%s)
  {
    DS_ACCELERATOR=cpu "$venv/bin/python" -c 'import torch, deepspeed; print("torch", torch.__version__, "deepspeed", deepspeed.__version__)'
    echo "zerolens at commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src tests || echo ' (with uncommitted changes)')"
    echo "=== python -m pytest -q ${tests[*]}"
    # Each DeepSpeed JIT-builds its CPU communication op into torch's extension cache, under one name
    # for every release: releases must not share that cache.
    TORCH_EXTENSIONS_DIR="$venv/torch_extensions" PYTHONPATH=src "$venv/bin/python" -m pytest -q -p no:cacheprovider \
        "${tests[@]}" 2>&1 | tail -n 25
    echo "exit code ${PIPESTATUS[0]}"
  } > "$out/deepspeed-$release.log" 2>&1
  # verify's run folder is made fresh (zerolens refuses a folder of its own without --overwrite); DeepSpeed's
  # JIT-build lines of its CPU op are left out of the terminal output kept
  rm -rf "$venvs/verify-$release"
  TORCH_EXTENSIONS_DIR="$venv/torch_extensions" PYTHONPATH=src DS_ACCELERATOR=cpu "$venv/bin/python" -m zerolens verify \
      --strategies ddp,zero0,zero1,zero2,zero3 --steps 4 --out "$venvs/verify-$release" 2>&1 \
      | grep -v -E "^\[[0-9]+/[0-9]+\]|ninja|Emitting|Building extension|Loading extension|Time to load|PyTorch extensions root|Creating extension directory" \
      > "$out/verify-$release.txt"
  echo "exit code ${PIPESTATUS[0]}" >> "$out/verify-$release.txt"
  verdict=$(grep -E '^Verdict' "$out/verify-$release.txt" || echo "no verdict ($(tail -n 1 "$out/verify-$release.txt"))")
  echo "deepspeed $release: $(grep -E '^exit code' "$out/deepspeed-$release.log"), verify: $verdict after $(( $(date +%s) - start )) s"
done
python3 - "$out" "${releases[@]}" <<'PY'
import json, re, sys
from pathlib import Path
out, releases = Path(sys.argv[1]), sys.argv[2:]
path = out / "compat.json"
results = json.loads(path.read_text()) if path.exists() else {}
for release in releases:
    log = (out / f"deepspeed-{release}.log").read_text()
    summary = re.findall(r"^=+ (.*) in [\d.]+s", log, re.M) or re.findall(r"^(\d+ passed.*?) in ", log, re.M)
    verify = out / f"verify-{release}.txt"
    verify_text = verify.read_text() if verify.exists() else ""
    verdict = re.search(r"^Verdict: (\w+)", verify_text, re.M)
    verify_exit = re.search(r"^exit code (\d+)", verify_text, re.M)
    results[release] = {"exit_code": int(re.search(r"^exit code (\d+)", log, re.M)[1]),
                        "verify_verdict": verdict[1] if verdict else None,
                        "verify_exit_code": int(verify_exit[1]) if verify_exit else None,
                        "pytest": summary[-1] if summary else None,
                        "versions": next(line for line in log.splitlines() if line.startswith("torch ")),
                        "log": f"deepspeed-{release}.log"}
path.write_text(json.dumps(dict(sorted(results.items())), indent=2) + "\n")
PY
