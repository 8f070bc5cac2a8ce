"""The allocator model's smallest cap for recorded runs, against the real allocator under that cap and 2 MiB less.

python3 scripts/allocator_caps.py RECORDING.json.gz [...] [--bisect STEPS] > caps.jsonl
For each recording of scripts/record_allocator.py: the smallest cap the model predicts for its
requests (predict/allocator.py, smallest_cap, with the recording's PYTORCH_CUDA_ALLOC_CONF), then the
same run again on this GPU, with that PYTORCH_CUDA_ALLOC_CONF, under that cap (which should run) and
under 2 MiB less (which should run out of memory). With --bisect, where the
predicted cap ran out of memory, STEPS bisections of the real smallest cap between it and the
recorded run's reserved peak (which is checked to run). Prints one JSON object per recording, on
its own line as soon as it is done (each rerun is a process of its own: a time limit keeps those done).
"""
import argparse
import gzip
import json
import os
import subprocess
import sys

from zerolens.predict.allocator import SMALL_BUFFER, alloc_settings, cap_over_orders, requests_of_recording

parser = argparse.ArgumentParser()
parser.add_argument("recordings", nargs="+")
parser.add_argument("--bisect", type=int, default=0)
args = parser.parse_args()
for path in args.recordings:
    with gzip.open(path, "rt") as f:
        record = json.load(f)
    command = [sys.executable, "scripts/record_allocator.py", "--model", record["model"], "--micro-batch",
               str(record["micro_batch"]), "--steps", str(record["steps"]), "--precision", record["precision"]]

    def runs_under(cap: int) -> bool:
        result = subprocess.run([*command, "--cap", str(cap)], capture_output=True, text=True,
                                env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": record["alloc_conf"]})
        assert result.returncode in (0, 3), result.stdout + result.stderr
        return result.returncode == 0

    cap = cap_over_orders(requests_of_recording(record), **alloc_settings(record["alloc_conf"])[0])
    entry = {"model": record["model"], "alloc_conf": record["alloc_conf"], "allocated_peak_bytes": record["max_memory_allocated"],
             "reserved_peak_bytes": record["max_memory_reserved"], "predicted_smallest_cap_bytes": cap,
             "runs_at_cap": runs_under(cap), "runs_2_MiB_below": runs_under(cap - SMALL_BUFFER)}
    entry["as_predicted"] = entry["runs_at_cap"] and not entry["runs_2_MiB_below"]
    if args.bisect and not entry["runs_at_cap"]:
        low, high = cap, record["max_memory_reserved"]
        entry["runs_at_reserved_peak"] = runs_under(high)
        for _ in range(args.bisect if entry["runs_at_reserved_peak"] else 0):
            middle = (low + high) // 2 // SMALL_BUFFER * SMALL_BUFFER
            if middle <= low:
                break
            low, high = (low, middle) if runs_under(middle) else (middle, high)
        entry["real_smallest_cap_above_and_at_most"] = [low, high]
    print(json.dumps({"recording": path, **entry}), flush=True)
