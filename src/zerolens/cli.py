"""The `zerolens` command. One small function per command; user errors exit 2 in one line."""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from pathlib import Path

from . import __version__, report
from .config import (PRESET_GPU_PRECISION, UserError, add_bench_arguments, add_verify_arguments, config_from_args,
                     parse_strategies)
from .estimate import estimate, param_shapes_from_factory, preset_shapes, render_estimate
from .faults import fault_from_environment
from .model import PRESETS
from .strategies import registry
from .launch import WorkersFailed, launch_local
from .runfolder import default_run_folder, new_run_folder
from .worker import OUT_OF_MEMORY, results_path


USER_OMP_THREADS = os.environ.get("OMP_NUM_THREADS")


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own usage dump is long; one line, exit 2
        self.exit(2, f"zerolens: {message} (see {self.prog} --help)\n")


def verify_parser(subparsers) -> None:
    p = subparsers.add_parser("verify", help="run the case study's ZeRO-2 experiment correctly and check it",
                              description="Train the case study's model under each strategy on N ranks, "
                                          "measure per-rank memory, and check ZeRO's claims.")
    add_verify_arguments(p)
    p.set_defaults(func=verify_command)


def verify_command(args: argparse.Namespace, argv: list[str]) -> int:
    summary = run_verify(args, argv[1:], command=shlex.join(["zerolens", *argv]))
    return 0 if summary is not None and summary["verdict"] == "PASS" else 1


def run_verify(args: argparse.Namespace, verify_argv: list[str], command: str) -> dict | None:
    """One verify run on local workers; its summary, or None when a rank failed (said on stderr)."""
    try:
        return run_job("verify", args, verify_argv, command)
    except WorkersFailed as e:
        report_failure(args, e, command)
        return None


def report_failure(args: argparse.Namespace, error: WorkersFailed, command: str) -> None:
    """A run that did not finish: one line on stderr, and summary.json marked FAIL with why, beside
    the ranks' logs."""
    print(f"zerolens: FAILED: {error}", file=sys.stderr)
    out = Path(args.out) if args.out else None
    if out is not None and out.is_dir():
        report.write_json(out / "summary.json", {"verdict": "FAIL", "failure": str(error), "command": command})
        print(f"zerolens: summary marked FAIL in {out / 'summary.json'}; per-rank logs in {out / 'logs'}",
              file=sys.stderr)


def run_job(job: str, args: argparse.Namespace, job_argv: list[str], command: str) -> dict:
    """`job` (verify or bench) on local workers; its summary.json or bench.json. Raises WorkersFailed
    when a rank failed."""
    config = config_from_args(args)
    try:
        fault_from_environment()
    except ValueError as e:
        raise UserError(str(e)) from None
    if getattr(args, "timeout", None) is not None and not args.timeout > 0:
        raise UserError(f"--timeout must be positive (seconds), got {args.timeout}")
    out = new_run_folder(Path(config.out) if config.out else default_run_folder(), getattr(args, "overwrite", False))
    args.out = str(out)  # the folder the workers write to, for whoever reports a failure
    # The workers inherit this environment. DS_ACCELERATOR saves DeepSpeed a probe and a warning;
    # one OpenMP thread team per core keeps N CPU ranks from fighting over the cores.
    os.environ.setdefault("DS_ACCELERATOR", config.device)
    if config.device == "cpu" and USER_OMP_THREADS is None:  # per run: a sweep changes nproc
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // config.nproc))
    worker_args = [*job_argv, "--job", job, "--device", config.device, "--nproc", str(config.nproc),
                   "--out", str(out), "--fail-exit-code", "0", "--command", command, "--resume"]
    # A launch ends early after a strategy that left memory allocated (worker.run_strategies); the
    # strategies after it get fresh processes, so that it is in none of their peaks.
    remaining = len(config.strategies)
    while remaining:
        launch_local(config.nproc, worker_args, verbose=config.verbose, logs=out / "logs",
                     timeout=getattr(args, "timeout", None), backend="nccl" if config.device == "cuda" else "gloo")
        left = sum(not results_path(out, name).exists() for name in config.strategies)
        if left >= remaining:  # a launch that ended cleanly must have finished at least one
            raise WorkersFailed(f"the workers ended without results for {left} strategies")
        remaining = left
    return json.loads((out / ("bench.json" if job == "bench" else "summary.json")).read_text())


