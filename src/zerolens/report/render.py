"""verify's presentation (the per-rank tables, report.md, the terminal summary) and zerolens.track's
(tracked_report, tracked_terminal_lines). Pure functions."""
from __future__ import annotations

from pathlib import Path
from statistics import median

from zerolens.report.checks import BY_ALLOCATING_CODE, census_after_step, predicted_for_measurement, unexplained_bytes
from zerolens.report.tables import in_unit, markdown_table, mib, ratio, unit_for


def with_prediction(rank: dict, key: str) -> str:
    """The measured MiB, and the prediction beside it only where the two differ."""
    measured, predicted = rank[key], rank.get("predicted", {}).get(key)
    if predicted is None or predicted == measured:
        return mib(measured)
    error = (measured - predicted) / predicted if predicted else float("inf")
    return f"{mib(measured)} (predicted {mib(predicted)}, {error:+.1%})"


def memory_table(summary: dict) -> str:
    baseline = summary["strategies"][summary["baseline"]]["ranks"]
    rows = []
    for name, s in summary["strategies"].items():
        for r in s["ranks"]:
            base = baseline[r["rank"]]
            rows.append([
                name, r["rank"], with_prediction(r, "param_bytes"),
                with_prediction(r, "grad_bytes_after_backward"),
                ratio(r["grad_bytes_after_backward"], base["grad_bytes_after_backward"]),
                r["grad_partition_elements"], ratio(r["grad_partition_elements"], base["grad_partition_elements"]),
                with_prediction(r, "grad_bytes_after_step"), with_prediction(r, "optimizer_state_bytes"),
                with_prediction(r, "comm_buffer_bytes_after_backward"), mib(r["activation_bytes_after_forward"]),
                mib(r["peak_bytes"]),
            ])
    header = ["strategy", "rank", "params", "grads after backward", "vs baseline", "grad partition (elements)",
              "vs baseline", "grads after step", "optimizer states", "comm buffers after backward",
              "activations saved in forward", "peak"]
    return markdown_table(header, rows)


def allocator_table(summary: dict) -> str | None:
    """CUDA only: the allocator against the census, retained (after the step) and peak."""
    rows = []
    for name, s in summary["strategies"].items():
        for r in s["ranks"]:
            if r["allocated_after_step"] is None:
                return None
            rows.append([name, r["rank"], mib(r["allocated_after_step"]), mib(r["leftover_bytes_at_end"]),
                         mib(census_after_step(r)), mib(r.get("census_block_rounding_after_step")),
                         mib(r["cublas_workspace_bytes"]), mib(unexplained_bytes(r)),
                         mib(r["allocated_after_backward"]), mib(r["peak_during_forward"]),
                         mib(r["peak_during_backward"]), mib(r["peak_during_step"]), mib(r["reserved_peak_bytes"]),
                         r["alloc_retries"], r["ooms"]])
    return markdown_table(["strategy", "rank", "allocated after step", "left by earlier strategies (still allocated)",
                           "census after step", "allocator rounding of census blocks", "cuBLAS workspaces", "unexplained", "allocated after backward", "peak in forward",
                           "peak in backward", "peak in step", "reserved peak", "alloc retries", "OOMs"], rows)


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
    lines += [f"- NOT CHECKED {c['name']}: {c['why']}" for c in summary.get("not_checked", [])]
    return "\n".join(lines)


def allocator_section(summary: dict) -> str:
    table = allocator_table(summary)
    if table is None:
        return ""
    return f"""
### The CUDA allocator beside the census (MiB)
"unexplained" is what the allocator holds after the step that neither the census, the cuBLAS \
workspaces nor earlier strategies' leftovers account for.

{table}
"""


PEAK_COLUMNS = {"param": "params", "grad": "grads", "optimizer_state": "optimizer states",
                "comm_buffer": "comm buffers", "activation": "activations saved",
                "backend_transient": "backend transient",
                "optimizer_transient": "optimizer transient",
                "autograd_transient": "autograd transient", "forward_transient": "forward transient",
                "workspace_and_earlier": "cuBLAS workspace + earlier", "unattributed": "unattributed",
                "allocator_slack": "allocator rounding"}


