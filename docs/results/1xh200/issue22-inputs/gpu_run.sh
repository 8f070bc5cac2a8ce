# One H200, N=1 (one device call; run from the repository root with .whl installed). First the two
# ZeRO caps run18 could not finish (gpt-1b, micro-batch 8, bf16: bench at the predicted smallest cap,
# one round, no reference loop; run18 ran 1% below it: out of memory, as predicted), then issue 22's
# inputs at about 100M parameters (models.py here), each a verify of DDP, ZeRO-2 and FSDP2. The first call
# ran the caps; its verifies lost zerolens (PYTHONPATH replaced, not extended): the second ran them alone
# (SKIP_CAPS=1).
set -x
R=docs/results/1xh200/issue22-inputs
[ -n "$SKIP_CAPS" ] || for s in "zero1 23.943359375" "zero2 24.716796875"; do
  set -- $s
  timeout 100 zerolens bench --nproc 1 --device cuda --preset gpt-1b --micro-batch 8 --strategies $1 --warmup 1 \
    --steps 2 --rounds 1 --no-reference --memory-limit-gib $2 --out /tmp/cap-$1 > $OUT/cap-$1-at-$2.log 2>&1
  echo "cap $1 at $2 GiB: rc $?"; cp /tmp/cap-$1/bench.json $OUT/cap-$1-at-$2.json 2>/dev/null
done
verify() {  # name, then verify's arguments
  name=$1; shift
  PYTHONPATH=$R:$PYTHONPATH timeout 100 zerolens verify --nproc 1 --device cuda --steps 4 --micro-batch 4 --out /tmp/v-$name "$@" \
    > $OUT/verify-$name.log 2>&1
  echo "verify $name: rc $?"; cp /tmp/v-$name/summary.json $OUT/verify-$name-summary.json 2>/dev/null
  grep -h "checks passed\|Verdict" $OUT/verify-$name.log
}
verify grad-accum-4 --preset gpt-100m --strategies ddp,zero2,fsdp2 --grad-accum 4
verify lora --model models:lora_llama --batch models:batch --strategies ddp,zero2,fsdp2
verify bf16-weights --model models:bf16_llama --batch models:batch --strategies ddp,zero2,fsdp2
verify moe --model hf:$R/mixtral-small.json --seq-len 512 --strategies ddp,zero2,fsdp2
verify user-checkpointing --model models:llama_with_checkpointing --batch models:batch --strategies ddp,zero2,fsdp2
git rev-parse HEAD > $OUT/tree.txt; git status --short >> $OUT/tree.txt