def bench_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="step time, tokens/s, MFU and peak memory of each strategy vs DDP",
                              description="Train each strategy on the same model and data; time the steps after "
                                          "a warm-up and report throughput, MFU and peak memory, with ratios to DDP.")
    add_verify_arguments(p)
    add_bench_arguments(p)
    p.set_defaults(func=bench_command, job="bench", steps=10, strategies=",".join(registry.BENCH_DEFAULT),
                   preset="gpt-100m")


def bench_command(args: argparse.Namespace, argv: list[str]) -> int:
    if args.baseline is not None:
        raise UserError(f"bench compares every strategy with {registry.BENCH_REFERENCE}; --baseline is for verify")
    if args.steps < 1:
        raise UserError(f"--steps (timed steps) must be at least 1, got {args.steps}")
    # The workers parse verify's defaults (100 steps, its strategies, case-study): bench's own
    # defaults must reach them as explicit flags.
    command = shlex.join(["zerolens", *argv])
    try:
        run_job("bench", args, job_flags(args), command=command)
    except WorkersFailed as e:
        report_failure(args, e, command)
        return 1
    return 0


def maxsize_parser(subparsers) -> None:
    p = subparsers.add_parser("maxsize", help="the deepest model of a preset's width each strategy can train (GPU)",
                              description="For each strategy, search the largest --depth of the preset that trains "
                                          "without running out of GPU memory: short bench runs, one per depth tried.")
    add_verify_arguments(p)
    add_bench_arguments(p)
    p.set_defaults(func=maxsize_command, job="bench", strategies=",".join(registry.BENCH_DEFAULT), preset="gpt-1b")


def maxsize_command(args: argparse.Namespace, argv: list[str]) -> int:
    from .maxsize import largest_fitting_depth, maxsize_summary, render_maxsize
    config = config_from_args(args)
    if config.device != "cuda":
        raise UserError("maxsize needs GPUs: on the CPU nothing runs out of memory (use --device cuda)")
    out = new_run_folder(Path(args.out) if args.out else default_run_folder(), args.overwrite)
    results, limit = {}, {}
    for name in config.strategies:
        def trial(depth: int, name=name) -> int | None:
            folder = out / "trials" / f"{name}-depth{depth}"
            trial_args = argparse.Namespace(**{**vars(args), "strategies": name, "depth": depth, "warmup": 1,
                                               "steps": 1, "out": str(folder)})
            flags = job_flags(trial_args) + ["--quiet"]
            print(f"zerolens maxsize: {name}, depth {depth} ...", end=" ", flush=True)
            try:
                bench = run_job("bench", trial_args, flags, command=shlex.join(["zerolens", "bench", *flags]))
            except WorkersFailed as e:
                if OUT_OF_MEMORY not in str(e):
                    raise
                print("out of memory", flush=True)
                return None
            limit["bytes"] = bench["memory_limit_bytes"]
            peak = bench["strategies"][name]["peak_bytes"]
            print(f"fits, peak {peak / 2**30:.2f} GiB", flush=True)
            return peak
        try:
            results[name] = largest_fitting_depth(trial, lambda: limit["bytes"])
        except WorkersFailed as e:
            print(f"zerolens: FAILED: {e}", file=sys.stderr)
            # What the strategies before it found is kept.
            summary = maxsize_summary(config, results, command=shlex.join(["zerolens", *argv]))
            report.write_json(out / "maxsize.json", summary | {"failure": f"{name}: {e}"})
            return 1
    summary = maxsize_summary(config, results, command=shlex.join(["zerolens", *argv]))
    report.write_json(out / "maxsize.json", summary)
    text = render_maxsize(summary)
    report.write_atomic(out / "maxsize.md", text)
    print("\n" + text)
    return 0


