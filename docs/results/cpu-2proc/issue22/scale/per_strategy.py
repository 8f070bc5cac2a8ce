# Each strategy's peak prediction timed alone, in one process (estimate's predicted_peaks): Llama-2-70B at N ranks.
# python docs/results/cpu-2proc/issue22/scale/per_strategy.py N ddp,zero0,... [profile]
import sys, time, cProfile, pstats
from zerolens.models.model import ModelConfig
from zerolens.models.hf import model_config_fields
from zerolens.strategies import TrainSettings
from zerolens.commands.estimate import predicted_peaks
n = int(sys.argv[1]); names = sys.argv[2].split(",")
mc = ModelConfig(**model_config_fields("examples/hf/llama2-70b.json", depth=80, seq_len=4096))
ts = TrainSettings(precision="bf16", micro_batch=1, world_size=n)
for s in names:
    t = time.time()
    if len(sys.argv) > 3:
        cProfile.run("p = predicted_peaks(s, mc, ts, (9, 0))", "/tmp/ps.prof")
        pstats.Stats("/tmp/ps.prof").sort_stats("cumulative").print_stats(25)
    else:
        p = predicted_peaks(s, mc, ts, (9, 0))
    print(n, s, round(time.time() - t, 1), "why_not" in p, flush=True)
