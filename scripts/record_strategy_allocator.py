"""Records the CUDA caching allocator under one of zerolens's strategies at N=1, beside the peak trace's allocations for the same step.

python3 scripts/record_strategy_allocator.py --strategy ddp --model gpt-1b --micro-batch 8 --out ddp.json.gz
    [--steps 3] [--precision bf16]

First the peak prediction's trace (predict/peak.py) on fake CUDA tensors, its allocations kept
(`trace_requests`: [action, id, size, stream]); then the strategy itself trains `--steps` steps on
this GPU as verify's loop does (one rank, NCCL), under torch.cuda.memory._record_memory_history.
Written, gzipped JSON as scripts/record_allocator.py writes it, with `trace_requests` and what the
model predicts from them. To find where the trace's allocations part from the GPU's.
"""
import argparse
import gzip
import json
import os

import torch
import torch.distributed as dist

from zerolens.models.data import make_batch
from zerolens.models.hf import PREFIX, model_config_fields
from zerolens.models.model import PRESETS, ModelConfig, build_model
from zerolens.predict.allocator import ADDRESS_ORDERS, run_requests
from zerolens.predict.peak import predict_peaks
from zerolens.strategies import TrainSettings, make_strategy

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", required=True)
parser.add_argument("--model", required=True)
parser.add_argument("--micro-batch", type=int, default=8)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--precision", choices=("bf16", "fp16"), default="bf16")
parser.add_argument("--out", required=True)
args = parser.parse_args()

config = (ModelConfig(**model_config_fields(args.model[len(PREFIX):], depth=None, seq_len=None))
          if args.model.startswith(PREFIX) else PRESETS[args.model])
settings = TrainSettings(precision=args.precision, micro_batch=args.micro_batch, world_size=1)
device = torch.device("cuda", 0)
torch.cuda.set_device(device)
trace: list = []
predicted = predict_peaks(args.strategy, config, settings, cuda_capability=torch.cuda.get_device_capability(device),
                          steps=args.steps, requests=trace)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29555", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
dist.init_process_group("nccl", device_id=device)
torch.cuda.memory._record_memory_history("all", context=None, max_entries=10_000_000)
strategy = make_strategy(args.strategy, settings)
strategy.setup(build_model(config, 0), device)
torch.manual_seed(1)
for step in range(args.steps):
    tokens, labels = make_batch(config, step, seed=0, batch_size=args.micro_batch, signal=0.8)
    loss = strategy.forward_loss(tokens, labels)
    strategy.backward(loss)
    strategy.step()
    loss.item()
    del loss
torch.cuda.synchronize()
snapshot = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(None)
events = [[e["action"], e["addr"], e["size"], e["stream"]] for e in snapshot["device_traces"][0]]
record = {"strategy": args.strategy, "model": args.model, "micro_batch": args.micro_batch, "steps": args.steps,
          "precision": args.precision, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
          "torch": torch.__version__, "gpu": torch.cuda.get_device_name(device),
          "max_memory_allocated": torch.cuda.max_memory_allocated(), "max_memory_reserved": torch.cuda.max_memory_reserved(),
          "events": events, "trace_requests": trace,
          "trace_reserved_peak": max(run_requests(trace, addresses=order).reserved_peak for order in ADDRESS_ORDERS),
          "predicted": predicted}
with gzip.open(args.out, "wt") as f:
    json.dump(record, f, separators=(",", ":"), default=str)
print(f"{args.strategy} {args.model}: {len(events)} events (trace: {len(trace)} requests); allocated peak "
      f"{record['max_memory_allocated']} (predicted {predicted['peak_bytes']}), reserved peak "
      f"{record['max_memory_reserved']} (the trace through the model: {record['trace_reserved_peak']})")
strategy.teardown()
dist.destroy_process_group()
