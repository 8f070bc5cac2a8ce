"""The `zerolens` command: one parser, each verb's arguments and command in its module of commands/;
user errors exit 2 in one line."""
from __future__ import annotations

import argparse
import os
import sys

import zerolens
from zerolens._version import __version__
from zerolens.commands import bench, estimate, maxsize, plan, sweep, verify
from zerolens.errors import Interrupted, UserError, interrupts_raised
from zerolens.run import wall_time
from zerolens.strategies import registry

VERBS = (verify, bench, maxsize, sweep, estimate, plan)  # in the order --help lists them


class ArgumentParser(argparse.ArgumentParser):
    verb = None  # the command line's verb, where it has one: its help is the one to see

    def error(self, message):  # argparse's own usage dump is long; one line, exit 2
        self.exit(2, f"zerolens: {message} (see {self.prog}{f' {self.verb}' if self.verb else ''} --help)\n")


def main(argv: list[str] | None = None) -> int:
    wall_time.mark_command_started(zerolens.IMPORTED_AT)
    argv = sys.argv[1:] if argv is None else argv
    try:
        registry.load_plugins()  # before the parser: its defaults and help name the strategies
    except UserError as e:
        print(f"zerolens: {e}", file=sys.stderr)
        return 2
    parser = ArgumentParser(prog="zerolens", description="What data-parallel sharding does to training memory.")
    parser.add_argument("--version", action="version", version=f"zerolens {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    for verb in VERBS:
        verb.add_parser(subparsers)
    # Unknown flags are found by this parser, after the verb's has taken what it knows.
    parser.verb = next((word for word in argv if word in subparsers.choices), None)
    args = parser.parse_args(argv)
    try:
        with interrupts_raised():
            return args.func(args, argv)
    except UserError as e:
        print(f"zerolens: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Interrupted (SIGINT or SIGTERM), or a KeyboardInterrupt of Python's own
        folder = getattr(e, "run_folder", None)
        print("zerolens: interrupted" + (f"; {folder / 'summary.json'} says what finished" if folder else ""),
              file=sys.stderr)
        return e.exit_code if isinstance(e, Interrupted) else 130
    except BrokenPipeError:  # `zerolens estimate | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
