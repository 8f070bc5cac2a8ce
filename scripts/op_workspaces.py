"""Which operations allocate memory of their own inside one call, and how much, on a real GPU.

python3 scripts/op_workspaces.py --strategy ddp --model gpt-100m --micro-batch 8 --out ops.json [--steps 2]
    [--precision bf16] [--seq-len N]

The peak trace (predict/peak.py) sees the storages an operation returns, not the buffers its kernels
allocate and free inside it (cuDNN's attention workspaces, for one). Here the strategy trains at N=1 on
this GPU, as verify's loop does, under a dispatch mode that reads the caching allocator's counters
around every operation: the bytes and number of blocks allocated during it beyond its new outputs'
(`inside_bytes`, `inside_blocks`) and its peak above what it leaves allocated (`inside_peak_bytes`).
Written: every operation that allocated inside itself, with its argument shapes, in order, and a
summary per (operation, shapes).
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from zerolens.models.data import make_batch
from zerolens.models.hf import PREFIX, model_config_fields
from zerolens.models.model import PRESETS, ModelConfig, build_model
from zerolens.strategies import TrainSettings, make_strategy


def block_bytes(nbytes: int) -> int:
    return max(512, -(-nbytes // 512) * 512)


def shapes(args) -> list:
    flat, _ = tree_flatten(args)
    return [[list(a.shape), str(a.dtype).replace("torch.", "")] if isinstance(a, torch.Tensor) else None
            for a in flat if isinstance(a, torch.Tensor)]


class InsideOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []
        self.phase = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        before = torch.cuda.memory_stats()
        torch.cuda.reset_peak_memory_stats()
        out = func(*args, **kwargs)
        after = torch.cuda.memory_stats()
        new = {}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.is_cuda and t.untyped_storage().data_ptr() not in inputs:
                new[t.untyped_storage().data_ptr()] = block_bytes(t.untyped_storage().nbytes())
        allocated = after["allocated_bytes.all.allocated"] - before["allocated_bytes.all.allocated"]
        blocks = after["allocation.all.allocated"] - before["allocation.all.allocated"]
        inside = allocated - sum(new.values())
        if inside > 0:
            self.ops.append({"op": str(func), "phase": self.phase, "shapes": shapes((args, kwargs)),
                             "out_bytes": sum(new.values()), "inside_bytes": inside, "inside_blocks": blocks - len(new),
                             "inside_peak_bytes": after["allocated_bytes.all.peak"] - after["allocated_bytes.all.current"],
                             "stream": torch.cuda.current_stream().stream_id})
        return out


parser = argparse.ArgumentParser()
parser.add_argument("--strategy", required=True)
parser.add_argument("--model", required=True)
parser.add_argument("--micro-batch", type=int, default=8)
parser.add_argument("--seq-len", type=int)
parser.add_argument("--steps", type=int, default=2)
parser.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
parser.add_argument("--out", required=True)
args = parser.parse_args()

config = (ModelConfig(**model_config_fields(args.model[len(PREFIX):], depth=None, seq_len=args.seq_len))
          if args.model.startswith(PREFIX) else PRESETS[args.model])
settings = TrainSettings(precision=args.precision, micro_batch=args.micro_batch, world_size=1)
device = torch.device("cuda", 0)
torch.cuda.set_device(device)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29556", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
dist.init_process_group("nccl", device_id=device)
strategy = make_strategy(args.strategy, settings)
strategy.setup(build_model(config, 0), device)
torch.manual_seed(1)
probe = InsideOps()
with probe:
    for step in range(args.steps):
        tokens, labels = make_batch(config, step, seed=0, batch_size=args.micro_batch, signal=0.8)
        probe.phase = f"{step}:forward"
        loss = strategy.forward_loss(tokens, labels)
        probe.phase = f"{step}:backward"
        strategy.backward(loss)
        probe.phase = f"{step}:step"
        strategy.step()
        loss.item()
        del loss
torch.cuda.synchronize()
summary: dict = {}
for op in probe.ops:
    key = f"{op['op']} {json.dumps(op['shapes'])}"
    s = summary.setdefault(key, {"calls": 0, "inside_bytes": set(), "inside_blocks": set(), "inside_peak_bytes": set(),
                                 "out_bytes": set()})
    s["calls"] += 1
    for k in ("inside_bytes", "inside_blocks", "inside_peak_bytes", "out_bytes"):
        s[k].add(op[k])
summary = {k: {f: sorted(v) if isinstance(v, set) else v for f, v in s.items()} for k, s in summary.items()}
record = {"strategy": args.strategy, "model": args.model, "micro_batch": args.micro_batch, "seq_len": config.seq_len,
          "d_model": config.d_model, "num_heads": config.num_heads, "num_layers": config.num_layers, "precision": args.precision,
          "torch": torch.__version__, "gpu": torch.cuda.get_device_name(device),
          "cudnn": torch.backends.cudnn.version(), "summary": summary, "ops": probe.ops}
with open(args.out, "w") as f:
    json.dump(record, f, indent=1)
print(f"{args.strategy} {args.model} mb {args.micro_batch}: {len(probe.ops)} calls allocated inside, "
      f"{len(summary)} kinds")
for key, s in sorted(summary.items(), key=lambda kv: -max(kv[1]["inside_peak_bytes"]))[:12]:
    print(f"  {s['calls']:4d}x inside {s['inside_bytes']} peak {s['inside_peak_bytes']} blocks {s['inside_blocks']}: {key[:200]}")
strategy.teardown()
dist.destroy_process_group()
