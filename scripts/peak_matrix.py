"""The peak prediction's acceptance matrix: predicted against measured peaks over models and micro-batches.

One `zerolens verify` per (model, micro-batch, activation checkpointing), every strategy in each, and one
table of predicted against measured peaks per strategy, rank and phase, with each rank's "peak as
predicted" check (issue 14).

python3 scripts/peak_matrix.py --out DIR [--presets case-study,gpt-100m,gpt-1b] [--micro-batches 4,8,16]
    [--checkpointing off,on] [--strategies ddp,zero0,...] [--steps 4] [--memory-limit-gib G]

Resumable: a point whose folder holds a summary.json (or capped.json) is not run again, so the
matrix can be spread over several sessions (run it again with the same --out). With
--memory-limit-gib every strategy of a point runs alone under that cap, after its peak is predicted
(run_capped: predicted not to fit, it must run out of memory; predicted to fit with room to spare,
it must fit). matrix.json and matrix.md in DIR are written from every point's folder at the end.
"""
import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path

from zerolens.models.model import PRESETS
from zerolens.report.checks import predicted_for_measurement
from zerolens.report.tables import markdown_table
from zerolens.run.config import RunConfig
from zerolens.run.validate import check_config
from zerolens.strategies.base import PHASES
from zerolens.units import GiB, MiB


def point_config(args, preset: str, micro_batch: int, checkpointing: bool, out: Path) -> RunConfig:
    import torch
    model = dataclasses.replace(PRESETS[preset], activation_checkpointing=checkpointing)
    strategies = tuple(args.strategies.split(","))
    precision = {"case-study": "fp16"}.get(preset, "bf16")
    config = RunConfig(strategies=strategies, baseline=strategies[0], nproc=2, device="cuda", precision=precision,
                       steps=args.steps, micro_batch=micro_batch, preset=preset, model=model, out=str(out),
                       memory_limit_gib=args.memory_limit_gib, timeout=600)
    check_config(config, gpus_visible=torch.cuda.device_count())
    return config


def allocator_limit(config: RunConfig) -> int:
    import torch
    total = torch.cuda.get_device_properties(0).total_memory
    return min(total, int(config.memory_limit_gib * GiB)) if config.memory_limit_gib else total


def rows_of(point: str, summary: dict) -> list[list]:
    rows = []
    for name, s in summary["strategies"].items():
        for r in s["ranks"]:
            if not r.get("predicted_peaks"):
                rows.append([point, name, r["rank"], s.get("peak_not_predicted", "not predicted"), "", "", "", ""])
                continue
            p = predicted_for_measurement(r)
            errors = [f"{p[f'peak_during_{ph}'] / r[f'peak_during_{ph}'] - 1:+.2%}" for ph in PHASES]
            check = next(c for c in summary["checks"] if c["name"] == f"peak as predicted ({name}, rank {r['rank']})")
            rows.append([point, name, r["rank"], f"{p['peak_bytes'] / MiB:.1f} / {r['peak_bytes'] / MiB:.1f}",
                         f"{p['peak_bytes'] / r['peak_bytes'] - 1:+.2%}", *errors, "PASS" if check["passed"] else "FAIL"])
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--presets", default="case-study,gpt-100m,gpt-1b")
    parser.add_argument("--micro-batches", default="4,8,16")
    parser.add_argument("--checkpointing", default="off,on")
    parser.add_argument("--strategies", default="ddp,zero0,zero1,zero2,zero3,fsdp2-grad,fsdp2")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--memory-limit-gib", type=float, default=None)
    args = parser.parse_args()
    from zerolens.run.jobs import run_in_new_folder
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python3", "scripts/peak_matrix.py", *sys.argv[1:]])
    for preset in args.presets.split(","):
        for micro_batch in map(int, args.micro_batches.split(",")):
            for ckpt in [c == "on" for c in args.checkpointing.split(",")]:
                if ckpt and PRESETS[preset].kind != "gpt":
                    continue  # activation checkpointing is the GPT presets'
                label = f"{preset}-mb{micro_batch}" + ("-ckpt" if ckpt else "")
                folder = out / label
                if (folder / "summary.json").exists() or (folder / "capped.json").exists():
                    print(f"{label}: done already", flush=True)
                    continue
                config = point_config(args, preset, micro_batch, ckpt, folder)
                print(f"{label} ...", flush=True)
                if args.memory_limit_gib:
                    run_capped(config, label, out, command)
                    continue
                summary = run_in_new_folder(config, command=f"{command} (point: {label})", quiet=True)
                print(f"{label}: {'failed' if summary is None else summary['verdict']}", flush=True)
    write_table(out, command)
    return 0


