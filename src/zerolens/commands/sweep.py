"""`zerolens sweep`: one verify run per (model, world size, reduce bucket size), tabulated side by
side, and checked across world sizes: gradient bytes per rank against 1/N, losses against the
smallest N's."""
from __future__ import annotations

import argparse
import math
import shlex
import sys
from dataclasses import replace
from itertools import groupby

from zerolens.errors import UserError
from zerolens.models.model import PRESETS
from zerolens.report.checks import check, loss_matches
from zerolens.report.tables import SCHEMA_VERSION, markdown_table, mib
from zerolens.run.flags import (
    add_verify_arguments,
    config_from_args,
    micro_batch_of,
    visible_gpus,
)
from zerolens.run.jobs import run_folder
from zerolens.run.validate import check_config
from zerolens.strategies import registry
from zerolens.strategies.layout import deepspeed_layout


def point_summary(summary: dict, reduce_bucket_size: int, folder: str, preset: str,
                  param_shapes: list[tuple[int, ...]], global_batch: int) -> dict:
    """What the sweep keeps of one verify run: per strategy, the largest rank's figures (the rank
    holding the most gradient bytes), its prediction, the unsharded gradient bytes (the same
    strategy's prediction on one rank) and the losses."""
    numels = [math.prod(shape) for shape in param_shapes]
    strategies = {}
    for name, s in summary["strategies"].items():
        top = max(s["ranks"], key=lambda r: r["grad_bytes_after_backward"])
        peaks = [r["peak_bytes"] for r in s["ranks"] if r["peak_bytes"] is not None]
        step_times = [r["median_step_seconds"] for r in s["ranks"] if r.get("median_step_seconds") is not None]
        unsharded = registry.predict_retained(name, numels, 1, 0, summary["precision"], reduce_bucket_size=reduce_bucket_size,
                                     param_shapes=param_shapes,
                                     deepspeed=deepspeed_layout(summary["versions"].get("deepspeed"))
                                     )["grad_bytes_after_backward"]
        strategies[name] = {
            "rank": top["rank"],
            "grad_bytes_after_backward": top["grad_bytes_after_backward"],
            "predicted_grad_bytes_after_backward": top["predicted"]["grad_bytes_after_backward"],
            "unsharded_grad_bytes": unsharded,
            "grad_partition_elements": top["grad_partition_elements"],
            "param_bytes": top["param_bytes"], "optimizer_state_bytes": top["optimizer_state_bytes"],
            "comm_buffer_bytes_after_backward": top["comm_buffer_bytes_after_backward"],
            "activation_bytes_after_forward": top["activation_bytes_after_forward"],
            "peak_bytes": max(peaks) if peaks else None,
            # The slowest rank's median forward + backward + step time (verify's steps are measured,
            # so slower than `zerolens bench`'s; comparable between strategies and points).
            "step_time_s": max(step_times) if step_times else None,
            "losses": s["losses"], "seconds": s["seconds"],
        }
    return {"preset": preset, "params": summary["param_count"], "world_size": summary["world_size"],
            # For the envelope of across_n: the largest parameter, and the elements in one row
            # (along dim 0, the dimension FSDP2 shards) of every parameter, summed.
            "largest_param_elements": max(numels),
            "row_elements": sum(n // shape[0] if len(shape) else 1 for n, shape in zip(numels, param_shapes)),
            "reduce_bucket_size": reduce_bucket_size, "global_batch": global_batch,
            "baseline": summary["baseline"],
            "device": summary["device"], "precision": summary["precision"], "verdict": summary["verdict"],
            "folder": folder, "strategies": strategies}


def series(points: list[dict]) -> list[list[dict]]:
    """The points grouped by (model, bucket size), each group ordered by N: the series the
    across-N checks compare."""
    key = lambda p: (p["preset"], p["reduce_bucket_size"])  # noqa: E731
    ordered = sorted(points, key=lambda p: (*key(p), p["world_size"]))
    return [list(group) for _, group in groupby(ordered, key=key)]


def across_n(points: list[dict]) -> tuple[list[dict], list[str]]:
    """Per model, bucket size, strategy and N: the largest rank's retained gradient bytes (see
    gradient_check), and the loss at every step against the smallest N's when every N trained on
    the same global batch. Returns (rows, notes); each row holds its "gradients" check and its
    "loss" check or None."""
    rows, notes = [], []
    for group in series(points):
        first = group[0]
        where = f"{first['preset']}, bucket {first['reduce_bucket_size']:.0e}"
        same_batch = len({p["global_batch"] for p in group}) == 1
        if len(group) > 1 and not same_batch:
            notes.append(f"{where}: losses not compared across N: the global batch changes with N "
                         f"({', '.join(str(p['global_batch']) for p in group)}); pass --global-batch to hold it fixed")
        one_rank = next((p for p in group if p["world_size"] == 1), None)
        for name in first["strategies"]:
            # The unsharded bytes: measured at N=1 when the sweep ran it, else predicted for N=1.
            unsharded = (one_rank["strategies"][name]["grad_bytes_after_backward"], "measured at N=1") if one_rank \
                else (first["strategies"][name]["unsharded_grad_bytes"], "predicted for N=1")
            for p in group:
                s, n = p["strategies"][name], p["world_size"]
                loss = None
                if p is not first and same_batch:
                    loss = loss_matches(f"{where}: {name} at N={n}", s["losses"], f"N={first['world_size']}",
                                        first["strategies"][name]["losses"], p["precision"])
                rows.append({"preset": p["preset"], "reduce_bucket_size": p["reduce_bucket_size"], "strategy": name,
                             "world_size": n, "gradients": gradient_check(where, name, p, unsharded), "loss": loss})
    return rows, notes


def gradient_check(where: str, name: str, point: dict, unsharded: tuple[int, str]) -> dict:
    """The largest rank's retained gradient bytes at this N are, exactly, theory's prediction
    (unsharded x 1/N, or whole, plus the padding and whole edge parameters of the layout), and,
    independently of that layout model, inside an envelope: for a sharding strategy at least 1/N of
    the unsharded bytes (N ranks hold them all between them, so the largest holds 1/N or more) and
    at most 1/N plus two whole largest parameters (ZeRO-1/2 keep the parameters crossing either
    edge of a partition whole) plus one row per parameter and extra rank (the padding of ZeRO-3's
    and FSDP2's shards); for DDP and ZeRO-0, the unsharded bytes."""
    s, n = point["strategies"][name], point["world_size"]
    unsharded_bytes, source = unsharded
    share = registry.spec(name).gradient_share(n)
    ideal = unsharded_bytes * share
    predicted = s["predicted_grad_bytes_after_backward"]
    held = s["grad_bytes_after_backward"]
    element_bytes = unsharded_bytes / point["params"]
    slack = element_bytes * (2 * point["largest_param_elements"] + (n - 1) * point["row_elements"]) \
        if registry.spec(name).shards_gradients and n > 1 else 0
    if n == 1 and source == "measured at N=1":
        # N=1 is the reference the envelope of the other N is built from: against itself it would
        # pass whatever was measured, so N=1 is held against the prediction alone.
        return check(
            f"gradients follow {'1/N' if registry.spec(name).shards_gradients else 'whole'} plus padding ({where}, {name}, N=1)",
            held == predicted,
            measured={"bytes": held, "share_of_unsharded": 1.0, "rank": s["rank"]},
            expected={"bytes": predicted, "share": 1.0, "share_bytes": ideal, "padding_bytes": predicted - ideal,
                      "unsharded_bytes": unsharded_bytes, "unsharded_from": source, "envelope_bytes": None},
            tolerance="exactly the prediction (0 bytes); no envelope at N=1, the reference of the other N",
            detail=f"rank 0 holds {mib(held)} MiB, predicted {mib(predicted)} MiB; N=1 is the unsharded reference "
                   "of the other N, so it is compared with the prediction only")
    within = ideal <= held <= ideal + slack
    return check(
        f"gradients follow {'1/N' if registry.spec(name).shards_gradients else 'whole'} plus padding ({where}, {name}, N={n})",
        held == predicted and within,
        measured={"bytes": held, "share_of_unsharded": held / unsharded_bytes, "rank": s["rank"]},
        expected={"bytes": predicted, "share": share, "share_bytes": ideal, "padding_bytes": predicted - ideal,
                  "unsharded_bytes": unsharded_bytes, "unsharded_from": source,
                  "envelope_bytes": [ideal, ideal + slack]},
        tolerance="exactly the prediction (0 bytes), and inside the envelope",
        detail=f"rank {s['rank']} holds {held / unsharded_bytes:.4f} of the unsharded {mib(unsharded_bytes)} MiB "
               f"({source}); {'1/' + str(n) if share < 1 else 'whole'} is {mib(round(ideal))} MiB, plus "
               f"{(predicted - ideal) / 2**20:+.3f} MiB of padding and whole edge parameters predicted: "
               f"measured {mib(held)} MiB, predicted {mib(predicted)} MiB, envelope {mib(round(ideal))}-"
               f"{mib(round(ideal + slack))} MiB{'' if within else ' (OUTSIDE)'}")


def across_n_checks(rows: list[dict]) -> list[dict]:
    return [c for row in rows for c in (row["gradients"], row["loss"]) if c is not None]


def render_sweep(points: list[dict], command: str, failed: list[str], rows: list[dict], notes: list[str],
                 verdict: str) -> str:
    table_rows = []
    for p in points:
        for name, s in p["strategies"].items():
            table_rows.append([p["preset"], p["world_size"], p["global_batch"], f"{p['reduce_bucket_size']:.0e}", name,
                               mib(s["grad_bytes_after_backward"]), mib(s["predicted_grad_bytes_after_backward"]),
                               mib(s["param_bytes"]), mib(s["optimizer_state_bytes"]), mib(s["peak_bytes"]),
                               "-" if s["step_time_s"] is None else f"{s['step_time_s'] * 1e3:.1f}",
                               f"{s['losses'][-1]:.4f}", p["verdict"]])
    table = markdown_table(["model", "N", "global batch", "reduce bucket", "strategy",
                            "grads after backward (largest rank)", "predicted", "params", "optimizer states",
                            "peak (largest rank)", "step (ms, median)", "last loss", "verify"], table_rows)
    checks = across_n_checks(rows)
    missing = f"\nFailed points (see their run folders): {', '.join(failed)}\n" if failed else ""
    note_lines = "".join(f"\nNote: {n}\n" for n in notes)
    failures = "".join(f"\n- FAIL {c['name']}: {c['detail']}" for c in checks if not c["passed"])
    return f"""# zerolens sweep: {verdict}

Command: `{command}`. One `zerolens verify` per row group; each point's folder holds its own
report. Memory in MiB (1024^2 bytes), per rank, the rank holding the most gradient bytes. Step time:
forward + backward + step, median over verify's steps but the first and the last, slowest rank
(verify measures every step: use `zerolens bench` for throughput).
{missing}
{table}

## Across world sizes

Gradients: the largest rank's retained gradient bytes after backward against the same strategy's
unsharded bytes (measured at N=1, or predicted where the sweep has no N=1): 1/N of them for the
strategies that shard gradients, all of them for the others, plus the padding and whole edge
parameters that theory predicts at that N. The check requires the prediction to the byte and,
independently of the layout model, at least 1/N and at most 1/N plus two whole largest parameters
and a row of padding per parameter and extra rank (the envelope in sweep.json). Loss: the same
strategy's loss curve at the smallest N, on the same global batch, compared as moving means (the
largest gap, relative to the smallest N's loss; the tolerance by precision is in sweep.json).
{note_lines}
{across_n_table(rows)}

Across-N checks: {sum(c["passed"] for c in checks)} of {len(checks)} passed.{failures}
"""


def across_n_table(rows: list[dict]) -> str:
    out = []
    for row in rows:
        grads, loss = row["gradients"], row["loss"]
        out.append([row["preset"], f"{row['reduce_bucket_size']:.0e}", row["strategy"], row["world_size"],
                    mib(grads["measured"]["bytes"]), f"{grads['measured']['share_of_unsharded']:.4f}",
                    f"{grads['expected']['share']:.4f}", f"{grads['expected']['padding_bytes'] / 2**20:+.3f}",
                    "PASS" if grads["passed"] else "FAIL",
                    "-" if loss is None else f"{loss['measured']['max_relative_diff']:.2e}",
                    "-" if loss is None else ("PASS" if loss["passed"] else "FAIL")])
    return markdown_table(["model", "bucket", "strategy", "N", "grads (largest rank)", "share of unsharded",
                           "1/N or whole", "predicted padding (MiB)", "grads as predicted",
                           "loss: largest gap vs smallest N (moving means)", "loss"], out)


def run_sweep(points: list, out, command: str) -> int:
    """One verify per point (checked RunConfigs, each with its own folder under `out`), then the
    table, the checks across world sizes, sweep.json, sweep.md and the plots. The exit code."""
    from zerolens.models.model import parameter_shapes
    from zerolens.report import files
    from zerolens.report.tables import say
    from zerolens.run.jobs import run_in_new_folder
    done, failed = [], []
    # What each point's own header would say (the CPU's precision, the processes per core), said once here:
    # the points run quietly
    said = list(dict.fromkeys(note for config in points for note in (config.device_note, config.precision_note)
                              if note))
    for note in said:
        say(f"zerolens: {note}")
    for i, config in enumerate(points, 1):
        label = f"{config.preset}, N={config.nproc}, reduce_bucket_size {config.reduce_bucket_size:.0e}"
        say(f"zerolens sweep: point {i} of {len(points)}: {label} ...")
        # A point's own terminal summary only with --verbose; its report and summary.json always.
        summary = run_in_new_folder(config, command=f"{command} (point: {label})", quiet=not config.verbose)
        say(f"zerolens sweep: point {i} of {len(points)}: {'failed' if summary is None else summary['verdict']} "
            f"({config.out})")
        if summary is None:
            failed.append(f"{config.preset} N={config.nproc} bucket {config.reduce_bucket_size:.0e}")
            continue
        done.append(point_summary(summary, config.reduce_bucket_size, config.out, config.preset,
                                  param_shapes=[tuple(s) for s in parameter_shapes(config.model)],
                                  global_batch=config.micro_batch * config.nproc * config.grad_accum))
    if not done:
        print("zerolens: every sweep point failed", file=sys.stderr)
        return 1
    rows, notes = across_n(done)
    notes = said + notes
    checks = across_n_checks(rows)
    passed = not failed and all(p["verdict"] == "PASS" for p in done) and all(c["passed"] for c in checks)
    verdict = "PASS" if passed else "FAIL"
    text = render_sweep(done, command=command, failed=failed, rows=rows, notes=notes, verdict=verdict)
    files.write_json(out / "sweep.json", {"schema_version": SCHEMA_VERSION, "verdict": verdict, "points": done,
                                           "failed": failed,
                                           "across_n_checks": checks, "notes": notes})
    files.write_atomic(out / "sweep.md", text)
    try:
        from zerolens.report.plots import sweep_plots
        sweep_plots(done, out)
    except ImportError:
        say("zerolens: plots skipped: matplotlib is not installed (pip install matplotlib)")
    say(*sweep_terminal_lines(rows, checks, verdict, out))
    return 0 if passed else 1


def sweep_terminal_lines(rows: list[dict], checks: list[dict], verdict: str, out) -> list:
    """The sweep for the terminal: per model, bucket and strategy, the largest rank's gradients as a
    share of the unsharded ones at each N; the checks across N (every failing one in full); the
    verdict; where the files are."""
    from zerolens.report.tables import failed_line, terminal_table, verdict_line
    ns = sorted({r["world_size"] for r in rows})
    table_rows = {}
    for r in rows:
        key = (r["preset"], f"{r['reduce_bucket_size']:.0e}", r["strategy"])
        table_rows.setdefault(key, {})[r["world_size"]] = f"{r['gradients']['measured']['share_of_unsharded']:.4f}"
    table = terminal_table(["model", "bucket", "strategy", *(f"N={n}" for n in ns)],
                           [[*key, *(shares.get(n, "-") for n in ns)] for key, shares in table_rows.items()],
                           right=set(range(3, 3 + len(ns))))
    failed = [c for c in checks if not c["passed"]]
    return ["", "Gradients kept by the largest rank, as a share of the unsharded ones (1/N where sharded):", table,
            f"Across world sizes: {len(checks) - len(failed)} of {len(checks)} checks passed.",
            *(failed_line(f"{c['name']}: {c['detail']}") for c in failed),
            verdict_line(verdict),
            f"Report: {out / 'sweep.md'}; sweep.json, the plots and each point's folder beside it."]


# --- The command line ------------------------------------------------------------------------------

def add_parser(subparsers) -> None:
    p = subparsers.add_parser("sweep", help="verify over several world sizes and bucket sizes; table and plots",
                              description="Run verify for every world size in --nproc-list and every "
                                          "--reduce-bucket-sizes value, then tabulate and plot per-rank memory.")
    add_verify_arguments(p)
    p.add_argument("--nproc-list", default="1,2", help="comma-separated world sizes (default 1,2)")
    p.add_argument("--presets", default=None,
                   help=f"comma-separated models, from {','.join(PRESETS)} (default: --preset)")
    p.add_argument("--reduce-bucket-sizes", default=None,
                   help="comma-separated DeepSpeed reduce_bucket_size values (default: --reduce-bucket-size)")
    p.set_defaults(func=command)


def int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(float(v)) for v in text.split(",") if v.strip()]
    except (ValueError, OverflowError):  # OverflowError: "inf"
        raise UserError(f"{flag} takes finite numbers (comma-separated for several), got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise UserError(f"{flag} needs positive values, got {text!r}")
    return values


def command(args: argparse.Namespace, argv: list[str]) -> int:
    if args.nproc is not None:
        raise UserError("sweep takes its world sizes from --nproc-list, not --nproc")
    ns = int_list(args.nproc_list, "--nproc-list")
    buckets = int_list(args.reduce_bucket_sizes or str(args.reduce_bucket_size), "--reduce-bucket-sizes"
                       if args.reduce_bucket_sizes else "--reduce-bucket-size")
    if args.model and args.presets:
        raise UserError("--presets and --model: a sweep runs presets or your model, not both")
    presets = [p.strip() for p in args.presets.split(",") if p.strip()] if args.presets else [args.preset]
    unknown = [p for p in presets if p not in PRESETS]
    if unknown or not presets:
        raise UserError(f"--presets: unknown model {unknown[0] if unknown else '(none)'}; choose from {', '.join(PRESETS)}")
    # One config per model (a preset brings its own defaults), its points derived from it; every point
    # is checked before the first one runs, and before anything is written.
    points = []
    for preset in presets:
        base = config_from_args(argparse.Namespace(**{**vars(args), "preset": preset, "nproc": ns[0]}), checked=True)
        for n in ns:
            for bucket in buckets:
                points.append(replace(base, nproc=n, micro_batch=micro_batch_of(args, n, default=base.micro_batch),
                                      reduce_bucket_size=bucket))
    for point in points:
        check_config(point, gpus_visible=visible_gpus())
    out = run_folder(points[0], args.overwrite)
    points = [replace(p, out=str(out / (f"n{p.nproc}-bucket{p.reduce_bucket_size}"
                                        + (f"-{p.preset}" if len(presets) > 1 else "")))) for p in points]
    return run_sweep(points, out, command=shlex.join(["zerolens", *argv]))
