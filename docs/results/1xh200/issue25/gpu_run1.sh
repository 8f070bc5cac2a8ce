# Issue 25 on one H200 (run from the repository root with $OUT set): bench's interleaved rounds on gpt-1b
# (N=1, the default bench settings but the model), MFU counted by torch's FLOP counter for a Hugging Face
# model (TinyLlama-1.1B's configuration), and the GPU tests.
set -x
zerolens bench --nproc 1 --device cuda --preset gpt-1b --out /tmp/gpt1b > $OUT/gpt1b.log 2>&1
cp /tmp/gpt1b/bench.json $OUT/gpt1b_bench.json
zerolens bench --nproc 1 --device cuda --model hf:examples/hf/tinyllama-1.1b.json --micro-batch 4 --rounds 1 \
  --strategies ddp --out /tmp/tinyllama > $OUT/tinyllama.log 2>&1
cp /tmp/tinyllama/bench.json $OUT/tinyllama_bench.json
python3 -m pytest -m gpu -q -p no:cacheprovider -n 0 tests/test_gpu.py 2>&1 | tail -5 > $OUT/pytest_gpu.txt
git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
