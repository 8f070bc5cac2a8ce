"""zerolens.track's cost on one GPU: identical DDP models trained on the same batches in one process,
one inside zerolens.track (every=50), one not, and one with only the communication hook track gives DDP
(to see the buckets), in interleaved blocks of 50 steps (so that drift of the GPU's clocks falls on
all); the blocks' times (synchronised at each block's end) give the overhead, and each sampled step's
own time (metrics_rank0.jsonl) against the median block step gives its cost.

    python docs/results/1xh200/issue24/track_overhead.py --out $OUT/overhead --json $OUT/overhead.json
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import zerolens
from zerolens.models.model import PRESETS, build_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="gpt-100m")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--block-steps", type=int, default=50)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--json", required=True, help="where the figures go (track prints its table)")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29731")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    config = PRESETS[args.preset]
    arms = {}
    for name in ("without", "with", "hook_only"):
        model = build_model(config, seed=0).cuda()
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0])
        arms[name] = (ddp, torch.optim.AdamW(model.parameters(), lr=1e-4))
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    arms["hook_only"][0].register_comm_hook(None, lambda state, bucket: allreduce_hook(None, bucket))
    g = torch.Generator(device="cuda").manual_seed(0)
    batches = [torch.randint(0, config.vocab_size, (args.micro_batch, config.seq_len + 1), device="cuda", generator=g)
               for _ in range(16)]

    def steps(name: str, n: int) -> float:
        ddp, optimizer = arms[name]
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(n):
            tokens = batches[i % len(batches)]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = ddp(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    blocks = {"without": [], "with": [], "hook_only": []}
    with zerolens.track(arms["with"][0], arms["with"][1], out=args.out, every=args.every):
        steps("without", 10)  # warm-up, outside the figures (the tracked arm's first block measures its step 0)
        for block in range(args.blocks):
            # A sampled step is the first of each tracked block; its census after the step comes at the
            # block's second forward, so no tracked step is left open while the other arm runs.
            order = ("without", "with", "hook_only")[block % 3:] + ("without", "with", "hook_only")[:block % 3]
            for name in order:
                blocks[name].append(steps(name, args.block_steps))
    per_step = {k: [t / args.block_steps for t in v] for k, v in blocks.items()}
    records = [json.loads(line) for line in open(os.path.join(args.out, "metrics_rank0.jsonl"))]
    median_without = statistics.median(per_step["without"])
    sampled = [r["seconds_sampled_step"] for r in records]
    open(args.json, "w").write(json.dumps({
        "preset": args.preset, "micro_batch": args.micro_batch, "every": args.every, "blocks": args.blocks,
        "block_steps": args.block_steps, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "seconds_per_step_without": per_step["without"], "seconds_per_step_with": per_step["with"],
        "median_seconds_per_step_without": median_without,
        "median_seconds_per_step_with": statistics.median(per_step["with"]),
        "seconds_per_step_hook_only": per_step["hook_only"],
        "overhead_of_track": statistics.median(per_step["with"]) / median_without - 1,
        "overhead_of_the_comm_hook_alone": statistics.median(per_step["hook_only"]) / median_without - 1,
        "sampled_steps": [r["step"] for r in records], "seconds_of_each_sampled_step": sampled,
        "sampled_step_over_a_median_step": [s / median_without for s in sampled],
    }, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