def sweep_parser(subparsers) -> None:
    p = subparsers.add_parser("sweep", help="verify over several world sizes and bucket sizes; table and plots",
                              description="Run verify for every world size in --nproc-list and every "
                                          "--reduce-bucket-sizes value, then tabulate and plot per-rank memory.")
    add_verify_arguments(p)
    p.add_argument("--nproc-list", default="1,2", help="comma-separated world sizes (default 1,2)")
    p.add_argument("--presets", default=None,
                   help=f"comma-separated models, from {','.join(PRESETS)} (default: --preset)")
    p.add_argument("--reduce-bucket-sizes", default=None,
                   help="comma-separated DeepSpeed reduce_bucket_size values (default: --reduce-bucket-size)")
    p.set_defaults(func=sweep_command)


def int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(float(v)) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{flag} must be comma-separated numbers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise UserError(f"{flag} needs positive values, got {text!r}")
    return values


def sweep_command(args: argparse.Namespace, argv: list[str]) -> int:
    from .model import parameter_shapes
    from .sweep import across_n, across_n_checks, point_summary, render_sweep
    if args.nproc is not None:
        raise UserError("sweep takes its world sizes from --nproc-list, not --nproc")
    ns = int_list(args.nproc_list, "--nproc-list")
    buckets = int_list(args.reduce_bucket_sizes, "--reduce-bucket-sizes") if args.reduce_bucket_sizes else \
        [int(args.reduce_bucket_size)]
    if args.model and args.presets:
        raise UserError("--presets and --model: a sweep runs presets or your model, not both")
    presets = [p.strip() for p in args.presets.split(",") if p.strip()] if args.presets else [args.preset]
    unknown = [p for p in presets if p not in PRESETS]
    if unknown or not presets:
        raise UserError(f"--presets: unknown model {unknown[0] if unknown else '(none)'}; choose from {', '.join(PRESETS)}")
    grid = [(preset, n, bucket) for preset in presets for n in ns for bucket in buckets]
    # Every point's configuration is checked before the first one runs, and before anything is written.
    configs = {(preset, n, bucket): config_from_args(argparse.Namespace(
        **{**vars(args), "preset": preset, "nproc": n, "reduce_bucket_size": bucket, "out": None}))
        for preset, n, bucket in grid}
    out = new_run_folder(Path(args.out) if args.out else default_run_folder(), args.overwrite)
    points, failed = [], []
    for preset, n, bucket in grid:
        folder = f"n{n}-bucket{bucket}" + (f"-{preset}" if len(presets) > 1 else "")
        point_args = argparse.Namespace(**{**vars(args), "preset": preset, "nproc": n, "reduce_bucket_size": bucket,
                                           "out": str(out / folder)})
        verify_argv = job_flags(point_args)
        print(f"zerolens sweep: {args.model or preset}, N={n}, reduce_bucket_size {bucket:.0e}", flush=True)
        summary = run_verify(point_args, verify_argv, command=shlex.join(["zerolens", "verify", *verify_argv]))
        if summary is None:
            failed.append(f"{args.model or preset} N={n} bucket {bucket:.0e}")
            continue
        config = configs[(preset, n, bucket)]
        points.append(point_summary(summary, bucket, point_args.out, args.model or preset,
                                    param_shapes=[tuple(s) for s in parameter_shapes(config.model)],
                                    global_batch=config.micro_batch * n))
    if not points:
        print("zerolens: every sweep point failed", file=sys.stderr)
        return 1
    rows, notes = across_n(points)
    checks = across_n_checks(rows)
    passed = not failed and all(p["verdict"] == "PASS" for p in points) and all(c["passed"] for c in checks)
    verdict = "PASS" if passed else "FAIL"
    text = render_sweep(points, command=shlex.join(["zerolens", *argv]), failed=failed, rows=rows, notes=notes,
                        verdict=verdict)
    report.write_json(out / "sweep.json", {"verdict": verdict, "points": points, "failed": failed,
                                           "across_n_checks": checks, "notes": notes})
    report.write_atomic(out / "sweep.md", text)
    print("\n" + text)
    try:
        from .plots import sweep_plots
        print("Plots: " + ", ".join(str(p) for p in sweep_plots(points, out)))
    except ImportError:
        print("zerolens: plots skipped: matplotlib is not installed (pip install matplotlib)")
    return 0 if passed else 1


