"""gpt-1b's FSDP2 at 33 layers, 8 ranks, micro-batch 8, bf16 (plan's depth-search trial at 24 GiB): the
smallest cap the bisection finds for its allocations (the default allocator, both address orders), and which
caps from there to the uncapped reserve it runs under (allocator.runs_under), in steps of 2 MiB, against
24 GiB less what a torch process holds outside the allocator (plan's cap).

python3 window.py > window.txt"""
import dataclasses

from zerolens.models.model import PRESETS
from zerolens.predict import allocator as A
from zerolens.predict import peak as PK
from zerolens.strategies import TrainSettings

GiB, MiB = 1 << 30, 1 << 20
model = dataclasses.replace(PRESETS["gpt-1b"], num_layers=33)
settings = TrainSettings(precision="bf16", world_size=8, micro_batch=8)
out, record = PK.traced_rank("fsdp2", model, settings, rank=0, cuda_capability=(9, 0))
sequence = PK.plain_requests(record["requests"])
needs = A.allocator_needs(sequence)
cap, reserved = needs["min_allocator_cap_bytes"]["default"], needs["reserved_peak_bytes"]["default"]
plan_cap = 24 * GiB - A.outside_allocator_bytes(False)
print(f"requests {len(sequence)}; allocated peak {needs['allocated_peak_bytes']['default']}; smallest cap (bisection) "
      f"{cap}; reserved peak {reserved}; plan's cap at 24 GiB {plan_cap}")
step = 2 * MiB
runs = {c: A.runs_under(sequence, c, {}) for c in range(cap, reserved + step, step)}
windows, start = [], None
for c, ok in runs.items():
    if not ok and start is None:
        start = c
    if ok and start is not None:
        windows.append((start, c - step))
        start = None
print(f"caps tried: {len(runs)} from {cap} to {max(runs)}; runs under {sum(runs.values())}")
print("runs out of memory under (inclusive ranges, 2 MiB steps):", windows if windows else "none")
print(f"plan's cap {plan_cap}: runs under it: {A.runs_under(sequence, plan_cap, {})}")
