"""The `zerolens` command. One small function per command; user errors exit 2 in one line."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from . import __version__
from .config import UserError, add_verify_arguments, config_from_args, parse_strategies
from .estimate import estimate, param_numels_from_factory, preset_numels, render_estimate
from .model import PRESETS
from .strategies import STRATEGIES
from .launch import WorkersFailed, launch_local
from .worker import default_run_folder


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
    config = config_from_args(args)
    out = Path(config.out) if config.out else default_run_folder()
    if out.exists() and any(out.iterdir()):
        raise UserError(f"run folder {out} already exists and is not empty; choose another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create run folder {out}: {e.strerror}") from None
    # The workers inherit this environment. DS_ACCELERATOR saves DeepSpeed a probe and a warning;
    # one OpenMP thread team per core keeps N CPU ranks from fighting over the cores.
    os.environ.setdefault("DS_ACCELERATOR", config.device)
    if config.device == "cpu":
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // config.nproc)))
    command = shlex.join(["zerolens", *argv])
    worker_args = [*argv[1:], "--device", config.device, "--nproc", str(config.nproc), "--out", str(out),
                   "--fail-exit-code", "0", "--command", command]
    try:
        launch_local(config.nproc, worker_args, verbose=config.verbose)
    except WorkersFailed as e:
        print(f"zerolens: FAILED: {e}", file=sys.stderr)
        return 1
    summary = json.loads((out / "summary.json").read_text())
    return 0 if summary["verdict"] == "PASS" else 1


def estimate_parser(subparsers) -> None:
    p = subparsers.add_parser("estimate", help="predict per-rank memory without training or GPUs",
                              description="Per-rank memory by component for each strategy, from the parameter "
                                          "sizes alone: a built-in preset, your model, or a raw count.")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: case-study")
    source.add_argument("--model", metavar="MODULE:FACTORY",
                        help="a function returning your nn.Module; it is built on the meta device")
    source.add_argument("--params", type=float, help="a raw parameter count, e.g. 7.5e9 (the paper's formulas)")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--nproc", type=int, default=2, help="data-parallel ranks (default 2)")
    p.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default="fp16")
    p.add_argument("--reduce-bucket-size", type=float, default=5e7)
    p.add_argument("--json", action="store_true", help="print JSON (bytes) instead of a table")
    p.set_defaults(func=estimate_command)


def estimate_command(args: argparse.Namespace, argv: list[str]) -> int:
    strategies = parse_strategies(args.strategies)
    if args.nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {args.nproc}")
    if args.params is not None and args.params <= 0:
        raise UserError(f"--params must be positive, got {args.params}")
    try:
        numels = (None if args.params is not None else
                  param_numels_from_factory(args.model) if args.model else preset_numels(args.preset or "case-study"))
    except ValueError as e:
        raise UserError(str(e)) from None
    result = estimate(strategies=strategies, world_size=args.nproc, precision=args.precision,
                      reduce_bucket_size=int(args.reduce_bucket_size), param_numels=numels, params=args.params)
    print(json.dumps(result, indent=2) if args.json else render_estimate(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = ArgumentParser(prog="zerolens", description="What data-parallel sharding does to training memory.")
    parser.add_argument("--version", action="version", version=f"zerolens {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    verify_parser(subparsers)
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
