#!/usr/bin/env bash
# verify's prediction on GPUs (and under other launchers) as each rank now makes it: a fresh process per rank,
# for its share of the strategies (run/prediction.py, share_of). Here the processes themselves, one after the
# other on this 2-core machine: gpt-1b at N=2 as a CUDA target (compute capability 9.0), micro-batch 8, bf16,
# all seven strategies in one process (as rank 0 made it before) and each of the two ranks' shares.
# From the repository root: bash docs/results/cpu-2proc/issue22/prediction-spread/run.sh
set -u
here=docs/results/cpu-2proc/issue22/prediction-spread
folder=$(mktemp -d)
PYTHONPATH=src python3 - "$folder" <<'PY'
import sys
from pathlib import Path
from zerolens.models.model import PRESETS
from zerolens.run.config import RunConfig, save_config
strategies = ("ddp", "zero0", "zero1", "zero2", "zero3", "fsdp2-grad", "fsdp2")
config = RunConfig(strategies=strategies, baseline="ddp", nproc=2, preset="gpt-1b", model=PRESETS["gpt-1b"],
                   micro_batch=8, precision="bf16", device="cuda", steps=10)
save_config(config, Path(sys.argv[1]) / "config.json", "prediction-spread")
PY
: > $here/times.log
for share in ddp,zero0,zero1,zero2,zero3,fsdp2-grad,fsdp2 ddp,zero1,zero3,fsdp2 zero0,zero2,fsdp2-grad; do
  start=$(date +%s.%N)
  PYTHONPATH=src python3 -m zerolens.run.prediction "$folder" --strategies $share --into part.json --cuda-capability 9.0
  rc=$? end=$(date +%s.%N)
  echo "{\"commit\": \"$(git rev-parse --short HEAD)\", \"strategies\": \"$share\", \"exit_code\": $rc, \"wall_s\": $(echo "$end - $start" | bc)}" >> $here/times.log
done
rm -rf "$folder"
cat $here/times.log
