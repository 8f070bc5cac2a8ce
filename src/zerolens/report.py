"""Presentation: the per-rank tables, report.md and summary.json. Pure functions plus atomic writes."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

MiB = 1024 ** 2  # output is in MiB, 1024-based; bytes everywhere else


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:.3f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.3f}"


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def memory_table(summary: dict) -> str:
    baseline = summary["strategies"][summary["baseline"]]["ranks"]
    rows = []
    for name, s in summary["strategies"].items():
        for r in s["ranks"]:
            base = baseline[r["rank"]]
            rows.append([
                name, r["rank"],
                mib(r["grad_bytes_after_backward"]), ratio(r["grad_bytes_after_backward"],
                                                           base["grad_bytes_after_backward"]),
                r["grad_partition_elements"], ratio(r["grad_partition_elements"], base["grad_partition_elements"]),
                mib(r["grad_bytes_after_step"]), mib(r["param_bytes"]), mib(r["optimizer_state_bytes"]),
                mib(r["allocated_after_backward"]), mib(r["peak_during_backward"]), mib(r["peak_during_step"]),
            ])
    header = ["strategy", "rank", "grads held after backward (MiB)", "vs baseline", "grad partition (elements)",
              "vs baseline", "grads after step (MiB)", "params (MiB)", "optimizer states (MiB)",
              "allocated after backward (MiB)", "peak in backward (MiB)", "peak in step (MiB)"]
    return markdown_table(header, rows)


def loss_table(summary: dict) -> str:
    base = summary["strategies"][summary["baseline"]]["losses"]
    rows = []
    for name, s in summary["strategies"].items():
        losses = s["losses"]
        w = max(2, len(losses) // 5)
        diff = max(abs(a - b) for a, b in zip(losses, base))
        rows.append([name, f"{losses[0]:.4f}", f"{losses[-1]:.4f}", f"{sum(losses[:w]) / w:.4f}",
                     f"{sum(losses[-w:]) / w:.4f}", f"{diff:.2e}", s["skipped_steps"], f"{s['seconds']:.1f}"])
    return markdown_table(["strategy", "first loss", "last loss", "mean first steps", "mean last steps",
                           "max abs diff vs baseline", "skipped steps", "train time (s)"], rows)


def checks_text(summary: dict) -> str:
    lines = []
    for c in summary["checks"]:
        lines.append(f"- {'PASS' if c['passed'] else 'FAIL'} {c['name']}: {c['detail']} "
                     f"(tolerance: {c['tolerance']})")
    return "\n".join(lines)


def render(summary: dict, command: str) -> str:
    """The same text for the terminal and report.md."""
    ws, dev = summary["world_size"], summary["device"]
    notes = "".join(f"\n> {n}\n" for n in summary["notes"])
    return f"""# zerolens verify: {summary['verdict']}

{ws} ranks on {dev}, {summary['precision']}, {summary['param_count']:,} parameters, {summary['steps']} steps, \
baseline {summary['baseline']}. Command: `{command}`
{notes}
## Memory per rank
Gradients are counted from the tensors each rank holds (each storage once, MiB = 1024^2 bytes); \
"grad partition" is the number of gradient elements the rank owns. Allocator columns are CUDA only.

{memory_table(summary)}

## Loss (global batch, mean over ranks)

{loss_table(summary)}

## Checks

{checks_text(summary)}

**Verdict: {summary['verdict']}**
"""


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary file in the same folder, then rename: never a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_json(path: Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=2) + "\n")


def write_jsonl(path: Path, records: list[dict]) -> None:
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in records))
