"""`zerolens maxsize`: for each strategy, the deepest model of the preset's width that trains on
the given GPUs, found by trying.

A trial is a short `zerolens bench` run (one warm-up step, which allocates the optimizer's states,
and one timed step) at one depth; it fits unless a rank runs out of memory. The search is driven
by measurement: two small trials give the peak's growth per layer, a straight line through them
gives a first guess, and trials around the guess bracket the boundary, which a binary search then
pins down. The answer is always a depth that was seen to fit, with the next depth seen to fail.
"""
from __future__ import annotations

import argparse
import dataclasses
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from zerolens.errors import UserError
from zerolens.models.model import parameter_shapes
from zerolens.report import files
from zerolens.report.tables import SCHEMA_VERSION, markdown_table
from zerolens.run.flags import (
    add_bench_arguments,
    add_verify_arguments,
    config_from_args,
)
from zerolens.run.folder import new_run_folder
from zerolens.run.jobs import run_folder, say_failure
from zerolens.strategies import registry
from zerolens.units import GiB, count

FIRST_GUESS_CAP = 128
VS = f"params_vs_{registry.BENCH_REFERENCE}"  # maxsize.json's key: parameters against the reference's

# The peak per rank at a depth when it fits; None when a rank ran out of memory.
Trial = Callable[[int], "int | None"]


@dataclass
class Search:
    limit_bytes: int | None = None  # what the allocator may use per GPU, as the trials reported it
    trials: dict[int, int | None] = field(default_factory=dict)  # depth -> peak bytes, None: out of memory

    def fits(self, depth: int, trial: Trial) -> bool:
        if depth not in self.trials:
            self.trials[depth] = trial(depth)
        return self.trials[depth] is not None


