"""zerolens with each trace (peak.traced_rank) and each allocator search (allocator.neediest_needs) timed in
the process that makes it, one JSON line each appended to /tmp/prof/traces.jsonl (the pool's workers are
forked from this process, so they inherit the wrappers). From anywhere zerolens is installed:

    python3 docs/results/cpu-2proc/issue21/plan-keys/tracelog.py plan --gpu-memory 24GiB --nproc 8 --preset gpt-1b --json
"""
import functools
import inspect
import json
import os
import sys
import time

from zerolens.cli import main
from zerolens.predict import allocator, depths, micro_batches, peak

LOG = "/tmp/prof/traces.jsonl"


def strategy_of_caller() -> tuple[str | None, str | None]:
    """The strategy a search is made for: the `name` of the nearest caller that has one."""
    frame = inspect.currentframe()
    while frame is not None and not (frame.f_code.co_name in ("predict_or_why_not", "spliced_ranks", "traced_rank")
                                     and "name" in frame.f_locals):
        frame = frame.f_back
    return (frame.f_locals["name"], frame.f_code.co_name) if frame else (None, None)


def timed(function, kind: str):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = function(*args, **kwargs)
        record = {"kind": kind, "pid": os.getpid(), "s": round(time.perf_counter() - start, 3)}
        if kind == "neediest":
            name, caller = strategy_of_caller()
            record.update(keys=len(args[0]), name=name, caller=caller)
        else:
            model_config, settings = args[1], args[2]
            record.update(name=args[0], layers=model_config.num_layers, ckpt=model_config.activation_checkpointing,
                          mb=settings.micro_batch, outcome=kwargs.get("outcome", True), rank=kwargs.get("rank", 0))
        with open(LOG, "a") as log:
            log.write(json.dumps(record) + "\n")
        return result
    return wrapper


if __name__ == "__main__":
    os.makedirs(os.path.dirname(LOG), exist_ok=True)
    trace = timed(peak.traced_rank, "trace")
    for module in (peak, micro_batches, depths):  # each imported the name itself
        module.traced_rank = trace
    search = timed(allocator.neediest_needs, "neediest")
    for module in (peak, allocator):
        module.neediest_needs = search
    sys.exit(main(sys.argv[1:]))
