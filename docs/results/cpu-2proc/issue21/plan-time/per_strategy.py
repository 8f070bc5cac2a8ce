"""plan's cost per prediction: gpt-1b at 8 ranks, bf16, micro-batch MB (the first argument), 16 layers, one
predicted_peak per strategy named after it, in one warm process (a one-layer prediction first), each timed
whole and in the allocator model (neediest_needs) with its replays (run_requests).

python3 per_strategy.py 8 ddp zero1 zero2 zero3 fsdp2 fsdp2-grad zero0 > per_strategy.txt"""
import sys, time
import torch
from zerolens.cli import ArgumentParser
from zerolens.commands import plan as planmod
from zerolens.run.flags import config_from_args
import zerolens.commands.plan as P
import zerolens.predict.allocator as A
import zerolens.predict.peak as PK
spent = {"alloc": 0.0, "replays": 0}
orig_nn, orig_rr = A.neediest_needs, A.run_requests
def nn_(*a, **k):
    t = time.perf_counter(); r = orig_nn(*a, **k); spent["alloc"] += time.perf_counter() - t; return r
def rr(*a, **k):
    spent["replays"] += 1; return orig_rr(*a, **k)
A.neediest_needs = nn_; PK.neediest_needs = nn_; A.run_requests = rr
parser = ArgumentParser(); sub = parser.add_subparsers(dest="command"); planmod.add_parser(sub)
args = parser.parse_args(["plan", "--gpu-memory", "24GiB", "--nproc", "8", "--preset", "gpt-1b"])
config = config_from_args(args, gpus_visible=0, checked=True)
P.predicted_peak(P.with_depth(P.Candidate("ddp", 1, False, None).config(config), 1), (9, 0))
mb = int(sys.argv[1])
for name in sys.argv[2:]:
    spent.update(alloc=0.0, replays=0)
    c = P.Candidate(name, mb, False, config.reduce_bucket_size if name.startswith("zero") else None).config(config)
    t = time.perf_counter()
    r = P.predicted_peak(c, (9, 0))
    print(name, round(time.perf_counter() - t, 2), "allocator", round(spent["alloc"], 2), "replays", spent["replays"], r.get("needs_bytes"), flush=True)
