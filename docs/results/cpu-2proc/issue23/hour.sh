# A new user's first hour, replayed on 2 CPU cores (issue 23): each command's exit code, its line count,
# lines over 100 columns and tracebacks. Run from the repository root:
#   bash docs/results/cpu-2proc/issue23/hour.sh > docs/results/cpu-2proc/issue23/hour.log 2>&1
# Ctrl-C and SIGTERM are replayed by tests/test_interrupts.py (real processes).
set -u
work=$(mktemp -d)
cat > "$work/floaty.py" <<'PY'
import torch
from torch import nn


def build():
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


def batch(step, batch_size, seed):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randn(batch_size, 16, generator=g), torch.randint(0, 4, (batch_size,), generator=g)
PY
echo '{"zero_optimizaton": {"stage": 2}}' > "$work/misspelt.json"
echo '{"zero_optimization": {"reduce_bucket_size": 1e6}}' > "$work/ds.json"
run() {
  echo "### zerolens $*"
  (cd "$work" && timeout 600 python3 -m zerolens "$@" > out.txt 2> err.txt; echo "exit $?" > rc.txt)
  cat "$work/rc.txt"
  cat "$work/out.txt" "$work/err.txt" | python3 -c "
import sys
lines = sys.stdin.read().splitlines()
print(f'{len(lines)} lines, {sum(len(l) > 100 for l in lines)} over 100 columns, '
      f'{sum(\"Traceback\" in l for l in lines)} tracebacks')
for l in [l for l in lines if len(l) > 100][:3]: print('  over 100:', l)"
  grep -h "^zerolens: " "$work/out.txt" "$work/err.txt" | head -4 | sed 's/^/  /'
}
run --help
for verb in verify bench maxsize sweep estimate plan; do run "$verb" --help; done
run verify --out "$work/first"
run bench --out "$work/bench"
run verify --nproc 6 --strategies ddp --steps 5 --out "$work/six"
run verify --model floaty:build --batch floaty:batch --strategies ddp,zero1 --steps 5 --out "$work/floaty"
run verify --strategies ddp,fsdp2 --ds-config ds.json
run verify --ds-config misspelt.json
run verify --nosuchflag
run verify --reduce-bucket-size 1e20
run estimate
run estimate --params 1e3 --nproc 2
run estimate --params 1e15 --nproc 1024
run estimate --model hf:notamodeltype
run maxsize --device cpu
run plan --gpu-memory 24GiB --preset gpt-tiny --nproc 2 --no-depth --micro-batches 1,2,4
run plan --gpu-memory 80GiB --steps 3
rm -rf "$work"
