import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def pytest_sessionstart(session):
    """DeepSpeed builds its CPU communication op (deepspeed_shm_comm) the first time a CPU rank starts,
    into torch's extension cache: built here once, before the test workers start ranks, so that no
    test waits for the build (about 30 s on 2 cores) or races another for it."""
    if hasattr(session.config, "workerinput") or importlib.util.find_spec("deepspeed") is None:
        return  # an xdist worker: the controller built it
    from torch.utils import cpp_extension
    build_directory = getattr(cpp_extension, "_get_build_directory", None)  # private: where torch caches it
    if build_directory and any(Path(build_directory("deepspeed_shm_comm", False)).glob("*.so")):
        return
    run([sys.executable, "-c", "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; "
                               "ShareMemCommBuilder().load()"], timeout=600, env={"DS_ACCELERATOR": "cpu"})


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu(n)`: the test needs n CUDA GPUs (2 where n is not given), skipped with fewer."""
    available = torch.cuda.device_count()
    for item in items:
        marker = item.get_closest_marker("gpu")
        needed = (marker.args or (2,))[0] if marker else 0
        if needed > available:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA GPU{'s' if needed > 1 else ''}"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def remove_deepspeed_shared_memory(port: int) -> None:
    """What DeepSpeed's CPU collective op leaves behind for the ranks that met on `port`: a 66 MiB
    shared-memory buffer per rank (RAM) that it never unlinks. zerolens's own ranks unlink theirs
    (run.worker.unlink_shared_memory_name); ranks that tests start otherwise do not."""
    for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*"):
        path.unlink(missing_ok=True)


def run(cmd: list[str], *, timeout: float, cwd=None, env=None) -> subprocess.CompletedProcess:
    """A subprocess with a timeout; a hang fails the test instead of stalling the suite."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=full_env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"timed out after {timeout} s: {' '.join(cmd)}\nstdout:\n{e.stdout}\nstderr:\n{e.stderr}")


def zerolens(*args: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "zerolens", *args], timeout=timeout, **kw)


@pytest.fixture
def cli(capsys, monkeypatch):
    """`zerolens ARGS` run in this process, as `zerolens(...)` runs it in a new one: its exit code and
    output. For what ends before any worker starts (a user error, estimate, plan without --check),
    where a new process would only add its start-up. `env` is set for the call, `cwd` is entered."""
    from zerolens.cli import main

    def call(*args: str, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        if cwd is not None:
            monkeypatch.chdir(cwd)
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's --help and its errors end the process
            code = e.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["zerolens", *args], code, out, err)
    return call


@pytest.fixture
def unpredicted_strategy(monkeypatch) -> str:
    """The name of a strategy without a step model, registered for one test: DDP under another name
    (every strategy zerolens registers has a step model)."""
    import dataclasses

    from zerolens.strategies import registry
    spec = dataclasses.replace(registry.spec("ddp"), name="ddp-unpredicted", step_model=None)
    monkeypatch.setitem(registry._REGISTRY, spec.name, spec)
    return spec.name
