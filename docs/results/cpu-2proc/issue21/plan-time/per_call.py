"""Every predicted_peak that plan makes for `zerolens plan --gpu-memory 24GiB --nproc 8 --preset gpt-1b`, in
one process (jobs=1), one line each: strategy, micro-batch, checkpointing, layers, seconds, scaled from other
traces. python3 per_call.py > per_call-<commit>.txt (its reduce bucket, 5e8, is not the CLI default, 5e7, so
the depth search traced the 16-layer ZeRO-1/2 again)."""
import time, sys, json
from zerolens.cli import ArgumentParser
from zerolens.commands import plan as P
from zerolens.run.flags import config_from_args
from zerolens.predict.peak import target_capability
parser = ArgumentParser(); sub = parser.add_subparsers(dest="command"); P.add_parser(sub)
args = parser.parse_args(["plan", "--gpu-memory", "24GiB", "--nproc", "8", "--preset", "gpt-1b"])
config = config_from_args(args, gpus_visible=0, checked=True)
inner = P.predicted_peak
log = []
def timed(c, cap, trace=None, memory=None):
    t = time.perf_counter(); out = inner(c, cap, trace, memory); dt = time.perf_counter() - t
    row = (c.strategies[0], c.micro_batch, c.model.activation_checkpointing, c.model.num_layers, round(dt, 2), "scaled_from" in out)
    log.append(row); print(*row, flush=True)
    return out
P.predicted_peak = timed
t = time.perf_counter()
r = P.plan(config, memory=24 << 30, micro_batches=[1,2,4,8,16,32,64], reduce_bucket_sizes=[int(5e8)], cuda_capability=target_capability("cuda"), jobs=1)
print("total", time.perf_counter() - t)
