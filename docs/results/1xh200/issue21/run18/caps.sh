# On the 2-core CPU machine, no GPU (the trace of a CUDA target on the CPU, compute capability 9.0):
zerolens estimate --preset gpt-1b --nproc 1 --micro-batch 8 --strategies zero1,zero2,fsdp2-grad --json > estimate-gpt-1b-mb8.json
