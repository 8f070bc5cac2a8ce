# On the 2-core CPU machine, no GPU (CUDA targets traced on the CPU for compute capability 9.0), from this
# folder: the predictions of run/'s verifies, with the allocated peak as the allocator model counts it.
export PYTHONPATH=.:$PYTHONPATH
S=ddp,zero2,fsdp2
zerolens estimate --nproc 1 --micro-batch 4 --strategies $S --json --preset gpt-100m --grad-accum 4 > estimate-grad-accum-4.json
zerolens estimate --nproc 1 --micro-batch 4 --strategies $S --json --model models:lora_llama --batch models:batch > estimate-lora.json
zerolens estimate --nproc 1 --micro-batch 4 --strategies $S --json --model models:bf16_llama --batch models:batch > estimate-bf16-weights.json
zerolens estimate --nproc 1 --micro-batch 4 --strategies $S --json --model hf:mixtral-small.json --seq-len 512 > estimate-moe.json
