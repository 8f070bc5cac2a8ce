# One H200, N=1: verify on the case study and gpt-1b (ddp, zero2), default allocator and expandable
# segments, and plan --check on gpt-1b (both candidates at micro-batch 8, at and 1% below the
# predicted smallest cap). figures.json gathers the figures; the run folders' summaries are in runs.tar.gz.
# Run from the repository root on the GPU machine: bash docs/results/1xh200/issue21/gpu_run2.sh
set -x
R=/tmp/issue21 && rm -rf $R && mkdir -p $R
zerolens verify --nproc 1 --device cuda --strategies ddp,zero2 --steps 6 --out $R/verify-case-study > $R/verify-case-study.txt 2>&1
zerolens verify --nproc 1 --device cuda --preset gpt-1b --strategies ddp,zero2 --steps 4 --out $R/verify-gpt-1b > $R/verify-gpt-1b.txt 2>&1
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True zerolens verify --nproc 1 --device cuda --preset gpt-1b --strategies ddp,zero2 --steps 4 --out $R/verify-gpt-1b-expandable > $R/verify-gpt-1b-expandable.txt 2>&1
zerolens plan --nproc 1 --preset gpt-1b --gpu-memory 140GiB --strategies ddp,zero2 --micro-batches 8 --no-depth --check 2 --json --out $R/plan-gpt-1b > $R/plan-gpt-1b.json 2> $R/plan-gpt-1b.txt
python3 docs/results/1xh200/issue21/figures.py $R/verify-case-study $R/verify-gpt-1b $R/verify-gpt-1b-expandable $R/plan-gpt-1b.json > "$OUT/figures.json"
tail -n 4 $R/*.txt
(cd $R && tar czf "$OUT/runs.tar.gz" --exclude='*.png' --exclude='metrics_rank*' --exclude='logs' --exclude='results' .)
ls -la "$OUT"
