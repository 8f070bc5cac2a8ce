"""One DDP trace of gpt-1b (16 layers, 8 ranks, micro-batch 8, CUDA target traced on the CPU), three steps,
with zerolens's tracker and with none (a stand-in that counts nothing: FakeTensorMode alone), seconds each,
after a first trace that warms the process. python3 tracker_share.py > tracker_share.txt"""
import time, torch
from zerolens.cli import ArgumentParser
from zerolens.commands import plan as P
from zerolens.run.flags import config_from_args
from zerolens.predict import peak
from zerolens.strategies import TrainSettings
parser = ArgumentParser(); sub = parser.add_subparsers(dest="command"); P.add_parser(sub)
args = parser.parse_args(["plan", "--gpu-memory", "24GiB", "--nproc", "8", "--preset", "gpt-1b"])
config = config_from_args(args, gpus_visible=0, checked=True)
c = P.Candidate("ddp", 8, False, None).config(config)
settings = c.train_settings("ddp")
def t(label, **kw):
    s=time.perf_counter(); peak.traced_rank("ddp", c.model, settings, cuda_capability=(9,0), outcome=False, **kw); print(label, round(time.perf_counter()-s,2), flush=True)
t("warm"); t("full"); t("full")
class Stub:
    _peak_mem = {}; _peak_mem_snap = {}
    def __enter__(self): return self
    def __exit__(self, *a): return False
    def settle(self): pass
    def reset_mod_stats(self): pass
    def get_tracker_snapshot(self, kind): return {}
orig = peak.totals_tracker
peak.totals_tracker = lambda *a, **k: Stub()
t("fake only"); t("fake only")
