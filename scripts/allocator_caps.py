"""The allocator model's smallest cap for recorded runs, against the real allocator under that cap and 2 MiB less.

python3 scripts/allocator_caps.py RECORDING.json.gz [...] > caps.json
For each recording of scripts/record_allocator.py: the smallest cap the model predicts for its
requests (predict/allocator.py, smallest_cap), then the same run again on this GPU under that cap
(which must run) and under 2 MiB less (which must run out of memory). Prints one JSON object.
"""
import gzip
import json
import subprocess
import sys

from zerolens.predict.allocator import SMALL_BUFFER, requests_of_recording, smallest_cap

out = {}
for path in sys.argv[1:]:
    with gzip.open(path, "rt") as f:
        record = json.load(f)
    cap = smallest_cap(requests_of_recording(record))
    command = [sys.executable, "scripts/record_allocator.py", "--model", record["model"], "--micro-batch",
               str(record["micro_batch"]), "--steps", str(record["steps"]), "--precision", record["precision"]]
    runs = {}
    for name, trial in (("at_cap", cap), ("below_cap", cap - SMALL_BUFFER)):
        result = subprocess.run([*command, "--cap", str(trial)], capture_output=True, text=True)
        runs[name] = {"cap_bytes": trial, "exit_code": result.returncode, "said": result.stdout.strip()[-300:]}
    out[path] = {"model": record["model"], "allocated_peak_bytes": record["max_memory_allocated"],
                 "reserved_peak_bytes": record["max_memory_reserved"], "predicted_smallest_cap_bytes": cap,
                 **runs, "as_predicted": runs["at_cap"]["exit_code"] == 0 and runs["below_cap"]["exit_code"] == 3}
print(json.dumps(out, indent=2))
