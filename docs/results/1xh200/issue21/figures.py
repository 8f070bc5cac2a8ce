"""The figures of gpu_run2.sh's runs, as one JSON object: per verify run and strategy, the reserved peak
predicted (the allocator model on the fake-CUDA trace's allocations) beside measured, the smallest cap
predicted, and the memory outside the allocator; per plan --check, each candidate's runs at and 1% below
its predicted cap. python3 figures.py RUN_FOLDER... PLAN_JSON..."""
import json
import sys
from pathlib import Path

out = {}
for arg in sys.argv[1:]:
    path = Path(arg)
    if path.is_dir():
        summary = json.loads((path / "summary.json").read_text())
        env = json.loads((path / "env.json").read_text())
        runs = {}
        for name, s in summary["strategies"].items():
            for r in s["ranks"]:
                p = r.get("predicted_peaks") or {}
                runs[f"{name}/rank{r['rank']}"] = {
                    "measured_peak_bytes": r["peak_bytes"], "predicted_peak_bytes": p.get("peak_bytes"),
                    "measured_reserved_peak_bytes": r["reserved_peak_bytes"],
                    "predicted_reserved_peak_bytes": p.get("reserved_peak_bytes"),
                    "predicted_min_allocator_cap_bytes": p.get("min_allocator_cap_bytes"),
                    "outside_allocator_after_step": r.get("outside_allocator_after_step")}
        out[path.name] = {"command": summary.get("command"), "verdict": summary["verdict"],
                          "alloc_conf": env.get("env", {}).get("PYTORCH_CUDA_ALLOC_CONF") if isinstance(env.get("env"), dict) else None,
                          "torch": env.get("torch"), "gpu": env.get("gpu_name") or env.get("gpus"), "ranks": runs}
    else:
        plan = json.loads(path.read_text())
        out[path.stem] = {"command": plan["command"], "allocator_setting": plan["allocator_setting"],
                          "checked": plan.get("checked")}
print(json.dumps(out, indent=1))
