"""How long estimate's two tracing workers take to be ready to trace the 70B (Llama-2-70B's shape), forked
from the command's process (5b2a259) or spawned afresh (before): from the pool's start until both have
imported what a trace needs and built the model's meta copy, alternated, three rounds, in a process that
has done what estimate's does before its pool starts (imports, the model on the meta device).
From the repository root: python3 docs/results/cpu-2proc/issue22/forked-workers/startup.py"""
import json
import time

import zerolens.commands.estimate  # noqa: F401  (what the command's process has imported)
from zerolens.commands import workers
from zerolens.models.hf import model_config_fields
from zerolens.models.model import ModelConfig, meta_model

MODEL = ModelConfig(**model_config_fields("examples/hf/llama2-70b.json", depth=80, seq_len=4096))
meta_model(MODEL)


def ready(_) -> float:
    """What a worker does before its first trace: the tracing modules imported, the model built."""
    import zerolens.predict.depths  # noqa: F401
    import zerolens.predict.peak  # noqa: F401
    meta_model(MODEL)
    return time.process_time()


if __name__ == "__main__":
    seconds = {"fork": [], "spawn": []}
    worker_cpu = {"fork": [], "spawn": []}
    for _ in range(3):
        for method in ("spawn", "fork"):
            workers.start_method = lambda method=method: method
            started = time.perf_counter()
            with workers.pool(2) as pool:
                cpu = list(pool.map(ready, range(2)))
            seconds[method].append(round(time.perf_counter() - started, 2))
            worker_cpu[method].append([round(c, 2) for c in cpu])
    print(json.dumps({"wall_s_until_both_ready": seconds, "each_workers_cpu_s_then": worker_cpu}))
