"""Processes that trace in parallel, for the commands that predict many traces (plan, estimate): a pool
of processes forked from this one where that is safe (else fresh interpreters), ended at once when the
command is interrupted."""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
from concurrent.futures import Future, ProcessPoolExecutor


class Pool(ProcessPoolExecutor):
    """A process pool whose `with`, left by an exception (an interrupt among the traces), ends its workers
    at once (end_pool): no trace may outlive the command. Left normally, it waits for them as any does."""

    def __exit__(self, exc_type, exc, traceback):
        if exc_type is None:
            return super().__exit__(exc_type, exc, traceback)
        end_pool(self)
        return False


def pool(jobs: int) -> Pool:
    return Pool(max_workers=jobs, mp_context=multiprocessing.get_context(start_method()), initializer=start_worker)


def start_method() -> str:
    """How the pool's workers start: "fork" where no thread of Python's but this one runs and CUDA is not
    initialised (a forked child inherits no thread and no usable CUDA context), so that they begin with
    torch, transformers and zerolens imported as this process has them: spawned, the Llama-2-70B
    estimate's two workers spent about 4.3 CPU-s each and 5.5-6.3 s of wall time before they could trace;
    forked, 0.1 s (docs/results/cpu-2proc/issue22/forked-workers/). Else "spawn", a fresh interpreter
    for each worker. The native thread pools that importing torch starts (OpenMP's, OpenBLAS's) are
    remade in a forked child by their own fork handlers, as for torch's DataLoader workers, which fork
    from such processes by default."""
    if sys.platform != "linux" or threading.active_count() != 1:
        return "spawn"
    torch = sys.modules.get("torch")
    return "spawn" if torch is not None and torch.cuda.is_initialized() else "fork"


def start_worker() -> None:
    """A pool worker ignores Ctrl-C, which a terminal sends to every process of the command's group: the
    `zerolens` process takes it and ends the workers (end_pool), without a traceback from each. Its
    traces keep the heap frozen (predict.peak.keep_heap_frozen): the process is zerolens's."""
    from zerolens.predict.peak import keep_heap_frozen
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    keep_heap_frozen()


def end_pool(executor) -> None:
    """The pool's workers killed, their traces unfinished: the command was interrupted (SIGINT or SIGTERM), and
    a shutdown that waited would wait for every trace under way, minutes on a large model. Their
    futures then fail, so that plan's depth searches' threads end too."""
    kill = getattr(executor, "kill_workers", None)  # Python 3.14
    if kill is not None:
        kill()
    else:  # before 3.14 the executor keeps its processes in _processes, and has no public way to end them
        for process in list((getattr(executor, "_processes", None) or {}).values()):
            with contextlib.suppress(OSError):
                process.kill()
    executor.shutdown(wait=False, cancel_futures=True)
    # The executor's manager thread closes its wake-up pipe as it ends, with no lock against the exit hook
    # (concurrent.futures.process._python_exit) writing to it: an interrupted plan now and then ended
    # "OSError: [Errno 9] Bad file descriptor" after its last line. The workers are dead; it ends at once.
    manager = getattr(executor, "_executor_manager_thread", None)
    if manager is not None:
        manager.join(timeout=5)


class InProcess:
    """An executor that runs each call at once, in this process (jobs=1)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, *args):
        future = Future()
        future.set_result(fn(*args))
        return future


def default_jobs() -> int:
    """Tracing processes: one per core, at most 4 (each holds a torch of a few hundred MiB)."""
    return max(1, min(4, os.cpu_count() or 1))