def reserved_table(summary: dict) -> str:
    """Each rank's reserved peak over the run, predicted for the run's allocator setting beside
    measured, the smallest cap predicted, and the memory measured outside the allocator."""
    from zerolens.predict.allocator import allocator_setting
    setting, unmodelled = allocator_setting(summary.get("alloc_conf") or "")
    rows = []
    for name, s in summary["strategies"].items():
        for r in s["ranks"]:
            predicted = (r.get("predicted_peaks") or {}).get("reserved_peak_bytes", {}).get(setting)
            measured = r.get("reserved_peak_bytes")
            if predicted is None:
                continue
            cap = r["predicted_peaks"]["min_allocator_cap_bytes"][setting]
            rows.append([name, r["rank"], mib(predicted), mib(measured),
                         "-" if not measured else f"{predicted / measured - 1:+.2%}", mib(cap),
                         mib(r.get("outside_allocator_after_step"))])
    if not rows:
        return ""
    return (f"\n\nThe allocator as this run set it: {setting.replace('_', ' ')}{unmodelled}. Outside the allocator: "
            "what the process held on the GPU beside the allocator's reserve after the last step (the device's used "
            "memory less the reserve, other processes on the GPU included).\n\n"
            + markdown_table(["strategy", "rank", "predicted reserved peak", "measured reserved peak", "error",
                              "predicted smallest cap", "outside the allocator"], rows))


def peak_prediction_section(summary: dict) -> str:
    """Each phase's peak, predicted before training (predict/peak.py) beside measured: on CUDA the
    highest over the steps, on the CPU the last step's (what each measures)."""
    from zerolens.predict.allocator import allocator_setting
    cuda = summary["device"] == "cuda"
    setting = allocator_setting(summary.get("alloc_conf") or "")[0]

    def error(predicted, measured) -> str:
        return "-" if not measured or predicted is None else f"{predicted / measured - 1:+.2%}"
    rows, why_not = [], []
    for name, s in summary["strategies"].items():
        if "peak_not_predicted" in s:
            why_not.append(f"- {name}: {s['peak_not_predicted']}")
            continue
        for r in s["ranks"]:
            p = predicted_for_measurement(r)
            counted = p.get("allocated_phase_peaks", {}).get(setting, {})
            for phase in ("forward", "backward", "step"):
                measured, reserved = r.get(f"peak_during_{phase}"), r.get(f"reserved_peak_during_{phase}")
                rows.append([name, r["rank"], phase, mib(p[f"peak_during_{phase}"]), mib(measured),
                             error(p[f"peak_during_{phase}"], measured),
                             *([mib(counted.get(phase)), error(counted.get(phase), measured), mib(reserved),
                                "-" if reserved is None or measured is None else mib(reserved - measured)]
                               if cuda else [])])
    if not rows and not why_not:
        return ""
    table = markdown_table(["strategy", "rank", "phase", "predicted peak", "measured peak", "error",
                            *(["predicted as the allocator counts it", "error", "reserved peak",
                               "reserved - allocated"] if cuda else [])], rows)
    fragmentation = (" Predicted as the allocator counts it: the trace's requests replayed through the model of "
                     "the caching allocator, which hands out a block whole where too little would be left to split "
                     "off, and counts it whole (what the check \"peak as predicted\" compares)."
                     " The last two columns: what the allocator had reserved from the driver at each phase's "
                     "highest, and how much of it was not allocated (its cached blocks and their unused parts). "
                     "The reserved peak of the run, predicted by replaying the trace's allocations through a model "
                     "of the caching allocator (predict/allocator.py), follows." + reserved_table(summary)
                     if cuda else "")
    cuda = ("; on CUDA the cuBLAS workspaces are added, and each phase's peak is its highest over the steps "
            "traced" if cuda else "")
    return f"""
### Peaks, predicted before training and measured (MiB)
Predicted by running each strategy's step model (what its backend allocates on one rank) on fake \
tensors under torch's MemTracker{cuda}. Measured: {"the CUDA allocator's peak of each phase over every step" if summary["device"] == "cuda" else "torch's MemTracker on the real step"}.{fragmentation}

{table}
{chr(10).join(why_not)}
"""


