"""Each configuration's smallest cap (default allocator) in each address order, gpt-1b at N=1, traced on CPU for a CUDA target."""
import dataclasses, json, sys, time
from zerolens.models.model import PRESETS
from zerolens.strategies import TrainSettings
from zerolens.predict.peak import predict_peaks
from zerolens.predict.allocator import smallest_cap, cap_granularity, run_requests

out = []
for name in sys.argv[1].split(","):
    for ckpt in (False, True):
        for mb in (int(x) for x in sys.argv[2].split(",")):
            model = dataclasses.replace(PRESETS["gpt-1b"], activation_checkpointing=ckpt)
            settings = TrainSettings(precision="bf16", world_size=1, micro_batch=mb)
            reqs = []
            t = time.time()
            p = predict_peaks(name, model, settings, cuda_capability=(9, 0), requests=reqs)
            row = {"strategy": name, "checkpointing": ckpt, "micro_batch": mb, "peak": p["peak_bytes"]}
            for order in ("downwards", "upwards"):
                run = run_requests(reqs, addresses=order)
                row[order] = {"reserved": run.reserved_peak,
                              "cap": smallest_cap(reqs, uncapped=run, granularity=cap_granularity(run.reserved_peak), addresses=order)}
            row["min_allocator_cap_bytes"] = p["min_allocator_cap_bytes"]["default"]
            row["diff_mib"] = (row["downwards"]["cap"] - row["upwards"]["cap"]) / 2**20
            row["seconds"] = round(time.time() - t, 1)
            print(json.dumps(row), flush=True)
