"""The peak prediction's acceptance matrix (issue 14): one `zerolens verify` per (model, micro-batch,
activation checkpointing), every strategy in each, and one table of predicted against measured peaks
per strategy, rank and phase, with each rank's "peak as predicted" check.

python3 scripts/peak_matrix.py --out DIR [--presets case-study,gpt-100m,gpt-1b] [--micro-batches 4,8,16]
    [--checkpointing off,on] [--strategies ddp,zero0,...] [--steps 4] [--memory-limit-gib G]

Resumable: a point whose folder holds a summary.json is not run again, so the matrix can be spread
over several sessions (run it again with the same --out). A point is first predicted; where its
predicted peak exceeds what the allocator may hold (--memory-limit-gib, else the GPU's memory), the
run is expected to run out of memory and that is what is checked. matrix.json and matrix.md in DIR
are written from every point's folder at the end.
"""
import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path

from zerolens.checks import predicted_for_measurement
from zerolens.config import RunConfig, check_config
from zerolens.model import PRESETS
from zerolens.tables import GiB, MiB, markdown_table

PHASES = ("forward", "backward", "step")


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
    from zerolens.jobs import run_in_new_folder
    from zerolens.predict_peak import predicted_peaks
    import torch
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python3", "scripts/peak_matrix.py", *sys.argv[1:]])
    capability = torch.cuda.get_device_capability()
    for preset in args.presets.split(","):
        for micro_batch in map(int, args.micro_batches.split(",")):
            for ckpt in [c == "on" for c in args.checkpointing.split(",")]:
                if ckpt and PRESETS[preset].kind != "gpt":
                    continue  # activation checkpointing is the GPT presets'
                label = f"{preset}-mb{micro_batch}" + ("-ckpt" if ckpt else "")
                folder = out / label
                if (folder / "summary.json").exists() or (folder / "expected_oom.json").exists():
                    print(f"{label}: done already", flush=True)
                    continue
                config = point_config(args, preset, micro_batch, ckpt, folder)
                # Without a cap every point of the default matrix fits an H200; with one, the points
                # predicted not to fit are what is checked first.
                predicted = predicted_peaks(config, capability) if args.memory_limit_gib else {}
                largest = max((r["peak_bytes"] for p in predicted.values() for r in p.get("ranks", [])), default=0)
                limit = allocator_limit(config)
                print(f"{label} ...", flush=True)
                if largest > limit:
                    # Predicted not to fit: each strategy that does not fit is run alone and must run out of memory.
                    results = {}
                    for name, p in predicted.items():
                        peak = max(r["peak_bytes"] for r in p.get("ranks", [{"peak_bytes": 0}]))
                        if peak <= limit:
                            continue
                        one = dataclasses.replace(config, strategies=(name,), baseline=name,
                                                  out=str(out / f"{label}-{name}-oom"))
                        summary = run_in_new_folder(one, command=f"{command} (point: {label}, {name})", quiet=True)
                        results[name] = {"predicted_peak_bytes": peak, "limit_bytes": limit,
                                         "ran_out_of_memory": summary is None}
                        print(f"  {name}: {'ran out of memory, as predicted' if summary is None else 'FITTED'}",
                              flush=True)
                    folder.mkdir(parents=True, exist_ok=True)
                    (folder / "expected_oom.json").write_text(json.dumps(results, indent=2) + "\n")
                    config = dataclasses.replace(config, strategies=tuple(n for n in config.strategies if n not in results),
                                                 baseline=next(n for n in config.strategies if n not in results))
                    config = dataclasses.replace(config, out=str(out / f"{label}-fitting"))
                summary = run_in_new_folder(config, command=f"{command} (point: {label})", quiet=True)
                print(f"{label}: {'failed' if summary is None else summary['verdict']}", flush=True)
    write_table(out, command)
    return 0


def peaks_of(summary: dict) -> dict:
    """What the matrix keeps of a point's summary.json: each rank's measured and predicted peaks."""
    keys = ("rank", "peak_during_forward", "peak_during_backward", "peak_during_step", "peak_bytes",
            "reserved_peak_bytes", "predicted_peaks")
    return {"verdict": summary["verdict"], "precision": summary["precision"], "versions": summary["versions"],
            "checks": [c for c in summary["checks"] if c["name"].startswith("peak as predicted")],
            "strategies": {name: {"peak_not_predicted": s.get("peak_not_predicted"),
                                  "ranks": [{k: r.get(k) for k in keys} for r in s["ranks"]]}
                           for name, s in summary["strategies"].items()}}


def write_table(out: Path, command: str) -> None:
    """matrix.md and matrix.json from every point's folder, and beside them each point's peaks
    (POINT.peaks.json, a few KiB where its summary.json is a hundred)."""
    rows, ooms = [], []
    for folder in sorted(p for p in out.iterdir() if p.is_dir()):
        if (folder / "summary.json").exists():
            summary = json.loads((folder / "summary.json").read_text())
            if "strategies" in summary:
                rows += rows_of(folder.name, summary)
                (out / f"{folder.name}.peaks.json").write_text(json.dumps(peaks_of(summary), separators=(",", ":")) + "\n")
        if (folder / "expected_oom.json").exists():
            for name, r in json.loads((folder / "expected_oom.json").read_text()).items():
                ooms.append([folder.name, name, f"{r['predicted_peak_bytes'] / GiB:.2f}", f"{r['limit_bytes'] / GiB:.2f}",
                             "PASS" if r["ran_out_of_memory"] else "FAIL"])
    passed = sum(r[-1] == "PASS" for r in rows + ooms)
    text = (f"# Peaks predicted before training against the allocator's (2 ranks, CUDA)\n\n"
            f"`{command}`\n\n{passed} of {len(rows) + len(ooms)} checks passed.\n\n"
            + markdown_table(["point", "strategy", "rank", "peak MiB (predicted / measured)", "peak error",
                              "forward", "backward", "step", "check"], rows) + "\n")
    if ooms:
        text += "\n## Predicted not to fit\n\n" + markdown_table(
            ["point", "strategy", "predicted GiB", "allocator limit GiB", "ran out of memory"], ooms) + "\n"
    (out / "matrix.md").write_text(text)
    (out / "matrix.json").write_text(json.dumps({"command": command, "rows": rows, "expected_oom": ooms}, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    sys.exit(main())
