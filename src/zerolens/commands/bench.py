"""`zerolens bench`: step time, throughput, MFU and peak memory of each strategy against DDP's (the
summary and its presentation: report/bench.py)."""
from __future__ import annotations

import argparse
import shlex

from zerolens.errors import UserError
from zerolens.run.flags import (
    BENCH_PRESET,
    add_bench_arguments,
    add_verify_arguments,
    config_from_args,
)
from zerolens.run.jobs import run_in_new_folder
from zerolens.strategies import registry


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="step time, tokens/s, MFU and peak memory of each strategy vs DDP",
                              description="Train each strategy on the same model and data; time the steps after "
                                          "a warm-up and report throughput, MFU and peak memory, with ratios to DDP.")
    add_verify_arguments(p, preset_default=f"{BENCH_PRESET['cuda']} on GPUs, {BENCH_PRESET['cpu']} on the CPU")
    add_bench_arguments(p)
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of every strategy, interleaved (A B, A B, ...), each strategy in its own processes; "
                        "a ratio to DDP is the median over the rounds, with their range (default 3)")
    p.add_argument("--no-reference", action="store_true",
                   help="leave out the reference loops (each backend's, written without zerolens), "
                        "which measure the harness's overhead beside each strategy in every round")
    p.set_defaults(func=command, job="bench", steps=10, strategies=",".join(registry.BENCH_DEFAULT), preset=None)


def command(args: argparse.Namespace, argv: list[str]) -> int:
    if args.baseline is not None:
        raise UserError(f"bench compares every strategy with {registry.BENCH_REFERENCE}; --baseline is for verify")
    config = config_from_args(args)
    return 0 if run_in_new_folder(config, shlex.join(["zerolens", *argv]), args.overwrite) is not None else 1
