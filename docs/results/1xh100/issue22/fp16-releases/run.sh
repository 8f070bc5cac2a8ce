#!/usr/bin/env bash
# fp16 verify at N=1 on one GPU under each DeepSpeed release. Wheels: bash ../shared/gpu/wheels.sh, then
#   for R in 0.16.9 0.17.6 0.18.9; do DS_BUILD_OPS=0 pip wheel --no-deps deepspeed==$R -w .whl/ds-$R; done
#   pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl/ds-extra einops msgpack
# Run with the device tool (carry .whl):  source .whl/install.sh && bash docs/results/1xh100/issue22/fp16-releases/run.sh
set -u
for R in 0.16.9 0.17.6 0.18.9 0.19.8; do
  site=/tmp/site
  if [ "$R" != 0.19.8 ]; then
    site=/tmp/ds-$R
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/ds-$R/*.whl .whl/ds-extra/*.whl
  fi
  # Each release JIT-builds its ops into its own cache.
  PYTHONPATH=$site:$PYTHONPATH TORCH_EXTENSIONS_DIR=/tmp/ext-$R \
    python3 -m zerolens verify --nproc 1 --device cuda --precision fp16 --strategies zero0,zero1,zero2 \
    --out "/tmp/runs/deepspeed-$R" > "$OUT/deepspeed-$R.txt" 2>&1
  echo "deepspeed $R: exit $?"
done
# The run folders, in one file (the device tool brings a few files back)
tar czf "$OUT/runs.tgz" -C /tmp runs
