"""verify's peak prediction, made before training by fresh processes: each rank starts one for its share
of the strategies (share_of), and rank 0 gathers their parts into predicted_peaks.json (gathered), so
that the ranks that used to wait for rank 0's one process trace too.

A training worker cannot trace in its own process: its default process group leaves no room for the
trace's fake one, and a backend may have patched torch (DeepSpeed's ZeRO-3 does).
"""
from __future__ import annotations

import json
from pathlib import Path

from zerolens.predict.peak import predicted_peaks, why_not_predicted
from zerolens.report.files import write_json
from zerolens.run.config import load_config
from zerolens.strategies import registry

PREDICTED_PEAKS = "predicted_peaks.json"  # in a run folder: made before training (worker.py)


def part_name(rank: int) -> str:
    """The file in a run folder where rank `rank`'s share of the prediction goes, until gathered."""
    return f"predicted_peaks.rank{rank}.json"


def share_of(strategies: tuple[str, ...], rank: int, world_size: int) -> tuple[str, ...]:
    """The strategies rank `rank` of `world_size` predicts: every world_size-th, from its own place (none
    where there are fewer strategies than ranks)."""
    return tuple(strategies[rank::world_size])


def on_own_gpu(device) -> dict | None:
    """The environment of a rank's prediction process on a GPU: this one's, with CUDA_VISIBLE_DEVICES naming
    the rank's own GPU alone (as this process's CUDA_VISIBLE_DEVICES numbers it, where set), so that the
    CUDA context its trace opens is there, not every rank's on GPU 0. None (this process's environment)
    off GPUs."""
    import os
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else 0
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return {**os.environ, "CUDA_VISIBLE_DEVICES": visible[index] if index < len(visible) else str(index)}


def gathered(config, run_folder: Path, world_size: int) -> dict:
    """The ranks' parts (part_name) of the prediction, in the run's order of strategies, written to the run
    folder's predicted_peaks.json; the parts, zerolens's own, removed. A part missing (its rank's process
    left none) leaves its strategies a `why_not`."""
    predicted = {}
    for rank in range(world_size):
        part = run_folder / part_name(rank)
        share = share_of(config.strategies, rank, world_size)
        made = json.loads(part.read_text()) if part.exists() else {}
        predicted |= {name: made.get(name, {"why_not": f"rank {rank}'s prediction wrote nothing"}) for name in share}
        part.unlink(missing_ok=True)
    predicted = {name: predicted[name] for name in config.strategies}
    write_json(run_folder / PREDICTED_PEAKS, predicted)
    return predicted


# How long a rank waits for its prediction's process (predict_in_fresh_process) at most, the ranks done
# first waiting for it in a barrier (NCCL's times out after 10 minutes).
PREDICTION_TIMEOUT_S = 300


def predict_in_fresh_process(config, run_folder: Path, cuda_capability: tuple[int, int] | None,
                             strategies: tuple[str, ...] | None = None, into: str = PREDICTED_PEAKS,
                             env: dict | None = None) -> dict:
    """predicted_peaks of a run (a RunConfig, saved in `run_folder` as config.json; of `strategies` alone,
    where given), made by a fresh Python process (`python -m zerolens.run.prediction`) and written to the
    run folder's file `into`: a training worker cannot trace in its own process, whose default process
    group leaves no room for the trace's fake one, and where a backend may have patched torch
    (DeepSpeed's ZeRO-3 does). A process that fails, or is still running after PREDICTION_TIMEOUT_S
    (or half the hang watchdog's --timeout, which would end every rank), leaves each strategy a
    `why_not`, with what the process wrote on stderr (`traceback`)."""
    import subprocess
    import sys

    timeout = PREDICTION_TIMEOUT_S if config.timeout is None else min(PREDICTION_TIMEOUT_S, config.timeout / 2)
    strategies = config.strategies if strategies is None else strategies
    command = [sys.executable, "-m", "zerolens.run.prediction", str(run_folder), "--strategies", ",".join(strategies),
               "--into", into]
    if cuda_capability is not None:
        command += ["--cuda-capability", ".".join(map(str, cuda_capability))]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        why, stderr = f"the prediction took more than {timeout:g} s, and its process was ended", e.stderr
    else:
        if result.returncode == 0:
            return json.loads((run_folder / into).read_text())
        last_line = ([line for line in result.stderr.splitlines() if line.strip()] or [""])[-1]
        why, stderr = f"the prediction's process failed (exit code {result.returncode}: {last_line})", result.stderr
    if isinstance(stderr, bytes):  # TimeoutExpired keeps what was read before the end as bytes
        stderr = stderr.decode(errors="replace")
    predicted = {name: {"why_not": why_not_predicted(name, config) or why, "traceback": stderr or ""}
                 for name in strategies}
    write_json(run_folder / into, predicted)
    return predicted


def main(argv: list[str] | None = None) -> int:
    """python -m zerolens.run.prediction RUN_FOLDER [--strategies A,B] [--into FILE] [--cuda-capability
    MAJOR.MINOR]: what predict_in_fresh_process runs."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m zerolens.run.prediction",
                                     description="Each strategy's peaks, predicted for the run in RUN_FOLDER "
                                                 "(its config.json), into RUN_FOLDER/" + PREDICTED_PEAKS)
    parser.add_argument("run_folder", type=Path)
    parser.add_argument("--strategies", default=None, help="those of the run's strategies to predict (default: all)")
    parser.add_argument("--into", default=PREDICTED_PEAKS, help="the file in RUN_FOLDER to write")
    parser.add_argument("--cuda-capability", type=lambda text: tuple(int(n) for n in text.split(".")), default=None,
                        help="the GPU's compute capability, e.g. 9.0 (without it: a CPU run)")
    args = parser.parse_args(argv)
    registry.load_plugins()  # the run's strategies may come from plugins
    config = load_config(str(args.run_folder / "config.json"))
    strategies = None if args.strategies is None else tuple(n for n in args.strategies.split(",") if n)
    write_json(args.run_folder / args.into, predicted_peaks(config, args.cuda_capability, strategies=strategies))
    return 0


if __name__ == "__main__":
    from zerolens.predict.peak import keep_heap_frozen
    keep_heap_frozen()  # a process of zerolens's own, tracing each strategy in turn
    raise SystemExit(main())
