"""Running a checked config on local workers: its run folder, config.json, the launches, and what a
failure leaves. Used by every command that trains (verify, bench, sweep, maxsize)."""
from __future__ import annotations

import json
import os
import signal
import time
import traceback
from dataclasses import replace
from pathlib import Path

from zerolens.errors import Interrupted
from zerolens.predict.peak import predicted_peaks
from zerolens.report import files
from zerolens.report.tables import SCHEMA_VERSION, say
from zerolens.run import wall_time
from zerolens.run.config import RunConfig, save_config
from zerolens.run.folder import default_run_folder, new_run_folder, results_path
from zerolens.run.launch import WorkersFailed, launch_local, start_workers_server
from zerolens.run.prediction import PREDICTED_PEAKS
from zerolens.run.worker import launched_rank
from zerolens.strategies import registry

USER_OMP_THREADS = os.environ.get("OMP_NUM_THREADS")


def run_in_new_folder(config: RunConfig, command: str, overwrite: bool = False, quiet: bool = False) -> dict | None:
    """One verify or bench on local workers, in a new run folder; its summary.json or bench.json, or
    None when a rank failed (said on stderr, and summary.json marked FAIL)."""
    out = run_folder(config, overwrite)
    try:
        return run_job(replace(config, out=str(out)), command, quiet=quiet)
    except WorkersFailed as e:
        report_failure(out, e, command)
        return None
    except Interrupted as e:
        record_interruption(out, config, e, command)
        raise


def run_folder(config: RunConfig, overwrite: bool) -> Path:
    return new_run_folder(Path(config.out) if config.out else default_run_folder(), overwrite)


def report_failure(out: Path, error: WorkersFailed, command: str) -> None:
    """A run that did not finish: one line on stderr, and summary.json marked FAIL with why, beside
    the ranks' logs."""
    say_failure(error)
    if out.is_dir():
        files.write_json(out / "summary.json", {"schema_version": SCHEMA_VERSION, "verdict": "FAIL",
                                                 "failure": str(error), "command": command})
        say(f"zerolens: summary marked FAIL in {out / 'summary.json'}; per-rank logs in {out / 'logs'}", stderr=True)


def record_interruption(out: Path, config: RunConfig, interrupted: Interrupted, command: str) -> None:
    """A run ended by SIGINT or SIGTERM before its summary: summary.json says so, and which strategies
    had finished (their results are in results/). A run whose summary was written keeps it (verify
    writes its report.md after it, bench its bench.md after bench.json)."""
    if not out.is_dir() or (out / "summary.json").exists():
        return
    finished = [name for name in config.strategies if results_path(out, name).exists()]
    files.write_json(out / "summary.json", {
        "schema_version": SCHEMA_VERSION, "verdict": "INTERRUPTED", "interrupted_by": signal.Signals(interrupted.signum).name,
        "finished": finished, "not_finished": [name for name in config.strategies if name not in finished],
        "command": command})
    interrupted.run_folder = out


def say_failure(error: WorkersFailed) -> None:
    """The failure on stderr within the terminal's width: a line per rank, in the order they failed."""
    say("zerolens: FAILED:", *(f"  {line}" for line in error.lines), stderr=True)


def run_job(config: RunConfig, command: str, quiet: bool = False) -> dict:
    """A checked config's verify or bench on local workers, in its run folder (config.out, made
    already): config.json written there, then the workers started with it. Returns summary.json or
    bench.json; raises WorkersFailed when a rank failed."""
    out = Path(config.out)
    save_config(config, out / "config.json", command)
    wall_time.note_command_parts(out)
    # The workers inherit this environment (the fork server, started below, too). DS_ACCELERATOR saves
    # DeepSpeed a probe and a warning; one OpenMP thread team per core keeps N CPU ranks from fighting over
    # the cores.
    os.environ.setdefault("DS_ACCELERATOR", config.device)
    if config.device == "cpu" and USER_OMP_THREADS is None:  # per run: a sweep changes nproc
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // config.nproc))
    preload = ("deepspeed",) if registry.needing_deepspeed(config.strategies) else ()
    backend = "nccl" if config.device == "cuda" else "gloo"
    start_workers_server(launched_rank, backend, preload)  # its imports beside the prediction below
    if config.predict_peaks and config.device == "cpu":
        # A CPU run's peaks, predicted here before any worker starts: this process has no process group
        # and no GPU to keep free, so the trace needs no fresh process (the workers make one where the run
        # has GPUs or another launcher started them: prediction.py). They find the file and go on.
        started = time.time()
        files.write_json(out / PREDICTED_PEAKS, cpu_prediction(config))
        wall_time.note(out, "prediction", time.time() - started)
    worker_args = ["--config", str(out / "config.json"), "--resume", "--fail-exit-code", "0", "--command", command,
                   *(["--quiet"] if quiet else [])]
    # A launch ends early after a strategy that left memory allocated (worker.run_strategies); the
    # strategies after it get fresh processes, so that it is in none of their peaks.
    # A bench times each strategy of each round in fresh processes (worker.run_strategies), so that none
    # runs in processes another has warmed, fragmented or left memory in.
    remaining = len(config.run_items())
    while remaining:
        wall_time.note_launch_requested(out)
        launch_local(config.nproc, launched_rank, worker_args, verbose=config.verbose, logs=out / "logs",
                     timeout=config.timeout, backend=backend, preload=preload)
        left = sum(not results_path(out, name, r).exists() for r, name in config.run_items())
        if left >= remaining:  # a launch that ended cleanly must have finished at least one
            raise WorkersFailed(f"the workers ended without results for {left} strategies")
        remaining = left
    return json.loads((out / ("bench.json" if config.job == "bench" else "summary.json")).read_text())


def cpu_prediction(config: RunConfig) -> dict:
    """predicted_peaks of a CPU run, or for each strategy why not: a prediction that fails leaves the
    reason and the traceback, and the run goes on, as a failed fresh process does (prediction.py)."""
    try:
        return predicted_peaks(config, cuda_capability=None)
    except Exception as e:
        why = f"the prediction failed ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})"
        return {name: {"why_not": why, "traceback": traceback.format_exc()} for name in config.strategies}
