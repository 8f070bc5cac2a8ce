#!/usr/bin/env bash
# The runs behind docs/results/2xh200/: run on a machine with 2 GPUs, from the repository root,
# after `source .whl/install.sh` (see ../shared/gpu/wheels.sh). Writes one log and runs.tgz (every
# run folder: config, per-rank metrics, summary, report) into ${OUT:-gpu-results}/: two files,
# within what the device tool brings back.
# Arguments, if any, are "name|verify flags" runs to make instead of the default set; the
# default set also runs the case study's script and the gpu-marked tests.
set -uo pipefail
out=${OUT:-gpu-results}
log=${LOG:-gpu_verify.log}
runs=$(mktemp -d)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
specs=("$@")
if [ ${#specs[@]} -eq 0 ]; then
  specs=("default|" "all|--strategies ddp,zero0,zero1,zero2,zero3" "bucket2e5|--reduce-bucket-size 2e5"
         "130m|--preset case-study-130m --strategies ddp,zero0,zero1,zero2,zero3")
  extras=1
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch, deepspeed; print("torch", torch.__version__, "cuda", torch.version.cuda, "deepspeed", deepspeed.__version__)'
  for spec in "${specs[@]}"; do
    name=${spec%%|*}; flags=${spec#*|}
    echo "=== zerolens verify $flags"
    start=$(date +%s.%N)
    # shellcheck disable=SC2086
    zerolens verify $flags --out "$runs/$name"
    echo "exit code $? after $(python3 -c "print(round($(date +%s.%N) - $start, 1))") s"
    tar czf "$out/runs.tgz" -C "$runs" .  # after every run: a run cut off by a time limit keeps the rest
  done
  if [ "${extras:-0}" = 1 ]; then
    for mode in stage2 baseline; do
      echo "=== deepspeed --num_gpus=2 examples/train_zero_stage2.py $mode --steps 20"
      deepspeed --num_gpus=2 examples/train_zero_stage2.py "$mode" --steps 20 2>&1 | grep -E "^(step=|stage2:|baseline:)"
    done
    echo "=== python3 -m pytest -m gpu"
    python3 -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tail -3
  fi
} 2>&1 | tee "$out/$log"
