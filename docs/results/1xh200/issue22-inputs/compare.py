"""Each phase's predicted peak (estimate-*.json, made on the CPU machine by estimates.sh) against the
allocator's measured on one H200 (run/verify-*-summary.json.gz): the bytes asked, and as the allocator
model counts them (allocated_phase_peaks, the default allocator). python3 compare.py (from this folder)."""
import gzip
import json

print(f"{'case':13} {'strategy':8} {'phase':8} {'measured':>12} {'asked':>8} {'counted':>8}")
worst = {"asked": 0.0, "counted": 0.0}
for case in ("grad-accum-4", "lora", "bf16-weights", "moe"):
    measured = json.load(gzip.open(f"run/verify-{case}-summary.json.gz"))["strategies"]
    predicted = json.load(open(f"estimate-{case}.json"))["strategies"]
    for name, strategy in measured.items():
        run, rank = strategy["ranks"][0], predicted[name]["ranks"][0]
        for phase in ("forward", "backward", "step"):
            m = run[f"peak_during_{phase}"]
            asked = rank[f"peak_during_{phase}"] / m - 1
            counted = rank["allocated_phase_peaks"]["default"][phase] / m - 1
            worst = {"asked": max(worst["asked"], abs(asked)), "counted": max(worst["counted"], abs(counted))}
            print(f"{case:13} {name:8} {phase:8} {m:12d} {asked:+8.2%} {counted:+8.2%}")
print(f"largest error: asked {worst['asked']:.2%}, counted {worst['counted']:.2%}")
