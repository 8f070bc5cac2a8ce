"""Predicted peaks against a verify run's measured ones, per strategy, rank and phase.

python3 scripts/predict_vs_measured.py RUN_FOLDER [--trace cpu|cuda]
Reads RUN_FOLDER/config.json and summary.json, predicts again (predict/peak.py) and prints the
relative errors; with --trace cpu a CUDA run's step is traced on the CPU (as where no GPU is visible).
"""
import argparse
import json
from pathlib import Path

import torch

from zerolens.predict import peak as predict_peak
from zerolens.report.checks import predicted_for_measurement
from zerolens.run.config import load_config
from zerolens.strategies.base import PHASES

parser = argparse.ArgumentParser()
parser.add_argument("run")
parser.add_argument("--trace", choices=("cpu", "cuda"), default=None)
args = parser.parse_args()
config = load_config(str(Path(args.run) / "config.json"))
summary = json.loads((Path(args.run) / "summary.json").read_text())
capability = (9, 0) if summary["device"] == "cuda" else None
if capability and torch.cuda.is_available():
    capability = torch.cuda.get_device_capability()
predicted = predict_peak.predicted_peaks(config, capability, trace_on=args.trace)
for name, s in summary["strategies"].items():
    if "ranks" not in predicted[name]:
        print(name, predicted[name]["why_not"])
        continue
    for r in s["ranks"]:
        prediction = predicted[name]["ranks"][r["rank"]]
        p = predicted_for_measurement(r | {"predicted_peaks": prediction})
        print(name, r["rank"], prediction["traced_on"], " ".join(
            f"{ph} {p[f'peak_during_{ph}'] / 2**20:.1f}/{r[f'peak_during_{ph}'] / 2**20:.1f} MiB "
            f"{p[f'peak_during_{ph}'] / r[f'peak_during_{ph}'] - 1:+.2%}" for ph in PHASES))
