#!/usr/bin/env bash
# Runs zerolens commands (or pytest) on the GPU machine and packs every run folder into one tarball.
# From the repository root, after
# `source .whl/install.sh` (see ../shared/gpu/wheels.sh). Each argument is "name|subcommand flags",
# e.g. "1b|bench --preset gpt-1b --strategies ddp,zero2"; its run folder is runs/<name>. Writes one
# log (${LOG:-gpu_runs.log}) and runs.tgz (every run folder) into ${OUT:-gpu-results}/, the tarball
# refreshed after every run so that a run cut off by a time limit keeps the others.
# "name|pytest ..." runs python3 -m pytest with those arguments instead.
set -uo pipefail
out=${OUT:-gpu-results}
log=${LOG:-gpu_runs.log}
runs=$(mktemp -d)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch, deepspeed; print("torch", torch.__version__, "cuda", torch.version.cuda, "deepspeed", deepspeed.__version__)'
  echo "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-unset}"
  echo "zerolens at commit ${ZEROLENS_COMMIT:-unknown} (set by the caller: the GPU machine has no .git)"
  for spec in "$@"; do
    name=${spec%%|*}; command=${spec#*|}
    start=$(date +%s.%N)
    if [ "${command%% *}" = pytest ]; then
      echo "=== python3 -m $command"
      # shellcheck disable=SC2086
      python3 -m $command 2>&1 | tail -5
      rc=${PIPESTATUS[0]}
    else
      echo "=== zerolens $command --out runs/$name"
      # shellcheck disable=SC2086
      zerolens $command --out "$runs/$name"
      rc=$?
    fi
    echo "exit code $rc after $(python3 -c "print(round($(date +%s.%N) - $start, 1))") s"
    tar czf "$out/runs.tgz" -C "$runs" .
  done
} 2>&1 | tee "$out/$log"
