"""zerolens.track's log_to on one GPU: gpt-100m under DDP (bf16 autocast, micro-batch 8) in a plain loop,
sampled every 5 steps, its figures logged to a function, which keeps them; they are written beside
the run folder's summary, for comparison with what the run folder holds.

    python docs/results/1xh200/issue24/log_to_cuda.py --out $OUT/log_to
"""
import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import zerolens
from zerolens.models.model import PRESETS, build_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29732")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    config = PRESETS["gpt-100m"]
    model = nn.parallel.DistributedDataParallel(build_model(config, seed=0).cuda())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    logged = []
    with zerolens.track(model, optimizer, out=Path(args.out) / "run", every=5,
                        log_to=lambda figures, step: logged.append({"step": step, **figures})):
        for _ in range(args.steps):
            tokens = torch.randint(0, config.vocab_size, (8, config.seq_len), device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(tokens)
            nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()
            optimizer.step()
            optimizer.zero_grad()
    (Path(args.out) / "logged.json").write_text(json.dumps(logged, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
