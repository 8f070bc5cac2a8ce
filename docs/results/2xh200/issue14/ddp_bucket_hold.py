"""Does holding DDP's bucket buffers from a communication hook (as zerolens's census did) keep the
old buckets alive after DDP rebuilds them in the second iteration? The allocator's peak per step,
plain DDP against DDP with a hook that keeps each bucket's buffer in a dict.

torchrun --nproc-per-node 2 docs/results/2xh200/issue14/ddp_bucket_hold.py [hold|plain] [preset]
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from zerolens.models.model import PRESETS, build_model
from zerolens.strategies.base import loss_of

mode, preset = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "gpt-100m"
dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
config = PRESETS[preset]
model = build_model(config, 0).cuda()
ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[torch.cuda.current_device()])
held = {}
if mode == "hold":
    def hook(state, bucket):
        held[bucket.index()] = bucket.buffer()
        return allreduce_hook(None, bucket)
    ddp.register_comm_hook(None, hook)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
tokens = torch.randint(0, config.vocab_size, (8, config.seq_len), device="cuda")
for step in range(4):
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = ddp(tokens)
    loss = loss_of(logits, tokens)
    del logits
    loss.backward()
    del loss
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if rank == 0:
        print(f"{mode} step {step}: peak {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB, "
              f"after {torch.cuda.memory_allocated() / 2**20:.1f} MiB, buckets held {len(held)}", flush=True)
dist.destroy_process_group()
