"""Starting N local workers through torch's own elastic launcher (what torchrun uses).

If one worker fails, the launcher stops the others; we turn its report into one line per
failed rank, with the phase that the worker recorded.
"""
from __future__ import annotations

import logging
import sys
import uuid

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


class WorkersFailed(RuntimeError):
    pass


def launch_local(nproc: int, worker_args: list[str], verbose: bool = False) -> None:
    """Runs `python -m zerolens.worker *worker_args` on `nproc` local ranks; raises WorkersFailed."""
    if not verbose:
        logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
        # As `torchrun --standalone`: a c10d store on a free local port, never a fixed 29500.
        rdzv_backend="c10d", rdzv_endpoint="localhost:0",
        max_restarts=0, monitor_interval=0.5, start_method="spawn")
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "zerolens.worker", *worker_args)
    except ChildFailedError as e:
        # The first rank to fail is the cause; the others usually failed because it vanished.
        failures = sorted(e.failures.items(), key=lambda item: (item[1].timestamp, item[0]))
        lines = [_describe(rank, failure) for rank, failure in failures]
        if len(lines) > 1:
            lines[1:] = ["then " + line for line in lines[1:]]
        raise WorkersFailed("; ".join(lines)) from None


def _describe(rank: int, failure) -> str:
    message = failure.message
    if isinstance(message, dict):  # the error file's {"message": ..., "extraInfo": ...}
        message = message.get("message", "")
    message = str(message).removeprefix("RankFailure: ")
    if not message or "To enable traceback" in message:
        message = f"rank {rank} exited with code {failure.exitcode} without a Python error (killed?)"
    return message
