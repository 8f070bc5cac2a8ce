# What produced this folder, on one H200 (run from the repository root with $OUT set):
set -x
python3 -m pytest -m gpu -q -p no:cacheprovider -n 0 tests/test_gpu.py 2>&1 | tail -5 > $OUT/pytest_gpu.txt
python3 docs/results/1xh200/issue24/track_overhead.py --out $OUT/overhead --json $OUT/overhead.json
torchrun --nproc-per-node 1 examples/track/hf_trainer_deepspeed.py --out $OUT/trainer --one-param-group \
  --steps 20 --every 5 --seq-len 64 > $OUT/trainer.log 2>&1
zerolens verify --nproc 1 --device cuda --model hf:examples/hf/llama-tiny.json --ds-config examples/track/ds_zero2.json \
  --strategies zero2 --precision bf16 --micro-batch 2 --seq-len 64 --steps 20 --out $OUT/verify > $OUT/verify.log 2>&1
python3 docs/results/1xh200/issue24/compare_trainer.py $OUT/trainer $OUT/verify > $OUT/comparison.json
torchrun --nproc-per-node 1 examples/track/fsdp2_loop.py --out $OUT/fsdp2 --steps 20 --every 5 > $OUT/fsdp2.log 2>&1
torchrun --nproc-per-node 1 examples/track/deepspeed_zero2_loop.py --out $OUT/zero2 --steps 20 --every 5 > $OUT/zero2.log 2>&1
