"""Units and tables, for files and for the terminal.

Bytes everywhere inside; 1024-based units in what people read (units.py), one unit per table. The
terminal gets rich's rendering, at most 100 columns wide, in colour only on a terminal (plain text
in logs and pipes); report.md and the other Markdown files get Markdown tables.
"""
from __future__ import annotations

import sys

from zerolens.units import BINARY_UNITS, MiB, unit_of

WIDTH = 100  # the terminal's width for everything zerolens prints
# The version of the files people parse (summary.json, bench.json, sweep.json, maxsize.json; keys and
# units in docs/formats.md). A change of meaning bumps it.
SCHEMA_VERSION = 2


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:.3f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.3f}"


def unit_for(values, units=BINARY_UNITS) -> tuple[float, str]:
    """One unit for a whole table: the largest (B, KiB, MiB, GiB, TiB, PiB) that its largest figure
    reaches one of, so that no figure needs more than four digits before the point. `units`:
    DECIMAL_UNITS for a column in a source's units (the ZeRO paper's GB)."""
    label, unit = unit_of(max((abs(v) for v in values if v is not None), default=0), units)
    return unit, label


def in_unit(n: float | None, unit: float, digits: int = 3) -> str:
    """`n` in `unit`; thousands grouped from 10,000 on (a figure of its table's unit stays below 1024).
    Some bytes too few to show in it are "<0.01" (say), not zero: a small model's figures beside a
    peak of GiB."""
    if n is None:
        return "-"
    value = n / unit
    if 0 < value < 0.5 * 10 ** -digits:
        return f"<{10 ** -digits:.{digits}f}"
    return f"{value:,.{digits}f}" if abs(value) >= 10_000 else f"{value:.{digits}f}"


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def console(stderr: bool = False):
    """rich's console, WIDTH columns at most (fewer on a narrower terminal)."""
    from rich.console import Console
    probe = Console(stderr=stderr)
    width = min(WIDTH, probe.width) if probe.is_terminal else WIDTH
    return Console(stderr=stderr, width=width, highlight=False, soft_wrap=False)


def say(*lines, stderr: bool = False) -> None:
    """Lines for the terminal, at most WIDTH columns. A str is printed as it is: rich's markup is off,
    since what zerolens prints (check details, paths, a user's names) may hold brackets; colour comes
    only from rich renderables (tables, `verdict_line`, `failed_line`)."""
    terminal = console(stderr)
    for line in lines:
        terminal.print(line, markup=False)


def terminal_table(header: list[str], rows: list[list], *, right: set[int] | None = None):
    """A table for the terminal (rich): numbers right-aligned (the columns in `right`); cells are
    plain text (no markup)."""
    from rich import box
    from rich.table import Table
    from rich.text import Text
    # Two spaces between columns (the box's own and a padding), one where two would take the table past
    # WIDTH: no cell then wraps.
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows)]
    gap = 1 if sum(widths) + 2 * (len(widths) - 1) > WIDTH else 2
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, gap - 1, 0, 0),
                  collapse_padding=True)
    for i, name in enumerate(header):
        # The first column names the row (a strategy, a point): never split; figures are kept short by
        # their table's unit (unit_for).
        table.add_column(Text(name), justify="right" if right and i in right else "left", overflow="fold",
                         no_wrap=i == 0, min_width=max((len(str(row[0])) for row in rows), default=0) if i == 0 else None)
    for row in rows:
        table.add_row(*(Text(str(c)) for c in row))
    return table


def verdict_line(verdict: str):
    """"Verdict: PASS" in green, FAIL in red (colour only reaches a terminal)."""
    from rich.text import Text
    return Text.assemble("Verdict: ", (verdict, f"bold {'green' if verdict == 'PASS' else 'red'}"))


def failed_line(text: str):
    """A failing check: "FAIL" in red, then its text as it is."""
    from rich.text import Text
    return Text.assemble(("FAIL", "red"), f" {text}")


PROGRESS_LINE_EVERY_S = 5.0  # off a terminal: a progress line at most this often


def progress(total: int, description: str = ""):
    """Progress on stderr: on a terminal a bar that goes when done; elsewhere (a log, a pipe, a CI job)
    a line "zerolens: <label> k/n" at most every PROGRESS_LINE_EVERY_S seconds, so that a long run is
    not silent. Use as a context manager; its `advance(label)` moves it one step."""
    return Progress(total, description)


class Progress:
    def __init__(self, total: int, description: str):
        import time
        self.total, self.description = total, description
        self.bar = self.task = None
        self.done, self.clock, self.last_line = 0, time.monotonic, time.monotonic()

    def __enter__(self):
        if sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress
            self.bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                    TimeElapsedColumn(), console=console(stderr=True), transient=True)
            self.bar.__enter__()
            self.task = self.bar.add_task(self.description, total=self.total)
        return self

    def advance(self, description: str | None = None) -> None:
        self.done += 1
        self.description = description or self.description
        if self.bar is not None:
            self.bar.update(self.task, advance=1, refresh=True, description=self.description)
        elif self.clock() - self.last_line >= PROGRESS_LINE_EVERY_S and self.done < self.total:
            self.last_line = self.clock()
            print(f"zerolens: {self.description} {self.done}/{self.total}", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)
        return False