def peak_section(summary: dict) -> str:
    """CUDA only: what was allocated at each phase's peak on the last step, rank 0 of each strategy."""
    rows, sources = [], []
    for name, s in summary["strategies"].items():
        r = s["ranks"][0]
        for phase, anatomy in (r.get("peak_anatomy") or {}).items():
            parts = anatomy["components"]
            by_code = sum(parts[k] for k in BY_ALLOCATING_CODE)
            rows.append([name, phase, mib(anatomy["allocator_peak"]), *(mib(parts[k]) for k in PEAK_COLUMNS),
                         ratio(by_code, anatomy["allocator_peak"])])
            sources += [f"- {name}, {phase}: " + "; ".join(f"{src} {mib(b)}" for src, b in
                                                           anatomy["largest_transients"].items())]
    if not rows:
        return ""
    table = markdown_table(["strategy", "phase", "peak", *PEAK_COLUMNS.values(), "share named only by code"], rows)
    return f"""
### At each peak, by component (last step, rank 0, MiB)
Replayed from the allocator's recorded events (requested sizes); every block alive at the peak \
is named by an address map taken while it was alive (census, saved-tensor hooks) or, for \
temporaries, by the code that allocated it. "cuBLAS workspace + earlier" is memory allocated \
before the phase that no census holds, up to the measured workspaces and earlier strategies' \
leftovers; beyond that it is unattributed. "allocator rounding": the allocator's peak less the \
replayed one (block sizes are rounded up from requests). The transients are named only by the code \
that allocated them (any frame in the backend's files: DeepSpeed's, FSDP's; the optimizer's; \
a backward allocation with no \
Python frame): "share named only by code" is their part of the peak; the rest is named by tensor \
or measured.

{table}

Largest temporaries at each peak (allocating code):
{chr(10).join(sources)}
"""


def render(summary: dict, command: str) -> str:
    """The same text for the terminal and report.md."""
    ws, dev = summary["world_size"], summary["device"]
    notes = "".join(f"\n> {n}\n" for n in summary["notes"])
    accumulated = (f" of {summary['grad_accum']} micro-batches each (gradient accumulation: each phase's peak is the "
                   "highest over the step's micro-batches)" if summary.get("grad_accum", 1) > 1 else "")
    return f"""# zerolens verify: {summary['verdict']}

{ws} rank{'s' * (ws != 1)} on {dev}, {summary['precision']}, {summary['param_count']:,} parameters, {summary['steps']} steps{accumulated}, \
baseline {summary['baseline']}. Command: `{command}`
{notes}
## Memory per rank (MiB = 1024^2 bytes)
Counted from the tensors each rank holds, each storage once; a prediction from the parameter sizes \
is shown only where it differs from the measurement. "grad partition" is the number of gradient \
elements the rank owns. "peak": the CUDA allocator's, over all steps; on CPU, the highest of the per-phase peaks \
of a tensor-allocation tracker (torch's MemTracker) on the last step.

{memory_table(summary)}
{allocator_section(summary)}{peak_section(summary)}{peak_prediction_section(summary)}
## Loss (global batch, mean over ranks)

{loss_table(summary)}

## Checks

{checks_text(summary)}

**Verdict: {summary['verdict']}**
"""


# --- The terminal: what a user needs, at most about 25 lines of 100 columns ------------------------------

