"""Scaled vs whole at Llama-2-70B's own depth (80 blocks), rank RANK of RANKS: python check80.py STRATEGY RANKS RANK
(from the repository root; one JSON line: whether the scaled sequence equals the trace, request for request, and its figures)."""
import sys, time, json
from zerolens.models.hf import model_config_fields
from zerolens.models.model import ModelConfig
from zerolens.predict import depths
from zerolens.predict.peak import traced_rank
from zerolens.strategies import TrainSettings
name, n, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def cfg(d): return ModelConfig(**model_config_fields("examples/hf/llama2-70b.json", depth=d, seq_len=4096))
settings = TrainSettings(precision="bf16", micro_batch=1, world_size=n)
t = time.perf_counter()
recs = {d: traced_rank(name, cfg(d), settings, rank=rank, cuda_capability=(9, 0), outcome=False)[1] for d in depths.TRACED_DEPTHS}
scaled, why = depths.deepened(recs, 80)
t1 = time.perf_counter()
whole = traced_rank(name, cfg(80), settings, rank=rank, cuda_capability=(9, 0), outcome=False)[1]
t2 = time.perf_counter()
out = {"strategy": name, "ranks": n, "rank": rank, "why_not_depth_scaled": why, "shallow_and_scaling_s": round(t1 - t, 1),
       "whole_trace_s": round(t2 - t1, 1)}
if scaled is not None:
    want = depths.decode(depths.tokens(whole["requests"], whole["raw"]))
    out["requests"] = len(want)
    out["requests_equal"] = scaled["requests"] == want
    out["first_difference"] = next((i for i, (a, b) in enumerate(zip(scaled["requests"], want)) if a != b), None)
    out["requests_differing"] = sum(a != b for a, b in zip(scaled["requests"], want))
    from zerolens.predict.peak import rank_outcome
    a, b = rank_outcome(scaled), rank_outcome(whole)
    out["figures_equal"] = {k: a[k] == b[k] for k in ("peak_bytes", "reserved_peak_bytes", "min_allocator_cap_bytes")}
print(json.dumps(out))
