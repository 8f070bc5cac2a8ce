import gzip, json, collections, sys
from zerolens.predict.allocator import requests_of_recording, round_size, run_requests, smallest_cap
from zerolens.predict.peak import predict_peaks
from zerolens.models.model import PRESETS
from zerolens.strategies import TrainSettings
r = json.load(gzip.open(sys.argv[1], 'rt'))
real = requests_of_recording(r)
trace = []
predict_peaks(r["strategy"], PRESETS[r["model"]], TrainSettings(precision=r["precision"], micro_batch=r["micro_batch"], world_size=1),
              cuda_capability=(9, 0), steps=r["steps"], requests=trace)
rs = collections.Counter(round_size(x[2]) for x in real if x[0] == "alloc")
ts = collections.Counter(round_size(x[2]) for x in trace if x[0] == "alloc")
differ = {s: rs[s] - ts[s] for s in rs | ts if rs[s] != ts[s]}
print("real reserved", r["max_memory_reserved"], "model on real", run_requests(real).reserved_peak, "on trace", run_requests(trace).reserved_peak)
print("cap on real", smallest_cap(real), "on trace", smallest_cap(trace))
print(len(real), len(trace), sorted(differ.items(), key=lambda kv: -abs(kv[1]) * kv[0])[:14])
import difflib
def big(seq, lim=30*2**20):
    return [round_size(s)//2**20 for a,_,s,_ in seq if a=="alloc" and s>=lim]
rb, tb = big(real), big(trace)
sm = difflib.SequenceMatcher(a=rb, b=tb, autojunk=False)
n=0
for op, i1, i2, j1, j2 in sm.get_opcodes():
    if op != "equal":
        print(op, i1, rb[max(0,i1-6):i2+3], "|", tb[max(0,j1-6):j2+3]); n+=1
        if n>12: break