def terminal_lines(summary: dict, out: Path) -> list:
    """verify's summary for the terminal (rich renderables): one table of strategy x rank (identical
    ranks folded) with what each keeps and its peak against the baseline's, the notes that matter,
    the count of checks with every failing one in full, the verdict, and where the files are.
    Everything else is in report.md (`--verbose` prints it)."""
    from zerolens.report.tables import failed_line, terminal_table, verdict_line
    base = summary["strategies"][summary["baseline"]]["ranks"]
    keys = ("param_bytes", "grad_bytes_after_backward", "optimizer_state_bytes", "peak_bytes")
    unit, label = unit_for([r[k] for s in summary["strategies"].values() for r in s["ranks"] for k in keys])
    rows = []
    for name, s in summary["strategies"].items():
        shown = [tuple(cell for k in keys for cell in (in_unit(r[k], unit), ratio(r[k], base[r["rank"]][k])))
                 for r in s["ranks"]]
        for first, last, values in folded(shown):
            rows.append([name, str(first) if first == last else f"{first}-{last}", *values])
    table = terminal_table(["strategy", "ranks", "params", "vs base", "grads", "vs base", "optimizer", "vs base",
                            "peak", "vs base"], rows, right=set(range(2, 10)))
    checks = summary["checks"]
    failed = [c for c in checks if not c["passed"]]
    lines = ["", f"Memory per rank in {label}, {summary['precision']} (grads: right after backward; vs base: "
             f"against {summary['baseline']})", table]
    lines += [f"- {note}" for note in summary.get("headline_notes", [])]
    lines.append(f"{len(checks) - len(failed)} of {len(checks)} checks passed"
                 + (f"; {len(summary['notes'])} note{'s' if len(summary['notes']) > 1 else ''} in report.md"
                    if summary["notes"] else "") + ".")
    lines += [failed_line(f"{c['name']}: {c['detail']} (tolerance: {c['tolerance']})") for c in failed]
    lines += [f"Not checked: {c['name']}: {c['why']}." for c in summary.get("not_checked", [])]
    lines.append(verdict_line(summary["verdict"]))
    lines.append(f"Report: {out / 'report.md'}; summary.json and plots beside it.")
    return lines


def folded(rows: list[tuple]) -> list[tuple[int, int, tuple]]:
    """Consecutive identical rows as (first index, last index, row)."""
    out = []
    for i, row in enumerate(rows):
        if out and out[-1][2] == row:
            out[-1] = (out[-1][0], i, row)
        else:
            out.append((i, i, row))
    return out


# --- zerolens.track's report (tracking/track.py) -----------------------------------------------------------

TRACKED_KEYS = ("param_bytes", "grad_bytes_after_backward", "optimizer_state_bytes",
                "comm_buffer_bytes_after_backward", "peak_bytes", "reserved_peak_bytes")


def largest_rank(ranks: list[dict]) -> dict:
    """The rank holding the most: by its allocator peak where there is one (CUDA), else by its census."""
    return max(ranks, key=lambda r: (r["peak_bytes"] or 0, census_after_step(r) + r["grad_bytes_after_backward"]))


def why_no_step(summary: dict, stopped: bool) -> str:
    """Why a tracked run has no sampled step. `stopped`: zerolens's own error ended the measuring."""
    if stopped:
        return "zerolens stopped measuring (above) before the first sampled step ended."
    if summary["steps_seen"]:
        return (f"{summary['steps_seen']} optimizer steps were seen, but no training forward (in training mode, "
                "gradients on) of the module track was given. track takes a step's start from that module's "
                "forward: a loop that calls one of its submodules, or a method of its own other than forward, "
                "gives it none. Give track the module whose forward the loop calls.")
    return "the optimizer given to track took no step: is it the one the loop steps?"


