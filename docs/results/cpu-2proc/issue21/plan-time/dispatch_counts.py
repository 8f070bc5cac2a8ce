"""What a trace dispatches: gpt-1b at 8 ranks, bf16, micro-batch 8, the strategy named (rank 0, CUDA target,
three steps), each operation that reaches FakeTensorMode counted.

python3 dispatch_counts.py ddp > dispatch_counts.txt"""
import collections, sys
from torch._subclasses import fake_tensor as F
counts = collections.Counter()
orig = F.FakeTensorMode.dispatch
def dispatch(self, func, types, args=(), kwargs=None):
    counts[str(func)] += 1
    return orig(self, func, types, args, kwargs)
F.FakeTensorMode.dispatch = dispatch
from zerolens.models.model import PRESETS
from zerolens.predict import peak as PK
from zerolens.strategies import TrainSettings
name = sys.argv[1]
settings = TrainSettings(precision="bf16", world_size=8, micro_batch=8, reduce_bucket_size=50_000_000)
PK.traced_rank(name, PRESETS["gpt-1b"], settings, rank=0, cuda_capability=(9, 0), outcome=False, brackets=name in ("zero1", "zero2"))
print(sum(counts.values()))
for k, v in counts.most_common(25): print(v, k)
