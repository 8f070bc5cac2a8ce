"""The time FakeTensorMode spends on device queries (prim.device) and on every other operation in one DDP trace of
gpt-1b at 8 ranks, micro-batch 8 (a gpt-tiny trace first, to warm the process).

python3 device_query_time.py > device_query_time.txt"""
import collections, sys, time
import torch
from torch._subclasses import fake_tensor as F
from zerolens.predict import peak as PK
from zerolens.models.model import PRESETS
from zerolens.strategies import TrainSettings
spent = collections.Counter(); n = collections.Counter()
import zerolens.predict.peak as P
settings = TrainSettings(precision="bf16", world_size=8, micro_batch=8)
PK.traced_rank("ddp", PRESETS["gpt-tiny"], settings, rank=0, cuda_capability=(9, 0), outcome=False)
orig = F.FakeTensorMode.__torch_dispatch__
def td(self, func, types, args=(), kwargs=None):
    t = time.perf_counter()
    try:
        return orig(self, func, types, args, kwargs)
    finally:
        k = "device" if func is torch.ops.prim.device.default else "other"
        spent[k] += time.perf_counter() - t; n[k] += 1
F.FakeTensorMode.__torch_dispatch__ = td
t = time.perf_counter()
PK.traced_rank("ddp", PRESETS["gpt-1b"], settings, rank=0, cuda_capability=(9, 0), outcome=False)
print("total", round(time.perf_counter() - t, 2), {k: (n[k], round(v, 2)) for k, v in spent.items()})