def tracked_report(summary: dict) -> str:
    """report.md of a tracked run: every rank's figures over its sampled steps, the prediction beside
    the census where there is one, the checks."""
    name = summary["strategy"]
    ranks = summary["strategies"][name]["ranks"]
    rows = [[r["rank"], len(r["sampled_steps"]), with_prediction(r, "param_bytes"),
             with_prediction(r, "grad_bytes_after_backward"), with_prediction(r, "grad_bytes_after_step"),
             with_prediction(r, "optimizer_state_bytes"), with_prediction(r, "comm_buffer_bytes_after_backward"),
             mib(r["activation_bytes_after_forward"]), mib(r["peak_during_forward"]), mib(r["peak_during_backward"]),
             mib(r["peak_during_step"]), mib(r["reserved_peak_bytes"]),
             f"{median(r['seconds_of_sampled_steps']):.4f}"] for r in ranks]
    table = markdown_table(["rank", "sampled steps", "params", "grads after backward", "grads after step",
                            "optimizer states", "comm buffers after backward", "activations saved in forward",
                            "peak in forward", "peak in backward", "peak in step", "reserved peak",
                            "sampled step (s, median)"], rows)
    notes = "".join(f"\n> {n}\n" for n in summary["notes"])
    errors = "".join(f"\n- {rank}: {text}" for rank, text in summary["errors"].items())
    unfinished = {"UNFINISHED": "\nThe loop is still running, or ended without leaving track: figures so far.\n",
                  "CRASHED": f"\nThe loop ended with an error:{errors}\n"}.get(summary["verdict"], "")
    stopped = [f"{rank}: {text}" for rank, text in summary["errors"].items()
               if summary["verdict"] != "CRASHED" and "track stopped measuring at step" in text]
    missing = summary["ranks_without_a_sampled_step"]
    if stopped:  # zerolens's own error in a hook; the training went on
        notes += "".join(f"\n> {line}; the training went on.\n" for line in stopped)
    if not ranks:  # what the terminal's "no step was measured" refers to
        notes += f"\n> No step was measured: {why_no_step(summary, bool(stopped))}\n"
    every = summary["every"]
    sampled = "every step" if every == 1 else f"the first step, then one in every {every}"
    peaks = "" if summary["device"] == "cpu" else (
        "Peaks: the CUDA allocator's, the highest over the sampled steps (a phase runs from the model's forward to "
        "backward, from backward's call to its return, and over the optimizer's step). ")
    return f"""# zerolens.track: {summary['verdict']}
{unfinished}
{name} on {summary['world_size']} rank{'s' if summary['world_size'] > 1 else ''} ({summary['device']}, \
weights {summary['precision']}{f", computed in {summary['computed_in']}" if summary.get('computed_in') else ""}), \
{summary['steps_seen']} optimizer steps seen; measured: {sampled}.\
{f" Ranks without a sampled step yet: {', '.join(map(str, missing))}." if missing else ""}
{notes}
## Memory per rank (MiB = 1024^2 bytes)
Counted from the tensors each rank holds, each storage once: after the last backward of a sampled step \
(just before the optimizer step) and after the step (at the next forward); the latest sampled step's. \
{peaks}A prediction from the parameter sizes is shown only where it differs. "sampled step": from its first forward to the next \
forward (the loop's own work between included), with track measuring it.

{table}

## Checks

{checks_text(summary)}
"""


def tracked_terminal_lines(summary: dict, out: Path) -> list:
    """What track prints on rank 0 at exit: one table over the ranks (identical ones folded), the
    largest rank named, the checks, where the report is."""
    from zerolens.report.tables import failed_line, terminal_table
    ranks = summary["strategies"][summary["strategy"]]["ranks"]
    if not ranks:
        return [f"zerolens.track: no step was measured; {out / 'report.md'} says why."]
    keys = [k for k in TRACKED_KEYS if any(r[k] is not None for r in ranks)]
    unit, label = unit_for([r[k] for r in ranks for k in keys])
    shown = [tuple(in_unit(r[k], unit) for k in keys) for r in ranks]
    rows = [[str(first) if first == last else f"{first}-{last}", *values] for first, last, values in folded(shown)]
    headers = {"param_bytes": "params", "grad_bytes_after_backward": "grads", "optimizer_state_bytes": "optimizer",
               "comm_buffer_bytes_after_backward": "buffers", "peak_bytes": "peak", "reserved_peak_bytes": "reserved"}
    table = terminal_table(["ranks", *(headers[k] for k in keys)], rows, right=set(range(1, len(keys) + 1)))
    largest = largest_rank(ranks)
    failed = [c for c in summary["checks"] if not c["passed"]]
    alike = len(rows) == 1 and len(ranks) > 1  # every rank's figures the same: none is the largest
    lines = ["", f"zerolens.track: {summary['strategy']}, memory per rank in {label} (grads: after the last backward "
             "of a sampled step)", table, "Every rank holds the same." if alike else f"Largest: rank {largest['rank']}."]
    if summary["checks"]:
        lines.append(f"{len(summary['checks']) - len(failed)} of {len(summary['checks'])} checks passed.")
    lines += [failed_line(f"{c['name']}: {c['detail']}") for c in failed]
    lines.append(f"Report: {out / 'report.md'}; summary.json beside it.")
    return lines
