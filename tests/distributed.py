"""Run a function on `world_size` CPU processes (gloo), with a timeout on the whole spawn.

Each rank's return value comes back in rank order; an exception or a hang on any rank fails
the test and ends every rank.
"""
from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port, remove_deepspeed_shared_memory


def _entry(fn, rank, world_size, port, folder, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu",
                      OMP_NUM_THREADS="1")
    faulthandler.enable()  # a C++ abort on one rank still shows where Python was
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        Path(folder, f"{rank}.pkl").write_bytes(pickle.dumps(result))
        dist.destroy_process_group()
        Path(folder, f"{rank}.done").write_text("")
        os._exit(0)  # as zerolens.run.worker does: skip an interpreter teardown that has aborted here
    except BaseException:
        Path(folder, f"{rank}.err").write_text(traceback.format_exc())
        raise


def spawn(fn, *args, world_size: int = 2, timeout: float = 240) -> list:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as folder:
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, free_port_once(folder), folder, args))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while any(p.is_alive() for p in procs):
                if time.monotonic() > deadline:
                    pytest.fail(f"{fn.__name__} timed out after {timeout} s on {world_size} ranks")
                if any(p.exitcode not in (None, 0) for p in procs):
                    # One rank failed: give the others a moment to finish what they were writing,
                    # then stop them rather than wait for their timeouts.
                    deadline = min(deadline, time.monotonic() + 5)
                    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
                        time.sleep(0.2)
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
            remove_deepspeed_shared_memory(free_port_once(folder))
        finished = [Path(folder, f"{r}.pkl").exists() for r in range(world_size)]
        torn_down = [Path(folder, f"{r}.done").exists() for r in range(world_size)]
        errors = [Path(folder, f"{r}.err") for r in range(world_size)]
        failed = [f"rank {r}:\n{e.read_text()}" for r, e in enumerate(errors) if e.exists()]
        if not failed and all(finished) and any(p.exitcode == -signal.SIGABRT for p in procs):
            # Every rank returned its result; one then aborted while tearing the process group down
            # ("terminate called without an active exception" from a C++ thread, seen about once
            # in 15 spawns here). Not what the test checks, so say it loudly and go on.
            warnings.warn(f"{fn.__name__}: a rank aborted after returning its result "
                          f"(exit codes {[p.exitcode for p in procs]}, process group destroyed {torn_down})")
        elif failed or any(p.exitcode != 0 for p in procs):
            pytest.fail(f"{fn.__name__} failed:\n" + "\n".join(failed or [
                f"exit codes {[p.exitcode for p in procs]}, results written {finished}, "
                f"process group destroyed {torn_down}"]))
        return [pickle.loads(Path(folder, f"{r}.pkl").read_bytes()) for r in range(world_size)]


def free_port_once(folder: str) -> int:
    """One port per spawn, shared by all ranks."""
    path = Path(folder, "port")
    if not path.exists():
        path.write_text(str(free_port()))
    return int(path.read_text())
