# One H200, issue 21: which operations allocate inside one call (scripts/op_workspaces.py), the buffers the
# dispatch-level trace cannot see. Run from the repository root with $OUT set.
set -x
p() { name=$1; shift; timeout 90 python3 scripts/op_workspaces.py --out $OUT/$name.json "$@" > $OUT/$name.log 2>&1; tail -14 $OUT/$name.log; }
p gpt-100m-ddp-8 --strategy ddp --model gpt-100m --micro-batch 8
p gpt-100m-ddp-4 --strategy ddp --model gpt-100m --micro-batch 4
p gpt-100m-fsdp2-8 --strategy fsdp2 --model gpt-100m --micro-batch 8
p gpt-100m-zero2-8 --strategy zero2 --model gpt-100m --micro-batch 8
p gpt-100m-ddp-fp32-4 --strategy ddp --model gpt-100m --micro-batch 4 --precision fp32
p case-study-ddp-fp16-16 --strategy ddp --model case-study --micro-batch 16 --precision fp16
p gpt2-ddp-8 --strategy ddp --model hf:gpt2 --micro-batch 8 --seq-len 1024
p tinyllama-ddp-4 --strategy ddp --model hf:examples/hf/tinyllama-1.1b.json --micro-batch 4
p gpt-1b-ddp-8 --strategy ddp --model gpt-1b --micro-batch 8

timeout 120 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_micro_batches.py tests/test_predict_peak.py 2>&1 | tail -4 > $OUT/pytest_micro_batches.txt
git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