def job_flags(args: argparse.Namespace) -> list[str]:
    """The worker's command line for a verify (one sweep point) or bench run: every setting explicit."""
    flags = ["--strategies", args.strategies, "--preset", args.preset, "--steps", str(args.steps),
             *(["--fused-adam"] if args.fused_adam else []),
             *(["--activation-checkpointing"] if args.activation_checkpointing else []),
             *(["--compile"] if args.compile else []),
             "--seed", str(args.seed), "--micro-batch", str(args.micro_batch),
             "--reduce-bucket-size", str(args.reduce_bucket_size), "--gradient-clipping", str(args.gradient_clipping)]
    if getattr(args, "job", "verify") == "bench":
        flags += ["--warmup", str(args.warmup if args.warmup is not None else 3)]
    for flag, value in (("--nproc", args.nproc), ("--out", args.out), ("--peak-tflops", getattr(args, "peak_tflops", None)),
                        ("--memory-limit-gib", getattr(args, "memory_limit_gib", None)),
                        ("--baseline", args.baseline), ("--device", args.device), ("--precision", args.precision),
                        ("--lr", args.lr), ("--global-batch", args.global_batch), ("--width", args.width),
                        ("--depth", args.depth), ("--heads", args.heads), ("--seq-len", args.seq_len),
                        ("--ds-override", args.ds_override), ("--ds-config", args.ds_config),
                        ("--model", args.model), ("--batch", args.batch)):
        if value is not None:
            flags += [flag, str(value)]
    return flags + (["--verbose"] if args.verbose else [])


def estimate_parser(subparsers) -> None:
    p = subparsers.add_parser("estimate", help="predict per-rank memory without training or GPUs",
                              description="Per-rank memory by component for each strategy, from the parameter "
                                          "sizes alone: a built-in preset, your model, or a raw count.")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: case-study")
    source.add_argument("--model", metavar="MODULE:FACTORY",
                        help="a function returning your nn.Module; it is built on the meta device")
    source.add_argument("--params", type=float, help="a raw parameter count, e.g. 7.5e9 (the paper's formulas)")
    p.add_argument("--strategies", default=",".join(registry.names()))
    p.add_argument("--nproc", type=int, default=2, help="data-parallel ranks (default 2)")
    p.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default=None,
                   help="default: what verify runs on GPUs (fp16 for case-study, bf16 for the other presets and "
                        "your model; fp16 with --params, the ZeRO paper's)")
    p.add_argument("--reduce-bucket-size", type=float, default=5e7)
    p.add_argument("--json", action="store_true", help="print JSON (bytes) instead of a table")
    p.set_defaults(func=estimate_command)


def estimate_command(args: argparse.Namespace, argv: list[str]) -> int:
    strategies = parse_strategies(args.strategies)
    if args.nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {args.nproc}")
    if args.params is not None and not (math.isfinite(args.params) and args.params >= 1):
        raise UserError(f"--params must be a positive, finite parameter count, got {args.params}")
    if not (math.isfinite(args.reduce_bucket_size) and args.reduce_bucket_size >= 1):
        raise UserError(f"--reduce-bucket-size must be at least 1 element, got {args.reduce_bucket_size}")
    try:
        shapes = (None if args.params is not None else
                  param_shapes_from_factory(args.model) if args.model else preset_shapes(args.preset or "case-study"))
    except ValueError as e:
        raise UserError(str(e)) from None
    try:
        precision = args.precision or ("fp16" if args.params is not None else
                                       PRESET_GPU_PRECISION.get(None if args.model else args.preset or "case-study",
                                                                "bf16"))
        result = estimate(strategies=strategies, world_size=args.nproc, precision=precision,
                          reduce_bucket_size=int(args.reduce_bucket_size), param_shapes=shapes, params=args.params)
    except ValueError as e:  # e.g. a model FSDP2 cannot shard
        raise UserError(str(e)) from None
    print(json.dumps(result, indent=2) if args.json else render_estimate(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = ArgumentParser(prog="zerolens", description="What data-parallel sharding does to training memory.")
    parser.add_argument("--version", action="version", version=f"zerolens {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    verify_parser(subparsers)
    bench_parser(subparsers)
    maxsize_parser(subparsers)
    sweep_parser(subparsers)
    estimate_parser(subparsers)
    args = parser.parse_args(argv)
    try:
        return args.func(args, argv)
    except UserError as e:
        print(f"zerolens: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("zerolens: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `zerolens estimate | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
