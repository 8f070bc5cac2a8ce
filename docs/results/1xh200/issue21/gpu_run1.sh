# One H200, N=1: the GPU tests, then verify on the case study and gpt-1b (ddp, zero2): the reserved
# peak predicted (fake CUDA trace through the allocator model) beside measured, and the memory outside
# the allocator (outside_allocator_after_step in summary.json).
# Run from the repository root on the GPU machine: bash docs/results/1xh200/issue21/gpu_run1.sh
set -x
python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="-ra" > "$OUT/pytest_gpu.txt" 2>&1; echo "rc=$?" >> "$OUT/pytest_gpu.txt"
tail -5 "$OUT/pytest_gpu.txt"
zerolens verify --nproc 1 --device cuda --strategies ddp,zero2 --steps 6 --out "$OUT/verify-case-study" > "$OUT/verify-case-study.txt" 2>&1
zerolens verify --nproc 1 --device cuda --preset gpt-1b --strategies ddp,zero2 --steps 4 --out "$OUT/verify-gpt-1b" > "$OUT/verify-gpt-1b.txt" 2>&1
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True zerolens verify --nproc 1 --device cuda --preset gpt-1b --strategies ddp,zero2 --steps 4 --out "$OUT/verify-gpt-1b-expandable" > "$OUT/verify-gpt-1b-expandable.txt" 2>&1
tail -3 "$OUT"/verify-*.txt
rm -rf "$OUT"/verify-*/plots "$OUT"/verify-*/results/*.trace* 2>/dev/null
du -sh "$OUT"
