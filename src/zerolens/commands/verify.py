"""`zerolens verify`: train each strategy on the same data from the same weights, measure every rank,
and check the measurement against the prediction and the losses against the baseline's."""
from __future__ import annotations

import argparse
import shlex

from zerolens.run.flags import (
    add_verify_arguments,
    config_from_args,
)
from zerolens.run.jobs import run_in_new_folder


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("verify", help="run the case study's ZeRO-2 experiment correctly and check it",
                              description="Train the case study's model under each strategy on N ranks, "
                                          "measure per-rank memory, and check ZeRO's claims.")
    add_verify_arguments(p)
    p.set_defaults(func=command)


def command(args: argparse.Namespace, argv: list[str]) -> int:
    config = config_from_args(args)
    summary = run_in_new_folder(config, command=shlex.join(["zerolens", *argv]), overwrite=args.overwrite)
    return 0 if summary is not None and summary["verdict"] == "PASS" else 1
