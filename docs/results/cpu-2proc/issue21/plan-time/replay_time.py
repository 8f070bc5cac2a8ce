"""How long the allocator model takes to replay one rank's sequence with no cap: ZeRO-2, DDP and FSDP2 on gpt-1b
(16 layers, 8 ranks, micro-batch 8, rank 0, CUDA target traced on the CPU), each allocator setting; the requests'
count and the seconds of one replay (the best of three). python3 replay_time.py > replay_time.txt"""
import time

from zerolens.models.model import PRESETS
from zerolens.predict.allocator import run_requests
from zerolens.predict.peak import predict_peaks
from zerolens.strategies import TrainSettings

settings = TrainSettings(precision="bf16", world_size=8, micro_batch=8)
for name in ("zero2", "ddp", "fsdp2"):
    requests = []
    predict_peaks(name, PRESETS["gpt-1b"], settings, cuda_capability=(9, 0), requests=requests)
    for setting, options in (("default", {}), ("expandable_segments", {"expandable": True})):
        best = None
        for _ in range(3):
            start = time.perf_counter()
            run_requests(requests, **options)
            best = min(best or 1e9, time.perf_counter() - start)
        print(name, setting, len(requests), "requests", f"{best * 1000:.1f} ms", flush=True)
