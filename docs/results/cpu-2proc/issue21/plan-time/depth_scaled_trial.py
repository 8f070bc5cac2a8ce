"""plan's depth-search trials for FSDP2 (gpt-1b at 33 and 30 layers, 8 ranks, micro-batch 8, 24 GiB) through
estimate's DepthScaling (five shallow traces, then the sequence scaled) against traced whole: time and whether
the predictions are equal.

python3 depth_scaled_trial.py > depth_scaled_trial.txt"""
import time
from zerolens.cli import ArgumentParser
from zerolens.commands import plan as planmod
from zerolens.run.flags import config_from_args
import zerolens.commands.plan as P
from zerolens.predict.depths import DepthScaling
parser = ArgumentParser(); sub = parser.add_subparsers(dest="command"); planmod.add_parser(sub)
args = parser.parse_args(["plan", "--gpu-memory", "24GiB", "--nproc", "8", "--preset", "gpt-1b"])
config = config_from_args(args, gpus_visible=0, checked=True)
GiB = 1 << 30
c = P.Candidate("fsdp2", 8, False, None).config(config)
P.predicted_peak(P.with_depth(c, 1), (9, 0))
ds = DepthScaling()
for d in (33, 30):
    t = time.perf_counter(); a = P.predicted_peak(P.with_depth(c, d), (9, 0), trace=ds, memory=24 * GiB); ta = time.perf_counter() - t
    t = time.perf_counter(); b = P.predicted_peak(P.with_depth(c, d), (9, 0), memory=24 * GiB); tb = time.perf_counter() - t
    print(d, "scaled", round(ta, 1), "traced", round(tb, 1), "equal", a == b, a.get("needs_bytes"), b.get("needs_bytes"), a.get("runs_in_memory"))
