"""The Hugging Face Trainer + DeepSpeed ZeRO-2 example (one parameter group) tracked on one GPU, beside
`zerolens verify` of the same model and settings: retained bytes per component, and each phase's
measured peak in the Trainer beside verify's predicted and measured ones.

    python docs/results/1xh200/issue24/compare_trainer.py TRACKED_RUN VERIFY_RUN > comparison.json
"""
import json
import sys
from pathlib import Path

from zerolens.strategies.layout import RETAINED_KEYS

tracked = json.loads((Path(sys.argv[1]) / "summary.json").read_text())["strategies"]["zero2"]["ranks"][0]
verified = json.loads((Path(sys.argv[2]) / "summary.json").read_text())["strategies"]["zero2"]["ranks"][0]
phases = ("forward", "backward", "step")
print(json.dumps({
    "retained_equal": {k: tracked[k] == verified[k] for k in RETAINED_KEYS},
    "retained": {k: [tracked[k], verified[k]] for k in RETAINED_KEYS},
    "peak_tracked": {p: tracked[f"peak_during_{p}"] for p in phases},
    "peak_verify_measured": {p: verified[f"peak_during_{p}"] for p in phases},
    "peak_verify_predicted": {p: verified.get("predicted_peaks", {}).get(f"peak_during_{p}") for p in phases},
    "reserved_peak_tracked": tracked["reserved_peak_bytes"],
}, indent=1))
