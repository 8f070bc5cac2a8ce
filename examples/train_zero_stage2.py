"""The classic ZeRO Stage 2 demo, measured correctly.

    deepspeed --num_gpus=2 examples/train_zero_stage2.py stage2
    deepspeed --num_gpus=2 examples/train_zero_stage2.py baseline

Same model, DeepSpeed settings and output line as the case study (`step=.. loss=..
grad_mem_rank0=..MB`), with two fixes: the gradient memory is counted right after backward from
the buffers DeepSpeed really uses (after `engine.step()` every `p.grad` is None, which is why the
original printed 0.00MB), and the data has a learnable rule, so the loss falls. On a machine
without GPUs the launcher starts CPU processes (gloo) and bf16 replaces fp16.
"""
import argparse
import os
import sys

import deepspeed
import torch
import torch.distributed as dist

from zerolens.measure.census import count
from zerolens.models.data import global_batch, rank_slice
from zerolens.models.model import ModelConfig, build_model
from zerolens.strategies import TrainSettings, make_strategy

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=["stage2", "baseline"])
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--local_rank", "--local-rank", type=int, default=0)  # added by the deepspeed launcher
args = parser.parse_args()

cuda = torch.cuda.is_available()
deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", args.local_rank))) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
precision = "fp16" if cuda else "bf16"
if rank == 0 and not cuda:
    print("note: no GPU, so CPU processes with gloo, and bf16 instead of fp16 (DeepSpeed has no fp16 on CPU)")

config = ModelConfig()
settings = TrainSettings(precision=precision, lr=1e-4, micro_batch=8, world_size=world_size)
strategy = make_strategy("zero2" if args.mode == "stage2" else "zero0", settings)
strategy.setup(build_model(config, args.seed), device)
torch.manual_seed(args.seed + 1 + rank)

for step in range(args.steps):
    tokens, labels = global_batch(step, seed=args.seed, batch_size=8 * world_size, seq_len=config.seq_len,
                                  vocab_size=config.vocab_size, num_classes=config.num_classes, signal=0.8)
    tokens, labels = rank_slice(tokens, labels, rank, world_size)
    loss = strategy.forward_loss(tokens, labels)
    strategy.backward(loss)
    # Between backward and step is the only moment gradients exist; count the buffers that hold them.
    grad_bytes = count(strategy.holdings())["grad_bytes"]
    strategy.step()
    if rank == 0:
        print(f"step={step} loss={loss.item():.4f} grad_mem_rank0={grad_bytes / 1e6:.2f}MB "
              f"({grad_bytes / 2**20:.3f} MiB, after backward)", flush=True)

per_rank = [None] * world_size
dist.all_gather_object(per_rank, grad_bytes)
if rank == 0:
    print(f"{args.mode}: gradient bytes held after backward per rank: "
          + ", ".join(f"rank{r}={b / 2**20:.3f} MiB" for r, b in enumerate(per_rank)))
strategy.teardown()
dist.barrier()  # no rank tears the process group down while another still uses it
dist.destroy_process_group()
# Everything is printed and the process group is gone. Skip the interpreter's own teardown, as
# zerolens's worker does: on CPU, gloo's C++ threads can abort it after the run has finished
# ("terminate called without an active exception"; torch issue 190489, PR 179291), which the
# launcher would report as a failed rank.
sys.stdout.flush()
os._exit(0)