def largest_fitting_depth(trial: Trial, limit_bytes: Callable[[], int], *, max_depth: int = 4096) -> Search:
    """The search; its `trials` say what was tried. max_fitting(search) is the answer (0: not even
    one layer fits). `limit_bytes` is asked after the first trials: the workers know the GPU."""
    search = Search()
    if not search.fits(1, trial):
        return search
    if not search.fits(2, trial):
        return search
    search.limit_bytes = limit_bytes()
    per_layer = max(1, search.trials[2] - search.trials[1])
    # Capped: when depth 2 barely grew the peak, the line points far away, and a model that deep
    # could exhaust the host's memory while it is built; the bracket below widens as needed.
    guess = int(max(1, min(max_depth, FIRST_GUESS_CAP, 1 + (search.limit_bytes - search.trials[1]) // per_layer)))
    # Bracket [lo fits, hi fails] around the guess, widening the step each time it is not enough.
    step = max(1, guess // 16)
    if search.fits(guess, trial):
        lo = guess
        while lo + step <= max_depth and search.fits(lo + step, trial):
            lo, step = lo + step, 2 * step
        hi = min(lo + step, max_depth + 1)  # max_depth + 1: not tried, the cap
    else:
        hi = guess
        while hi - step >= 1 and not search.fits(hi - step, trial):
            hi, step = hi - step, 2 * step
        lo = max(1, hi - step)
    while hi - lo > 1:  # lo was seen to fit; hi to fail (or is the cap)
        mid = (lo + hi) // 2
        if search.fits(mid, trial):
            lo = mid
        else:
            hi = mid
    return search


def max_fitting(search: Search) -> int:
    fitting = [d for d, peak in search.trials.items() if peak is not None]
    return max(fitting, default=0)


def maxsize_summary(config, searches: dict[str, Search], command: str) -> dict:
    def params(depth: int) -> int:
        return sum(s.numel() for s in parameter_shapes(dataclasses.replace(config.model, num_layers=depth)))

    strategies = {}
    for name, search in searches.items():
        best = max_fitting(search)
        strategies[name] = {
            "max_depth": best, "params": params(best) if best else 0,
            "peak_bytes": search.trials.get(best), "first_failing_depth": best + 1 if best + 1 in search.trials else None,
            "trials": [{"depth": d, "params": params(d), "peak_bytes": peak, "fits": peak is not None}
                       for d, peak in sorted(search.trials.items())]}
    ref = strategies.get(registry.BENCH_REFERENCE)
    for s in strategies.values():
        s[VS] = s["params"] / ref["params"] if ref and ref["params"] else None
    return {"schema_version": SCHEMA_VERSION, "command": command, "preset": config.preset,
            "width": config.model.d_model,
            "micro_batch": config.micro_batch, "precision": config.precision, "world_size": config.nproc,
            "memory_limit_bytes": next((s.limit_bytes for s in searches.values() if s.limit_bytes), None),
            "strategies": strategies}




def render_maxsize(summary: dict) -> str:
    rows = [[name, s["max_depth"], count(s["params"]),
             "-" if s["peak_bytes"] is None else f"{s['peak_bytes'] / GiB:.1f}",
             "-" if s[VS] is None else f"{s[VS]:.2f}",
             ", ".join(f"{t['depth']}{'' if t['fits'] else ' (OOM)'}" for t in s["trials"])]
            for name, s in summary["strategies"].items()]
    table = markdown_table(["strategy", "max depth", "parameters", "peak at max (GiB)",
                            f"params vs {registry.BENCH_REFERENCE}",
                            "depths tried"], rows)
    limit = summary["memory_limit_bytes"]
    return f"""# zerolens maxsize

Command: `{summary['command']}`

The deepest {summary['preset']} (width {summary['width']}) each strategy trained for two steps on
{summary['world_size']} GPUs with {"-" if limit is None else f"{limit / GiB:.1f}"} GiB for the allocator per GPU,
micro-batch {summary['micro_batch']}, {summary['precision']}. Each depth was tried (a short bench run);
the next depth ran out of memory.

{table}
"""


def run_maxsize(config, out: Path, command: str) -> int:
    """The search for every strategy of `config` (checked, on GPUs), its trials in out/trials/;
    maxsize.json, maxsize.md, and the exit code."""
    from zerolens.run.jobs import run_job
    from zerolens.run.launch import OUT_OF_MEMORY, WorkersFailed
    results, limit = {}, {}
    for name in config.strategies:
        def trial(depth: int, name=name) -> int | None:
            # One warm-up step (the optimizer's states appear in the first) and one timed step.
            # No peak prediction: a trial only asks whether the depth fits, and each would pay for it.
            point = dataclasses.replace(config, strategies=(name,), baseline=name, warmup_steps=1, steps=1,
                                        predict_peaks=False,
                                        model=dataclasses.replace(config.model, num_layers=depth),
                                        out=str(new_run_folder(out / "trials" / f"{name}-depth{depth}")))
            print(f"zerolens maxsize: {name}, depth {depth} ...", end=" ", flush=True)
            try:
                bench = run_job(point, command=f"{command} (trial: {name}, depth {depth})", quiet=True)
            except WorkersFailed as e:
                if OUT_OF_MEMORY not in str(e):
                    raise
                print("out of memory", flush=True)
                return None
            limit["bytes"] = bench["memory_limit_bytes"]
            peak = bench["strategies"][name]["peak_bytes"]
            print(f"fits, peak {peak / GiB:.2f} GiB", flush=True)
            return peak
        try:
            results[name] = largest_fitting_depth(trial, lambda: limit["bytes"])
        except WorkersFailed as e:
            say_failure(e)
            # What the strategies before it found is kept.
            files.write_json(out / "maxsize.json",
                              maxsize_summary(config, results, command) | {"failure": f"{name}: {e}"})
            return 1
    summary = maxsize_summary(config, results, command=command)
    files.write_json(out / "maxsize.json", summary)
    files.write_atomic(out / "maxsize.md", render_maxsize(summary))
    from zerolens.report.tables import say, terminal_table
    rows = [[name, s["max_depth"], count(s["params"]), "-" if s["peak_bytes"] is None
             else f"{s['peak_bytes'] / GiB:.1f}", "-" if s[VS] is None else f"{s[VS]:.2f}"]
            for name, s in summary["strategies"].items()]
    say(terminal_table(["strategy", "max depth", "parameters", "peak (GiB)", f"params vs {registry.BENCH_REFERENCE}"],
                       rows, right={1, 2, 3, 4}),
        f"Report: {out / 'maxsize.md'}; maxsize.json and every trial's folder beside it.")
    return 0


# --- The command line ------------------------------------------------------------------------------

def add_parser(subparsers) -> None:
    p = subparsers.add_parser("maxsize", help="the deepest model of a preset's width each strategy can train (GPU)",
                              description="For each strategy, search the largest --depth of the preset that trains "
                                          "without running out of GPU memory: short bench runs, one per depth tried.")
    add_verify_arguments(p)
    add_bench_arguments(p)
    # Not bench's speed defaults (flags.py): a trial is two steps, which a compile of the blocks would outlast.
    p.set_defaults(func=command, job="bench", strategies=",".join(registry.BENCH_DEFAULT), preset="gpt-1b",
                   speed_defaults=False)


def command(args: argparse.Namespace, argv: list[str]) -> int:
    if args.model:
        raise UserError("maxsize searches the depth of a preset; --model is for verify, bench and sweep")
    config = config_from_args(args)
    if config.device != "cuda":
        raise UserError("maxsize needs GPUs (on the CPU nothing runs out of memory); zerolens plan predicts it")
    return run_maxsize(config, run_folder(config, args.overwrite), command=shlex.join(["zerolens", *argv]))
