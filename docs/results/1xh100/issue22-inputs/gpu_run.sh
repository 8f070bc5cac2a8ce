# One H100, N=1, one device call: issue 22's five inputs again (../../1xh200/issue22-inputs/ made them on one
# H200 at 295aa88 and bfc14a5), after every later change to the step models and the prediction. Each verify's
# log and summary packed into one archive ($OUT/run.tar.gz).
R=docs/results/1xh200/issue22-inputs
verify() {  # name, then verify's arguments
  name=$1; shift
  PYTHONPATH=$R:$PYTHONPATH timeout 105 zerolens verify --nproc 1 --device cuda --steps 4 --micro-batch 4 --out /tmp/v-$name "$@" \
    > /tmp/verify-$name.log 2>&1
  echo "verify $name: rc $?"; cp /tmp/v-$name/summary.json /tmp/verify-$name-summary.json 2>/dev/null
  grep -h "checks passed\|Verdict" /tmp/verify-$name.log
}
verify grad-accum-4 --preset gpt-100m --strategies ddp,zero2,fsdp2 --grad-accum 4
verify lora --model models:lora_llama --batch models:batch --strategies ddp,zero2,fsdp2
verify bf16-weights --model models:bf16_llama --batch models:batch --strategies ddp,zero2,fsdp2
verify moe --model hf:$R/mixtral-small.json --seq-len 512 --strategies ddp,zero2,fsdp2
verify user-checkpointing --model models:llama_with_checkpointing --batch models:batch --strategies ddp,zero2,fsdp2
nvidia-smi --query-gpu=name,driver_version --format=csv > /tmp/device.txt
(cd /tmp && tar -czf $OUT/run.tar.gz verify-*.log verify-*-summary.json device.txt)
