"""Where a run's wall time goes, the time to its verdict: each part noted, as the process that spends it
ends it, in the run folder (logs/wall_time.jsonl, one line per part), and summed for summary.json
(`breakdown`). The parts, in the order a verify spends them:

- imports: the zerolens command's, from its first import of zerolens to its main (the interpreter's own
  start before that is not counted);
- checks: the flags resolved into a config and checked (DeepSpeed's config model, the user's model on
  the meta device), and the run folder made;
- prediction: the peaks predicted before training (on the CPU by the command, on GPUs by a fresh
  process rank 0 starts);
- launch: from the command asking for the workers to rank 0 running (every launch: strategies that
  leave memory behind are given fresh processes);
- process_group: the process group, CUDA's set-up on GPUs and DeepSpeed's;
- training: each strategy's setup, steps, measurement and teardown (`strategies_s` per strategy);
- report: summary.json's figures and checks, and report.md; plots: the plots.

What remains (the interpreter's start, the processes' exit) is not counted.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

PARTS = ("imports", "checks", "prediction", "launch", "process_group", "training", "report", "plots")
LAUNCH_REQUESTED = "launch_requested"

_command_started: float | None = None  # when the zerolens command's main began (mark_command_started)
_imported_at: float | None = None  # when the command first imported zerolens


def path(out: Path) -> Path:
    return out / "logs" / "wall_time.jsonl"


def mark_command_started(imported_at: float) -> None:
    """The zerolens command's main begins; it first imported zerolens at `imported_at` (zerolens.IMPORTED_AT)."""
    global _command_started, _imported_at
    _command_started, _imported_at = time.time(), imported_at


def note(out: Path, part: str, seconds: float, **details) -> None:
    """One part's seconds, appended to the run folder's wall-time log."""
    path(out).parent.mkdir(parents=True, exist_ok=True)
    with path(out).open("a") as f:
        f.write(json.dumps({"part": part, "seconds": seconds, **details}) + "\n")


def note_command_parts(out: Path) -> None:
    """The command's imports and checks, up to now (its run folder is made): once per command, so a
    command that runs several jobs (sweep, maxsize) notes them in its first run folder alone."""
    global _command_started
    if _command_started is None:
        return
    note(out, "imports", _command_started - _imported_at)
    note(out, "checks", time.time() - _command_started)
    _command_started = None


def note_launch_requested(out: Path) -> None:
    note(out, LAUNCH_REQUESTED, 0.0, at=time.time())


def note_launched(out: Path) -> None:
    """Rank 0 running: the time since the command asked for this launch."""
    lines = read(out)
    asked = [line["at"] for line in lines if line["part"] == LAUNCH_REQUESTED]
    if asked:
        note(out, "launch", time.time() - asked[-1])


def read(out: Path) -> list[dict]:
    return [json.loads(line) for line in path(out).read_text().splitlines()] if path(out).exists() else []


def breakdown(out: Path) -> dict:
    """Seconds per part (`parts_s`, every part, 0 where none was noted), training per strategy
    (`strategies_s`), and their sum (`counted_s`)."""
    parts = dict.fromkeys(PARTS, 0.0)
    strategies: dict[str, float] = {}
    for line in read(out):
        if line["part"] in parts:
            parts[line["part"]] += line["seconds"]
        if line["part"] == "training":
            strategies[line["strategy"]] = strategies.get(line["strategy"], 0.0) + line["seconds"]
    return {"parts_s": parts, "strategies_s": strategies, "counted_s": sum(parts.values())}


def breakdown_line(wall_time: dict) -> str:
    """One line for the terminal: "Wall time 14.8 s: imports 2.1, checks 0.4, ... (ddp 2.0, zero2 4.1) ..."."""
    parts = []
    for part, seconds in wall_time["parts_s"].items():
        text = f"{part.replace('_', ' ')} {seconds:.1f}"
        if part == "training" and len(wall_time["strategies_s"]) > 1:
            text += " (" + ", ".join(f"{name} {s:.1f}" for name, s in wall_time["strategies_s"].items()) + ")"
        parts.append(text)
    return f"Wall time, {wall_time['counted_s']:.1f} s counted: " + ", ".join(parts) + " (seconds)."
