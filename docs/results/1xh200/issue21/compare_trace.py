"""Where the peak trace's allocations part from the GPU's, for recordings of scripts/record_strategy_allocator.py
(gpu_run3.sh; the recordings, 172 KB, are not kept: docs/results stays under 3 MiB).

python3 compare_trace.py RECORDING.json.gz... > trace_vs_gpu.json
Per recording: the real allocator's peaks, the model's reserved peak and smallest cap on the real
requests (from an empty allocator: the recording began after NCCL had made its first segments) and on
the trace's, the allocations per stream of each (gpu_run9.sh added the caps and the trace's streams), and
the request sizes (rounded to 512 bytes) whose counts differ most, in bytes times count.
"""
import collections
import gzip
import json
import sys

from zerolens.predict.allocator import requests_of_recording, round_size, run_requests, smallest_cap

out = {}
for path in sys.argv[1:]:
    with gzip.open(path, "rt") as f:
        r = json.load(f)
    real = requests_of_recording(r)
    trace = [tuple(x) for x in r["trace_requests"]]
    real_sizes = collections.Counter(round_size(x[2]) for x in real if x[0] == "alloc")
    trace_sizes = collections.Counter(round_size(x[2]) for x in trace if x[0] == "alloc")
    differ = {size: real_sizes[size] - trace_sizes[size] for size in real_sizes | trace_sizes
              if real_sizes[size] != trace_sizes[size]}
    out[f"{r['strategy']} {r['model']}"] = {
        "micro_batch": r["micro_batch"], "steps": r["steps"], "precision": r["precision"],
        "real_allocated_peak": r["max_memory_allocated"], "real_reserved_peak": r["max_memory_reserved"],
        "predicted_allocated_peak": r["predicted"]["peak_bytes"],
        "model_reserved_peak_on_real_requests": run_requests(real).reserved_peak,
        "model_reserved_peak_on_trace_requests": run_requests(trace).reserved_peak,
        "real_allocations": sum(real_sizes.values()), "trace_allocations": sum(trace_sizes.values()),
        "model_smallest_cap_on_real_requests": smallest_cap(real),
        "model_smallest_cap_on_trace_requests": smallest_cap(trace),
        "streams_of_real_allocations": dict(collections.Counter(x[3] for x in real if x[0] == "alloc")),
        "streams_of_trace_allocations": dict(collections.Counter(x[3] for x in trace if x[0] == "alloc")),
        "sizes_whose_counts_differ_most (size: real minus trace)": dict(
            sorted(differ.items(), key=lambda kv: -abs(kv[1]) * kv[0])[:12])}
print(json.dumps(out, indent=1))
