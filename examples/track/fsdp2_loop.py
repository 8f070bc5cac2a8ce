"""A plain FSDP2 training loop, measured by zerolens.track on every rank:

    torchrun --nproc-per-node 2 examples/track/fsdp2_loop.py --out runs/fsdp2-loop

On GPUs it runs on NCCL in bf16; without them on CPU processes (gloo) in fp32. The loop is the user's
own; zerolens.track around it is the only change."""
import argparse
import os

import torch
import torch.distributed as dist
from tiny_transformer import TinyTransformer, batch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import zerolens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="the run folder (runs/<time> by default)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5, help="measure every this many optimizer steps")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else None
    for block in model.blocks:
        fully_shard(block, **({"mp_policy": policy} if policy else {}))
    fully_shard(model, **({"mp_policy": policy} if policy else {}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with zerolens.track(model, optimizer, out=args.out, every=args.every):
        for step in range(args.steps):
            tokens, labels = batch(step, dist.get_rank(), 4, model, device)
            loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
