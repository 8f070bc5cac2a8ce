"""Records the CUDA caching allocator's every event over a few training steps, for the allocator model's fixtures.

python3 scripts/record_allocator.py --model gpt-1b --micro-batch 8 --out gpt-1b.json.gz [--steps 3]
    [--precision bf16] [--cap BYTES]   (--model: a preset, or hf:<model type or config.json>)

One process, one GPU, the allocator empty at the start: the model is built on the GPU, then `--steps`
steps of a plain loop (autocast, torch's foreach AdamW, cross-entropy in fp32) run under
torch.cuda.memory._record_memory_history. The allocator's settings are this process's
PYTORCH_CUDA_ALLOC_CONF: run it once per setting. Written, gzipped JSON: the settings, the GPU, and
every event of this device in order, each [action, address, size, stream] (the actions of the
snapshot's device_traces: alloc, free_requested, free_completed, segment_alloc, segment_free,
segment_map, segment_unmap), then the segments at the end, each [address, total_size, stream,
is_large_pool, [[block size, allocated], ...]]. With --cap the allocator may reserve that many bytes
(set_per_process_memory_fraction, within the cap's 2 MiB granule); out of memory exits with 3.
"""
import argparse
import gzip
import json
import os
import sys

import torch

from zerolens.models.data import make_batch
from zerolens.models.hf import PREFIX, model_config_fields
from zerolens.models.model import PRESETS, ModelConfig, build_model
from zerolens.strategies import loss_of

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--micro-batch", type=int, default=8)
parser.add_argument("--seq-len", type=int, default=None)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--precision", choices=("bf16", "fp16"), default="bf16")
parser.add_argument("--out", default=None)
parser.add_argument("--cap", type=int, default=None)
args = parser.parse_args()

if args.model.startswith(PREFIX):
    config = ModelConfig(**model_config_fields(args.model[len(PREFIX):], depth=None, seq_len=args.seq_len))
else:
    config = PRESETS[args.model]
device = torch.device("cuda", 0)
torch.cuda.set_device(device)
total_memory = torch.cuda.get_device_properties(device).total_memory
if args.cap is not None:  # segments are multiples of 2 MiB: a limit 1 MiB above the cap acts as the cap
    torch.cuda.set_per_process_memory_fraction(min(1.0, (args.cap + 2**20) / total_memory), device)
torch.cuda.memory._record_memory_history("all", context=None, max_entries=10_000_000)
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]
scaler = torch.amp.GradScaler("cuda", enabled=args.precision == "fp16")
try:
    model = build_model(config, seed=0).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    for step in range(args.steps):
        tokens, labels = make_batch(config, step, seed=0, batch_size=args.micro_batch, signal=0.8)
        tokens, labels = tokens.to(device), labels.to(device)
        with torch.autocast("cuda", dtype=dtype):
            loss = loss_of(model(tokens), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
except torch.OutOfMemoryError:
    print(f"{args.model}: out of memory under a cap of {args.cap} bytes")
    sys.exit(3)
torch.cuda.synchronize()
snapshot = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(None)
events = [[e["action"], e["addr"], e["size"], e["stream"]] for e in snapshot["device_traces"][0]]
segments = [[s["address"], s["total_size"], s["stream"], s["segment_type"] == "large",
             [[b["size"], b["state"] == "active_allocated"] for b in s["blocks"]]]
            for s in snapshot["segments"] if s["device"] == 0]
record = {"model": args.model, "micro_batch": args.micro_batch, "steps": args.steps, "precision": args.precision,
          "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "torch": torch.__version__,
          "gpu": torch.cuda.get_device_name(device), "total_memory": total_memory, "cap": args.cap,
          "max_memory_allocated": torch.cuda.max_memory_allocated(), "max_memory_reserved": torch.cuda.max_memory_reserved(),
          "events": events, "segments": segments}
if args.out:
    with gzip.open(args.out, "wt") as f:
        json.dump(record, f, separators=(",", ":"))
print(f"{args.model} (cap {args.cap}): {len(events)} events, {len(segments)} segments, "
      f"max allocated {record['max_memory_allocated']}, max reserved {record['max_memory_reserved']}")
