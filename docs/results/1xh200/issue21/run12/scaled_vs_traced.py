"""Micro-batch scaling (predict/micro_batches.py) against a trace, on a large model: each strategy's
ranks traced at micro-batches 1, 2, 4 and 8, then predicted at 16 by a MicroBatchScaling and traced
afresh; prints one JSON line per strategy (equal, scaled_from, seconds of each). Usage:
python3 scaled_vs_traced.py PRESET WORLD_SIZE STRATEGIES [--ckpt]"""
import json
import sys
import time

from zerolens.models.model import PRESETS
from zerolens.predict.micro_batches import MicroBatchScaling
from zerolens.predict.peak import predict_or_why_not, target_capability
from zerolens.strategies import TrainSettings, registry

registry.load_plugins()
preset, world_size, names = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
model = PRESETS[preset]
if "--ckpt" in sys.argv:
    import dataclasses
    model = dataclasses.replace(model, activation_checkpointing=True)
capability = target_capability("cuda")
for name in names:
    scaling = MicroBatchScaling()
    for micro_batch in (1, 2, 4, 8, 16):
        settings = TrainSettings(precision="bf16", world_size=world_size, micro_batch=micro_batch)
        started = time.perf_counter()
        scaled = predict_or_why_not(name, model, settings, cuda_capability=capability, trace=scaling)
        scaled_seconds = time.perf_counter() - started
    started = time.perf_counter()
    traced = predict_or_why_not(name, model, settings, cuda_capability=capability)
    traced_seconds = time.perf_counter() - started
    ranks = [{k: v for k, v in rank.items() if k != "scaled_from"} for rank in scaled["ranks"]]
    print(json.dumps({"preset": preset, "world_size": world_size, "strategy": name, "ckpt": "--ckpt" in sys.argv,
                      "traced_on": traced["ranks"][0]["traced_on"], "equal": ranks == traced["ranks"],
                      "scaled_from": scaled["ranks"][0].get("scaled_from"),
                      "scaled_seconds": round(scaled_seconds, 2), "traced_seconds": round(traced_seconds, 2),
                      "peak_bytes": traced["ranks"][0]["peak_bytes"],
                      "min_allocator_cap_bytes": traced["ranks"][0].get("min_allocator_cap_bytes")}), flush=True)
