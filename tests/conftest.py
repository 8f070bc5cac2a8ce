import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.device_count() >= 2:
        return
    skip = pytest.mark.skip(reason="needs 2 CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
def unpredicted_strategy(monkeypatch) -> str:
    """The name of a strategy without a step model, registered for one test: DDP under another name
    (every strategy zerolens registers has a step model)."""
    import dataclasses

    from zerolens.strategies import registry
    spec = dataclasses.replace(registry.spec("ddp"), name="ddp-unpredicted", step_model=None)
    monkeypatch.setitem(registry._REGISTRY, spec.name, spec)
    return spec.name