def run_capped(config: RunConfig, label: str, out: Path, command: str) -> None:
    """A point under --memory-limit-gib: each strategy predicted, then run alone with that cap. A
    strategy predicted above the cap must run out of memory; one predicted with at least
    plan.TIGHT_HEADROOM of the cap to spare must fit (and its peak be as predicted); one in between
    is tight (fragmentation, not predicted, decides), and its outcome is recorded, not checked."""
    import torch

    from zerolens.commands.plan import TIGHT_HEADROOM
    from zerolens.predict.peak import predicted_peaks
    from zerolens.run.jobs import run_in_new_folder
    limit = allocator_limit(config)
    predicted = predicted_peaks(config, torch.cuda.get_device_capability())
    results = {}
    for name in config.strategies:
        peak = max(r["peak_bytes"] for r in predicted[name]["ranks"])
        expected = ("out of memory" if peak > limit else "tight" if limit - peak < TIGHT_HEADROOM * limit
                    else "fits")
        folder = out / f"{label}-{name}"
        one = dataclasses.replace(config, strategies=(name,), baseline=name, out=str(folder))
        summary = run_in_new_folder(one, command=f"{command} (point: {label}, {name})", quiet=True)
        failure = "" if summary is not None else json.loads((folder / "summary.json").read_text()).get("failure", "")
        outcome = "fitted" if summary is not None else (
            "ran out of memory" if "ran out of GPU memory" in failure else f"failed: {failure}")
        peak_checks = [] if summary is None else [c["passed"] for c in summary["checks"]
                                                  if c["name"].startswith("peak as predicted")]
        passed = {"out of memory": outcome == "ran out of memory",
                  "fits": outcome == "fitted" and bool(peak_checks) and all(peak_checks), "tight": None}[expected]
        results[name] = {"predicted_peak_bytes": peak, "limit_bytes": limit, "expected": expected,
                         "outcome": outcome, "passed": passed}
        print(f"  {name}: predicted {peak / GiB:.2f} GiB of {limit / GiB:.2f}: {expected}; {outcome}", flush=True)
    (out / label).mkdir(parents=True, exist_ok=True)
    (out / label / "capped.json").write_text(json.dumps(results, indent=2) + "\n")


def peaks_of(summary: dict) -> dict:
    """What the matrix keeps of a point's summary.json: each rank's measured and predicted peaks in
    bytes (the measured reserved peak beside them) and its "peak as predicted" check."""
    passed = {c["name"]: c["passed"] for c in summary["checks"] if c["name"].startswith("peak as predicted")}
    strategies = {}
    for name, s in summary["strategies"].items():
        strategies[name] = []
        for r in s["ranks"]:
            entry = {"rank": r["rank"], "measured": {ph: r.get(f"peak_during_{ph}") for ph in PHASES}
                     | {"peak": r.get("peak_bytes"), "reserved_peak": r.get("reserved_peak_bytes")}}
            if r.get("predicted_peaks"):
                p = predicted_for_measurement(r)
                entry["predicted"] = {ph: p[f"peak_during_{ph}"] for ph in PHASES} | {"peak": p["peak_bytes"]}
                entry["passed"] = passed.get(f"peak as predicted ({name}, rank {r['rank']})")
            strategies[name].append(entry)
    return {"verdict": summary["verdict"], "precision": summary.get("precision"), "versions": summary.get("versions"),
            "strategies": strategies}


def write_table(out: Path, command: str) -> None:
    """matrix.md from every point's folder, and beside it peaks.json: every point's peaks in bytes
    (peaks_of: a few KiB where a summary.json is a hundred) and the capped points' outcomes."""
    rows, ooms, peaks, capped = [], [], {}, {}
    for folder in sorted(p for p in out.iterdir() if p.is_dir()):
        if (folder / "summary.json").exists():
            summary = json.loads((folder / "summary.json").read_text())
            if "strategies" in summary:
                rows += rows_of(folder.name, summary)
                peaks[folder.name] = peaks_of(summary)
        if (folder / "capped.json").exists():
            capped[folder.name] = json.loads((folder / "capped.json").read_text())
            for name, r in capped[folder.name].items():
                ooms.append([folder.name, name, f"{r['predicted_peak_bytes'] / GiB:.2f}", f"{r['limit_bytes'] / GiB:.2f}",
                             r["expected"], r["outcome"], {True: "PASS", False: "FAIL", None: "not checked"}[r["passed"]]])
    passed = sum(r[-1] == "PASS" for r in rows + ooms)
    checked = sum(r[-1] in ("PASS", "FAIL") for r in rows + ooms)
    text = (f"# Peaks predicted before training against the allocator's (2 ranks, CUDA)\n\n"
            f"`{command}`\n\n{passed} of {checked} checks passed.\n\n"
            + markdown_table(["point", "strategy", "rank", "peak MiB (predicted / measured)", "peak error",
                              "forward", "backward", "step", "check"], rows) + "\n")
    if ooms:
        text += ("\n## Under a memory cap\n\nEach strategy alone: predicted above the cap, it must run out of "
                 "memory; with 5% of the cap to spare, it must fit; in between it is tight (fragmentation, which "
                 "is not predicted, decides) and not checked.\n\n" + markdown_table(
                     ["point", "strategy", "predicted GiB", "allocator limit GiB", "expected", "outcome", "check"],
                     ooms) + "\n")
    (out / "matrix.md").write_text(text)
    (out / "peaks.json").write_text(json.dumps({"command": command, "points": peaks, "capped": capped},
                                               separators=(",", ":")) + "\n")
    print(text)


if __name__ == "__main__":
    sys.exit(main())
