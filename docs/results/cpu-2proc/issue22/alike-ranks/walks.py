"""The splice's walk of the brackets for every rank of ZeRO-2 on Llama-2-70B's shape at 4096 ranks: once per
rank (before b59f059) and once per distinct `alike` (after), alternated in one process on one trace, so that
the machine's own swings (the whole command's time varied by 20% between rounds here) weigh on both alike.
From the repository root: python3 docs/results/cpu-2proc/issue22/alike-ranks/walks.py"""
import json
import time

from zerolens.models.hf import model_config_fields
from zerolens.models.model import ModelConfig
from zerolens.predict.peak import cuda_bytes, rank_peaks, traced_rank, without_brackets
from zerolens.strategies import TrainSettings

model = ModelConfig(**model_config_fields("examples/hf/llama2-70b.json", depth=80, seq_len=4096))
settings = TrainSettings(precision="bf16", world_size=4096, micro_batch=1)
record = traced_rank("zero2", model, settings, cuda_capability=(9, 0), brackets=True, outcome=False)[1]
base, _ = without_brackets(record["requests"])
step_model = record["step_model"]


def every_rank():
    return [rank_peaks(base, step_model.rank_requests(rank), cuda_bytes) for rank in range(settings.world_size)]


def once_per_alike():
    walked, out = {}, []
    for rank in range(settings.world_size):
        own = step_model.rank_requests(rank)
        if own.alike not in walked:
            walked[own.alike] = rank_peaks(base, own, cuda_bytes)
        out.append(walked[own.alike])
    return out


times = {"every_rank": [], "once_per_alike": []}
for _ in range(3):
    for name, walk in (("every_rank", every_rank), ("once_per_alike", once_per_alike)):
        started = time.process_time()
        result = walk()
        times[name].append(round(time.process_time() - started, 2))
        walk.results = result
print(json.dumps({"brackets": sum(item[0] == "bracket" for item in base), "ranks": settings.world_size,
                  "distinct_alike": len({step_model.rank_requests(r).alike for r in range(settings.world_size)}),
                  "same_walks": every_rank.results == once_per_alike.results, "cpu_s": times}))
