"""Starting N local workers through torch's own elastic launcher (what torchrun uses).

If one worker fails, the launcher stops the others; we turn its report into one line per
failed rank, with the phase that the worker recorded. If no rank makes progress for `timeout`
seconds (a hang: one rank stopped answering and the others wait for it in a collective, which
would otherwise time out after 30 minutes), a watchdog asks every rank for its Python stack,
names the rank that is not waiting in a collective, and ends them all.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


class WorkersFailed(RuntimeError):
    pass


def launch_local(nproc: int, worker_args: list[str], verbose: bool = False, *, logs: Path | None = None,
                 timeout: float | None = None) -> None:
    """Runs `python -m zerolens.worker *worker_args` on `nproc` local ranks; raises WorkersFailed.
    With `timeout`, the ranks' heartbeats and stacks in `logs` (worker.py) feed the hang watchdog."""
    if not verbose:
        # We print the failure ourselves, in one line: the launcher's own error lines would repeat it.
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
        # As `torchrun --standalone`: a c10d store on a free local port, never a fixed 29500.
        rdzv_backend="c10d", rdzv_endpoint="localhost:0",
        max_restarts=0, monitor_interval=0.5, start_method="spawn")
    watchdog = HangWatchdog(logs, nproc, timeout) if timeout and logs is not None else None
    if watchdog:
        watchdog.start()
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "zerolens.worker", *worker_args)
    except ChildFailedError as e:
        if watchdog and watchdog.verdict:
            raise WorkersFailed(watchdog.verdict) from None
        # The first rank to fail is the cause; the others usually failed because it vanished.
        failures = sorted(e.failures.items(), key=lambda item: (item[1].timestamp, item[0]))
        lines = [_describe(rank, failure) for rank, failure in failures]
        if len(lines) > 1:
            lines[1:] = ["then " + line for line in lines[1:]]
        raise WorkersFailed("; ".join(lines)) from None
    finally:
        if watchdog:
            watchdog.stop.set()


def _describe(rank: int, failure) -> str:
    message = failure.message
    if isinstance(message, dict):  # the error file's {"message": ..., "extraInfo": ...}
        message = message.get("message", "")
    message = str(message).removeprefix("RankFailure: ")
    if not message or "To enable traceback" in message:
        message = f"rank {rank} exited with code {failure.exitcode} without a Python error (killed?)"
    return message


# A rank whose innermost Python frame is in one of these is waiting for the others.
COLLECTIVE_CODE = ("/torch/distributed/", "/deepspeed/comm/")


class HangWatchdog(threading.Thread):
    """Ends the run when no rank's heartbeat (logs/heartbeat_rank<r>.json) has changed for
    `timeout` seconds, and says which rank stopped answering."""

    def __init__(self, logs: Path, nproc: int, timeout: float):
        super().__init__(daemon=True, name="zerolens-hang-watchdog")
        self.logs, self.nproc, self.timeout = logs, nproc, timeout
        self.stop = threading.Event()
        self.verdict: str | None = None
        self.started = time.time()

    def heartbeats(self) -> dict[int, dict]:
        beats = {}
        for rank in range(self.nproc):
            try:
                beats[rank] = json.loads((self.logs / f"heartbeat_rank{rank}.json").read_text())
            except (OSError, ValueError):
                pass  # not started yet
        return beats

    def run(self):
        while not self.stop.wait(1.0):
            beats = self.heartbeats()
            last = max([self.started, *(b["time"] for b in beats.values())])
            if time.time() - last >= self.timeout:
                self.verdict = self.diagnose(beats)
                for beat in beats.values():
                    with contextlib.suppress(OSError):
                        os.kill(beat["pid"], signal.SIGKILL)
                return

    def diagnose(self, beats: dict[int, dict]) -> str:
        for beat in beats.values():  # each rank dumps its stack (faulthandler, worker.py)
            with contextlib.suppress(OSError):
                os.kill(beat["pid"], signal.SIGUSR1)
        time.sleep(2)
        stuck, waiting = [], []
        for rank in range(self.nproc):
            if rank not in beats:
                stuck.append(f"rank {rank} never started training")
                continue
            (waiting if self.in_collective(rank) else stuck).append(f"rank {rank} during {beats[rank]['where']}")
        said = f"no rank made progress for {self.timeout:.0f} s (--timeout): "
        if stuck and waiting:
            return said + f"{', '.join(stuck)} stopped answering; {', '.join(waiting)} was waiting for it " \
                          f"in a collective; all ranks ended (stacks in {self.logs})"
        return said + "; ".join(stuck + waiting) + f"; all ranks ended (stacks in {self.logs})"

    def in_collective(self, rank: int) -> bool:
        try:
            dump = (self.logs / f"stack_rank{rank}.txt").read_text()
        except OSError:
            return False
        frames = [line for line in dump.splitlines() if line.strip().startswith("File ")]
        return bool(frames) and any(code in frames[0] for code in COLLECTIVE_CODE)
