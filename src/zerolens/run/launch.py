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


OUT_OF_MEMORY = "ran out of GPU memory"  # a rank's message (worker.py); what `zerolens maxsize` looks for


def launch_local(nproc: int, worker_args: list[str], verbose: bool = False, *, logs: Path | None = None,
                 timeout: float | None = None, backend: str = "gloo") -> None:
    """Runs `python -m zerolens.run.worker *worker_args` on `nproc` local ranks; raises WorkersFailed.
    With `timeout`, the ranks' heartbeats and stacks in `logs` (worker.py) feed the hang watchdog."""
    if not verbose:
        # We print the failure ourselves, in one line: the launcher's own error lines would repeat it.
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
        # As `torchrun --standalone`: a c10d store on a free local port, never a fixed 29500.
        rdzv_backend="c10d", rdzv_endpoint="localhost:0",
        max_restarts=0, monitor_interval=0.5, start_method="spawn")
    watchdog = HangWatchdog(logs, nproc, timeout, backend) if timeout and logs is not None else None
    if watchdog:
        watchdog.start()
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "zerolens.run.worker", *worker_args)
    except ChildFailedError as e:
        if watchdog:
            if not watchdog.firing.is_set():
                watchdog.stop.set()
            watchdog.join()  # a diagnosis under way (its stack dumps can end a rank) is completed
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
            # Stopped and joined before this launch returns: it must never signal the next launch's workers.
            watchdog.stop.set()
            watchdog.join()


def _describe(rank: int, failure) -> str:
    message = failure.message
    if isinstance(message, dict):  # the error file's {"message": ..., "extraInfo": ...}
        message = message.get("message", "")
    message = str(message).removeprefix("RankFailure: ")
    if not message or "To enable traceback" in message:
        message = f"rank {rank} exited with code {failure.exitcode} without a Python error (killed?)"
    return message


# A rank whose innermost Python frame is in one of these is waiting for the others: inside a
# collective (gloo blocks there), or, on NCCL, where collectives run on the GPU and return at once,
# waiting for the device (a synchronize, or the copy of a result to the host) that the collective
# holds up.
WAITING_CODE = ("/torch/distributed/", "/deepspeed/comm/", "/torch/cuda/")


def child_pids() -> list[int]:
    """The processes this one started and has not yet reaped: the launcher's workers. A child's PID
    is not reused before its parent reaps it; the launcher reaps from another thread, so a worker
    that exits between this list and the signal could, in principle, lose its PID to another
    process in that instant. Heartbeat files, which outlive their processes, were far worse."""
    me, children = os.getpid(), []
    proc = Path("/proc")
    if proc.is_dir():
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                # /proc/<pid>/stat: pid (comm) state ppid ...; comm may hold spaces and parentheses.
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == me:
                children.append(int(entry.name))
        return children
    with contextlib.suppress(OSError, ValueError):  # macOS and other systems without /proc
        import subprocess
        out = subprocess.run(["pgrep", "-P", str(me)], capture_output=True, text=True, timeout=10).stdout
        children = [int(pid) for pid in out.split()]
    return children


def signal_children(sig: int) -> None:
    """`sig` to each worker and everything it started: torch's launcher starts each worker in a
    session of its own, so its process group holds its descendants."""
    for pid in child_pids():
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)


class HangWatchdog(threading.Thread):
    """Ends the run when no rank's heartbeat (logs/heartbeat_rank<r>.json) has changed for
    `timeout` seconds since this launch began, heartbeats or not, and says which rank stopped
    answering. It ends this process's own children, the workers, never a PID read from a file."""

    def __init__(self, logs: Path, nproc: int, timeout: float, backend: str = "gloo"):
        super().__init__(daemon=True, name="zerolens-hang-watchdog")
        self.logs, self.nproc, self.timeout, self.backend = logs, nproc, timeout, backend
        self.stop = threading.Event()
        self.verdict: str | None = None
        self.firing = threading.Event()  # set once the timeout has passed and the diagnosis began
        self.started = time.time()

    def heartbeats(self) -> dict[int, dict]:
        """This launch's heartbeats (an earlier launch's, in the same run folder, are older than it)."""
        beats = {}
        for rank in range(self.nproc):
            try:
                beat = json.loads((self.logs / f"heartbeat_rank{rank}.json").read_text())
            except (OSError, ValueError):
                continue  # not started yet
            if beat["time"] >= self.started:
                beats[rank] = beat
        return beats

    def run(self):
        while not self.stop.wait(1.0):
            beats = self.heartbeats()
            last = max([self.started, *(b["time"] for b in beats.values())])
            if time.time() - last >= self.timeout:
                self.firing.set()
                verdict = self.diagnose(beats)
                if self.stop.is_set():  # the launch ended while the stacks were dumped: nothing to end
                    return
                self.verdict = verdict
                signal_children(signal.SIGKILL)
                return

    def diagnose(self, beats: dict[int, dict]) -> str:
        signal_children(signal.SIGUSR1)  # each rank dumps its Python stack (faulthandler, worker.py)
        self.stop.wait(2)
        stuck, waiting = [], []
        for rank in range(self.nproc):
            where = f"during {beats[rank]['where']}" if rank in beats else "before its first heartbeat"
            (waiting if self.waiting(rank) else stuck).append(f"rank {rank} {where}")
        said = f"no rank made progress for {self.timeout:.0f} s (--timeout): "
        ended = f"all ranks ended (stacks in {self.logs})"
        if stuck and waiting:
            verb = "was" if len(waiting) == 1 else "were"
            return said + f"{', '.join(stuck)} stopped answering; {', '.join(waiting)} {verb} waiting for it; {ended}"
        if self.backend == "nccl" and len(stuck) > 1:
            return said + "; ".join(stuck) + ("; which rank stopped first cannot be told from their stacks (on NCCL a "
                                              f"rank waits for a collective outside any Python call); {ended}")
        return said + "; ".join(stuck + waiting) + f"; {ended}"

    def waiting(self, rank: int) -> bool:
        """The rank's innermost Python frame is in a collective or waits for the device."""
        try:
            dump = (self.logs / f"stack_rank{rank}.txt").read_text()
        except OSError:
            return False
        frames = [line for line in dump.splitlines() if line.strip().startswith("File ")]
        return bool(frames) and any(code in frames[0] for code in WAITING_CODE)
