"""Starting N local workers through torch's own elastic launcher (what torchrun uses).

CPU ranks are forked from a server process that has imported torch, DeepSpeed and zerolens once
(multiprocessing's forkserver): those imports take about 4 s of CPU per process, most of a short
CPU run's cost. CUDA ranks are spawned afresh: importing DeepSpeed asks the driver for its GPUs,
and a process that has touched CUDA cannot safely fork.

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
import multiprocessing
import os
import select
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


class WorkersFailed(RuntimeError):
    """What failed, as one message; `lines`: the same, a line per rank in the order they failed."""

    def __init__(self, message: str, lines: list[str] | None = None):
        super().__init__(message)
        self.lines = lines or [message]


OUT_OF_MEMORY = "ran out of GPU memory"  # a rank's message (worker.py); what `zerolens maxsize` looks for
LAUNCHER_PID = "ZEROLENS_LAUNCHER_PID"  # the process that launched the ranks: they end when it does


def launch_local(nproc: int, entrypoint: Callable[[list[str]], None], worker_args: list[str], verbose: bool = False,
                 *, logs: Path | None = None, timeout: float | None = None, backend: str = "gloo",
                 preload: Sequence[str] = ()) -> None:
    """Runs `entrypoint(worker_args)` (worker.launched_rank) on `nproc` local ranks; raises
    WorkersFailed. With `timeout`, the ranks' heartbeats and stacks in `logs` (worker.py) feed the
    hang watchdog. `preload`: modules, beside the entrypoint's, that forked CPU ranks find imported
    (used only where this process starts its fork server, at its first CPU launch)."""
    if not verbose:
        # We print the failure ourselves, a line per rank: the launcher's own error lines would repeat it,
        # and torch's process spawner says it terminates the other ranks, which the failure says too.
        for name in ("torch.distributed.elastic", "torch.multiprocessing.spawn"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    method = start_workers_server(entrypoint, backend, preload)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
        # As `torchrun --standalone`: a c10d store on a free local port, never a fixed 29500.
        rdzv_backend="c10d", rdzv_endpoint="localhost:0",
        # monitor_interval: how soon the launcher sees the ranks end (torchrun's default is 0.1 s too)
        max_restarts=0, monitor_interval=0.1, start_method=method,
        signals_to_handle="SIGHUP,SIGQUIT")  # SIGINT and SIGTERM are ours: ranks_ended_on_interrupt
    watchdog = HangWatchdog(logs, nproc, timeout, backend) if timeout and logs is not None else None
    if watchdog:
        watchdog.start()
    launched = time.time()
    exits = RankExits(logs, nproc, launched) if logs is not None else None
    if exits:
        exits.start()
    try:
        with ranks_ended_on_interrupt():
            elastic_launch(config, entrypoint=entrypoint)(list(worker_args))
    except ChildFailedError as e:
        if watchdog:
            if not watchdog.firing.is_set():
                watchdog.stop.set()
            watchdog.join()  # a diagnosis under way (its stack dumps can end a rank) is completed
        if watchdog and watchdog.verdict:
            raise WorkersFailed(watchdog.verdict) from None
        if exits:
            exits.finish()
        lines = failure_lines(e.failures, logs, since=launched, ended=exits.ended if exits else None)
        if len(lines) > 1:
            lines[1:] = ["then " + line for line in lines[1:]]
        raise WorkersFailed("; ".join(lines), lines) from None
    finally:
        if exits:
            exits.finish()
        if watchdog:
            # Stopped and joined before this launch returns: it must never signal the next launch's workers.
            watchdog.stop.set()
            watchdog.join()


@contextlib.contextmanager
def ranks_ended_on_interrupt():
    """SIGINT or SIGTERM during a launch: every rank and what it started (its process group) killed at
    once, then Interrupted raised (errors.interrupts_raised). torch's launcher, which would otherwise
    take these signals (LaunchConfig.signals_to_handle), passes them to the ranks, which print their
    tracebacks, waits up to 30 s for them, and leaves what a rank started (a GPU run's prediction
    process) running; a rank blocked in a collective runs no Python handler, and only a kill ends it
    promptly."""
    from zerolens.errors import interrupts_raised
    with interrupts_raised(on_signal=lambda signum: signal_ranks(signal.SIGKILL)):
        yield


def start_workers_server(entrypoint: Callable[[list[str]], None], backend: str, preload: Sequence[str] = ()) -> str:
    """How the ranks will start (start_method); where that is the fork server, it is started now with its
    imports (the entrypoint's module, `preload`, torch._dynamo, which every optimizer step imports), so
    that it can import them while this process does something else (a CPU run's peak prediction,
    jobs.py). At most once per process: later calls find it running."""
    # Read by every rank (worker.ended_with_launcher); set before the fork server starts, whose environment
    # its ranks inherit. Constant for the process, like the fork server.
    os.environ[LAUNCHER_PID] = str(os.getpid())
    method = start_method(backend)
    if method == "forkserver":
        from multiprocessing import forkserver
        multiprocessing.get_context("forkserver").set_forkserver_preload(
            [entrypoint.__module__, "torch._dynamo", *preload])
        # Started with Ctrl-C ignored, which it and the ranks it forks keep (Python installs no handler for
        # a signal ignored at its start): a terminal's Ctrl-C reaches the whole process group, and the server
        # printed a KeyboardInterrupt's traceback from its imports. This process ends them (ranks_ended_on_interrupt).
        with sigint_ignored():
            forkserver.ensure_running()
    return method


@contextlib.contextmanager
def sigint_ignored():
    """SIGINT ignored while inside, in the main thread (elsewhere Python sets no handler: unchanged)."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def start_method(backend: str) -> str:
    """How the ranks start (the module's docstring says why): forked from a fork server for gloo on the
    CPU where the system has one, else spawned."""
    if backend == "gloo" and "forkserver" in multiprocessing.get_all_start_methods():
        return "forkserver"
    return "spawn"


def failure_lines(failures: dict, logs: Path | None, since: float, ended: dict[int, float] | None = None) -> list[str]:
    """What failed, the cause first. torch's launcher names the failed rank it noticed first, which
    need not be the first to fail; each rank that failed with a Python error wrote its message into
    its log (logs/rank<r>.log, worker.py) as it failed, so the logs written since `since` give the
    order. A rank that died without a Python error (a signal: the kernel's out-of-memory killer; a hard
    exit) writes none, and the others then fail with errors of their own (a peer's connection closed):
    it comes first. Such a rank is one the launcher names without a message, or one that ended, by
    `ended` (RankExits: rank -> when its process ended), before any rank that logged an error did
    (those end after their error; the ranks the launcher stops end after the first failure it saw)."""
    logged: list[tuple[int, int, str]] = []  # (written at, rank, message)
    for path in (logs.glob("rank*.log") if logs is not None else ()):
        with contextlib.suppress(OSError, ValueError):
            written = path.stat().st_mtime_ns
            if written >= since * 1e9:
                logged.append((written, int(path.stem.removeprefix("rank")), path.read_text().split("\n", 1)[0]))
    with_message = {r for _, r, _ in logged}
    ended = ended or {}
    first_logged_end = min((ended[r] for r in with_message if r in ended), default=None)
    vanished = [rank for _, rank in sorted((t, r) for r, t in ended.items() if r not in with_message
                                           and first_logged_end is not None and t < first_logged_end)]
    silent = vanished + [rank for rank in sorted(failures) if rank not in with_message and rank not in vanished]
    return [_describe(rank, failures.get(rank), logs, since) for rank in silent] + [m for _, _, m in sorted(logged)]


def _describe(rank: int, failure, logs: Path | None = None, since: float = 0) -> str:
    """A rank that left no log of its own: the launcher's message where it has one, else where its last
    heartbeat since `since` (worker.py; an earlier launch's says nothing of this one) says it was and how
    it ended."""
    message = "" if failure is None else failure.message
    if isinstance(message, dict):  # the error file's {"message": ..., "extraInfo": ...}
        message = message.get("message", "")
    message = str(message).removeprefix("RankFailure: ")
    # torch's own words where the rank wrote no error: "Signal 9 (SIGKILL) received by PID ...", "To enable traceback"
    if message and "To enable traceback" not in message and not message.startswith("Signal "):
        return message
    where = ""
    beat = None if logs is None else read_heartbeat(logs, rank)
    if beat is not None:
        with contextlib.suppress(KeyError, TypeError):  # a heartbeat without its fields
            where = f" during {beat['where']}" if beat["time"] >= since else " before its first heartbeat"
    how = "killed by a signal (the kernel's out-of-memory killer?) or a hard exit"
    if failure is not None:
        with contextlib.suppress(ValueError):
            how = (f"killed by {signal.Signals(-failure.exitcode).name} (the kernel's out-of-memory killer?)"
                   if failure.exitcode < 0 else f"exited with code {failure.exitcode} (os._exit, or native code?)")
    return f"rank {rank} ended{where} without a Python error: {how}"


def read_heartbeat(logs: Path, rank: int) -> dict | None:
    """A rank's heartbeat (worker.py, train.Heartbeat), or None where it has none yet or it was met half
    written (a rank rewrites it in place)."""
    try:
        return json.loads((logs / f"heartbeat_rank{rank}.json").read_text())
    except (OSError, ValueError):
        return None


class RankExits(threading.Thread):
    """When each of this launch's ranks ended (`ended`: rank -> time): what tells a rank that died without
    a Python error, which writes no log, from those that then failed because it vanished (failure_lines).
    It watches this process's own ranks (rank_pids), each known by the pid in its heartbeat, through a
    pidfd, which becomes readable when the process ends (Linux; elsewhere it watches nothing). It only
    watches: it signals no process."""

    def __init__(self, logs: Path, nproc: int, started: float):
        super().__init__(daemon=True, name="zerolens-rank-exits")
        self.logs, self.nproc, self.started = logs, nproc, started
        self.ended: dict[int, float] = {}
        self.stop = threading.Event()
        self.own: set[int] = set()  # rank_pids, as last scanned (at most once a second: a scan reads all of /proc)
        self.scanned = 0.0

    def finish(self) -> None:
        """Stopped and joined, once every rank that has ended has been seen to."""
        if self.is_alive():
            self.stop.set()
            self.join()

    def run(self) -> None:
        if not hasattr(os, "pidfd_open"):
            return
        watching: dict[int, int] = {}  # pidfd -> rank
        try:
            while True:
                stopping = self.stop.is_set()
                if len(watching) + len(self.ended) < self.nproc and not stopping:
                    self.watch_new(watching)
                ready, _, _ = select.select(list(watching), [], [], 0 if stopping else 0.1)
                for fd in ready:
                    self.ended[watching.pop(fd)] = time.time()
                    os.close(fd)
                if stopping:
                    return
        finally:
            for fd in watching:
                os.close(fd)

    def watch_new(self, watching: dict[int, int]) -> None:
        for rank in set(range(self.nproc)) - set(watching.values()) - set(self.ended):
            beat = read_heartbeat(self.logs, rank)
            if beat is None or beat.get("time", 0) < self.started:
                continue  # not started yet, met half written, or an earlier launch's
            if beat.get("pid") not in self.own and time.time() - self.scanned >= 1:
                self.own, self.scanned = set(rank_pids()), time.time()
            if beat.get("pid") in self.own:
                with contextlib.suppress(OSError):
                    watching[os.pidfd_open(beat["pid"])] = rank


# A rank whose innermost Python frame is in one of these is waiting for the others: inside a
# collective (gloo blocks there), or, on NCCL, where collectives run on the GPU and return at once,
# waiting for the device (a synchronize, or the copy of a result to the host) that the collective
# holds up; or in autograd's engine, whose C++ runs DDP's gradient all-reduce and waits for it at
# backward's end (a hook of the user's own, in Python, would be the innermost frame instead).
WAITING_CODE = ("/torch/distributed/", "/deepspeed/comm/", "/torch/cuda/", "/torch/autograd/")


def rank_pids() -> list[int]:
    """The launcher's workers: the processes this one started, directly or through its fork server,
    that lead a process group of their own (each rank starts a session of its own first thing:
    worker.launched_rank; torch's launcher starts a binary in one). The fork server and
    multiprocessing's resource tracker are in this process's group and are left alone. A rank's PID
    is not reused before its parent reaps it; the launcher reaps from another thread, so a rank that
    exits between this list and the signal could, in principle, lose its PID to another process in
    that instant. Heartbeat files, which outlive their processes, were far worse."""
    parents = process_parents()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in parents.items():
        children.setdefault(ppid, []).append(pid)
    ranks, todo = [], list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        if parents[pid][1] == pid:
            ranks.append(pid)  # its group holds what it started
        else:
            todo.extend(children.get(pid, []))
    return sorted(ranks)


def process_parents() -> dict[int, tuple[int, int]]:
    """Every process's (parent PID, process group), from /proc, else (macOS) from ps."""
    table = {}
    proc = Path("/proc")
    if proc.is_dir():
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                # /proc/<pid>/stat: pid (comm) state ppid pgrp ...; comm may hold spaces and parentheses.
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                table[int(entry.name)] = (int(fields[1]), int(fields[2]))
            except (OSError, IndexError, ValueError):
                continue
        return table
    with contextlib.suppress(OSError, ValueError, subprocess.SubprocessError):
        out = subprocess.run(["ps", "-A", "-o", "pid=,ppid=,pgid="], capture_output=True, text=True,
                             timeout=10).stdout
        for line in out.splitlines():
            pid, ppid, pgid = map(int, line.split())
            table[pid] = (ppid, pgid)
    return table


def signal_ranks(sig: int) -> None:
    """`sig` to each rank and everything it started (its process group)."""
    for pid in rank_pids():
        with contextlib.suppress(OSError):
            os.killpg(pid, sig)


class HangWatchdog(threading.Thread):
    """Ends the run when no rank's heartbeat (logs/heartbeat_rank<r>.json) has changed for
    `timeout` seconds since this launch began, heartbeats or not, and says which rank stopped
    answering. It ends this process's own ranks (rank_pids), never a PID read from a file."""

    def __init__(self, logs: Path, nproc: int, timeout: float, backend: str = "gloo"):
        super().__init__(daemon=True, name="zerolens-hang-watchdog")
        self.logs, self.nproc, self.timeout, self.backend = logs, nproc, timeout, backend
        self.stop = threading.Event()
        self.verdict: str | None = None
        self.firing = threading.Event()  # set once the timeout has passed and the diagnosis began
        self.started = time.time()
        self.last_read: dict[int, dict] = {}  # each rank's last heartbeat read whole

    def heartbeats(self) -> dict[int, dict]:
        """This launch's heartbeats (an earlier launch's, in the same run folder, are older than it).
        A heartbeat read while its rank rewrites it (train.Heartbeat: in place) may not parse: the one
        read before stands."""
        for rank in range(self.nproc):
            beat = read_heartbeat(self.logs, rank)
            if beat is not None and beat["time"] >= self.started:
                self.last_read[rank] = beat
        return dict(self.last_read)

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
                signal_ranks(signal.SIGKILL)
                return

    def diagnose(self, beats: dict[int, dict]) -> str:
        signal_ranks(signal.SIGUSR1)  # each rank dumps its Python stack (faulthandler, worker.py)
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
