# run3, on one H200 (run from the repository root with $OUT set): the GPU tests, track's log_to on CUDA,
# and verify of a transformers model returned as it is by a --model factory.
set -x
python3 -m pytest -m gpu -q -p no:cacheprovider -n 0 tests/test_gpu.py 2>&1 | tail -5 > $OUT/pytest_gpu.txt
python3 docs/results/1xh200/issue24/log_to_cuda.py --out /tmp/log_to > $OUT/log_to.log 2>&1
cp /tmp/log_to/logged.json $OUT/log_to_logged.json; cp /tmp/log_to/run/summary.json $OUT/log_to_summary.json
PYTHONPATH=tests:$PYTHONPATH zerolens verify --nproc 1 --device cuda --model zerolens_test_models:tiny_llama \
  --batch zerolens_test_models:llama_batch --strategies ddp,zero2,fsdp2 --steps 6 --out /tmp/hf_as_is > $OUT/hf_as_is.log 2>&1
cp /tmp/hf_as_is/summary.json $OUT/hf_as_is_summary.json
git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
