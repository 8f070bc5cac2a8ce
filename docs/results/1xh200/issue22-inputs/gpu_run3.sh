# One H200, N=1, one device call: gpu_run2.sh's first and third verifies again (the user's gradient
# checkpointing, LoRA), whose summaries did not come back from gpu_run2's call (too many files in $OUT);
# this call packs each into one archive.
R=docs/results/1xh200/issue22-inputs
for case in "user-checkpointing models:llama_with_checkpointing" "lora models:lora_llama"; do
  set -- $case
  PYTHONPATH=$R:$PYTHONPATH timeout 120 zerolens verify --nproc 1 --device cuda --steps 4 --micro-batch 4 --out /tmp/v-$1 \
    --model $2 --batch models:batch --strategies ddp,zero2,fsdp2 > /tmp/v-$1.log 2>&1
  echo "verify $1: rc $?"; grep -h "checks passed\|Verdict" /tmp/v-$1.log
  cp /tmp/v-$1/summary.json /tmp/verify-$1-summary.json; cp /tmp/v-$1.log /tmp/verify-$1.log
done
git rev-parse HEAD > /tmp/tree.txt; git status --short >> /tmp/tree.txt
tar -C /tmp -czf $OUT/run3.tar.gz verify-user-checkpointing-summary.json verify-user-checkpointing.log \
  verify-lora-summary.json verify-lora.log tree.txt
