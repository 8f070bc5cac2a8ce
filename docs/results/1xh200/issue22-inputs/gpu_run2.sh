# One H200, N=1, one device call (run from the repository root with .whl installed): the verifies of
# gpu_run.sh again, now that verify on CUDA checks each phase against the allocator model's counted
# figure (604dcd5 and after), first the one gpu_run.sh lost to its time limit (the user's gradient
# checkpointing), then ZeRO-3 under gradient accumulation (801de44), then the others; last, gpt-1b's
# FSDP2 cap for issue 21 (bench at the predicted smallest cap, and 1% below).
set -x
R=docs/results/1xh200/issue22-inputs
verify() {  # name, then verify's arguments
  name=$1; shift
  PYTHONPATH=$R:$PYTHONPATH timeout 100 zerolens verify --nproc 1 --device cuda --steps 4 --micro-batch 4 --out /tmp/v-$name "$@" \
    > $OUT/verify-$name.log 2>&1
  echo "verify $name: rc $?"; gzip -c /tmp/v-$name/summary.json > $OUT/verify-$name-summary.json.gz 2>/dev/null
  grep -h "checks passed\|Verdict" $OUT/verify-$name.log
}
verify user-checkpointing --model models:llama_with_checkpointing --batch models:batch --strategies ddp,zero2,fsdp2
verify grad-accum-4-zero3 --preset gpt-100m --strategies zero3 --grad-accum 4
verify lora --model models:lora_llama --batch models:batch --strategies ddp,zero2,fsdp2
verify bf16-weights --model models:bf16_llama --batch models:batch --strategies ddp,zero2,fsdp2
verify grad-accum-4 --preset gpt-100m --strategies ddp,zero2,fsdp2 --grad-accum 4
# gpt-1b, micro-batch 8, bf16, default allocator: FSDP2's predicted smallest cap 25155338240 bytes (issue21/run18/
# estimate-gpt-1b-mb8.json) is 23990 MiB; 1% below, rounded down to 2 MiB as plan --check does: 23748 MiB.
for gib in 23.427734375 23.19140625; do
  timeout 100 zerolens bench --nproc 1 --device cuda --preset gpt-1b --micro-batch 8 --strategies fsdp2-grad --warmup 1 \
    --steps 2 --rounds 1 --no-reference --memory-limit-gib $gib --out /tmp/cap-fsdp2-$gib > $OUT/cap-fsdp2-grad-at-$gib.log 2>&1
  echo "cap fsdp2-grad at $gib GiB: rc $?"; cp /tmp/cap-fsdp2-$gib/bench.json $OUT/cap-fsdp2-grad-at-$gib.json 2>/dev/null
done
git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
