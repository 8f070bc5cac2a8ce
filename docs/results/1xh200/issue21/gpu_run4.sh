# One H200, N=1, after the DDP step model makes DDP's rebuilt buckets one by one: gpt-1b's ddp verify
# again (default allocator), and plan --check on it at and 1% below the predicted smallest cap.
set -x
R=/tmp/issue21b && rm -rf $R && mkdir -p $R
zerolens verify --nproc 1 --device cuda --preset gpt-1b --strategies ddp --steps 4 --out $R/verify-gpt-1b-ddp > $R/verify.txt 2>&1
zerolens plan --nproc 1 --preset gpt-1b --gpu-memory 140GiB --strategies ddp --micro-batches 8 --no-depth --check 1 --json --out $R/plan-gpt-1b-ddp > $R/plan-gpt-1b-ddp.json 2> $R/plan.txt
python3 docs/results/1xh200/issue21/figures.py $R/verify-gpt-1b-ddp $R/plan-gpt-1b-ddp.json > "$OUT/figures-ddp-buckets.json"
tail -n 3 $R/*.txt
