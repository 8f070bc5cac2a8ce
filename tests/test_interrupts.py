"""Ctrl-C (SIGINT) and SIGTERM sent to a real `zerolens` process: one line, exit 130 or 143, every rank
and pool process ended, and a run folder that says what finished."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def start(*args: str, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "zerolens", *args], stdout=subprocess.PIPE,
                            stderr=open(out, "w"), text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def wait_for(condition, what: str, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            pytest.fail(f"zerolens ended (exit {process.returncode}) before {what}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"no {what} within {timeout} s")
        time.sleep(0.2)


def descendants(pid: int) -> list[int]:
    """The processes `pid` started, directly or not, from /proc (the ranks lead sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, []))
    return found


def running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def interrupt(process: subprocess.Popen, sig: int) -> tuple[int, list[int], float]:
    """`sig` to the zerolens process alone (a terminal's Ctrl-C reaches its whole process group, the
    ranks excepted: they lead sessions of their own); its exit code, what it had started, and how long
    it took to end."""
    started = descendants(process.pid)
    assert started, "zerolens had started no process"
    sent = time.monotonic()
    process.send_signal(sig)
    try:
        process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail("zerolens did not end within 30 s of the signal")
    return process.returncode, started, time.monotonic() - sent


def assert_all_ended(pids: list[int]) -> None:
    # A killed process's parent may take a moment to reap it; on a saturated machine (a suite run with
    # more workers than cores) the fork server and resource tracker were seen to end after 5 s.
    deadline = time.monotonic() + 30
    while [p for p in pids if running(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if running(p)], "processes left running after zerolens ended"


def heartbeat(out: Path) -> str:
    try:
        return json.loads((out / "logs" / "heartbeat_rank0.json").read_text())["where"]
    except (OSError, ValueError, KeyError):
        return ""


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads processes from /proc")
@pytest.mark.parametrize("sig, code, after_first", [(signal.SIGINT, 130, True), (signal.SIGTERM, 143, False)])
def test_an_interrupted_verify_ends_every_rank_and_says_what_finished(tmp_path, sig, code, after_first):
    out, stderr = tmp_path / "run", tmp_path / "stderr.txt"
    process = start("verify", "--strategies", "ddp,zero2", "--steps", "60" if after_first else "2000",
                    "--out", str(out), out=stderr)
    if after_first:  # ddp finished, zero2 training
        wait_for(lambda: (out / "results" / "ddp.json").exists() and "of zero2 at step" in heartbeat(out),
                 "zero2's training", process)
    else:
        wait_for(lambda: "of ddp at step" in heartbeat(out), "ddp's training", process)
    returncode, started, took = interrupt(process, sig)
    text = stderr.read_text()
    assert returncode == code, text
    assert text.splitlines()[-1] == f"zerolens: interrupted; {out / 'summary.json'} says what finished", text
    assert "Traceback" not in text and "[rank" not in text, text
    assert took < 15, took
    assert_all_ended(started)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "INTERRUPTED" and summary["interrupted_by"] == signal.Signals(sig).name
    assert summary["finished"] == (["ddp"] if after_first else [])
    assert summary["not_finished"] == (["zero2"] if after_first else ["ddp", "zero2"])


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads processes from /proc")
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupted_plan_ends_its_tracing_processes(tmp_path, sig, code):
    stderr = tmp_path / "stderr.txt"
    # A small grid, so that the depth search, whose trials share the tracing processes with it, soon runs
    process = start("plan", "--gpu-memory", "24GiB", "--preset", "gpt-tiny", "--nproc", "2", "--jobs", "2",
                    "--strategies", "ddp,zero2", "--micro-batches", "1", out=stderr)
    wait_for(lambda: "depth search" in stderr.read_text(), "depth search", process)
    returncode, started, took = interrupt(process, sig)
    text = stderr.read_text()
    assert returncode == code, text
    assert text.splitlines()[-1] == "zerolens: interrupted", text
    assert "Traceback" not in text, text
    assert took < 15, took
    assert_all_ended(started)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads processes from /proc")
def test_a_ctrl_c_to_the_whole_process_group_at_start_up_is_one_line(tmp_path):
    """A terminal's Ctrl-C reaches every process of the command's group: the fork server, importing torch
    for the ranks at start-up, printed a KeyboardInterrupt's traceback beside zerolens's one line."""
    out, stderr = tmp_path / "run", tmp_path / "stderr.txt"
    process = subprocess.Popen([sys.executable, "-m", "zerolens", "verify", "--strategies", "ddp,zero2", "--out",
                                str(out)], stdout=subprocess.PIPE, stderr=open(stderr, "w"), text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)

    def fork_server_started() -> bool:
        for pid in descendants(process.pid):
            try:
                if b"forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return True
            except OSError:
                pass
        return False
    wait_for(fork_server_started, "the fork server", process)
    started = descendants(process.pid)
    os.killpg(process.pid, signal.SIGINT)  # its own session: the group is zerolens and what it started
    try:
        process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail("zerolens did not end within 30 s of the signal")
    text = stderr.read_text()
    assert process.returncode == 130, text
    assert text.splitlines()[-1].startswith("zerolens: interrupted"), text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert_all_ended(started)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads processes from /proc")
def test_a_killed_verify_leaves_no_rank_running(tmp_path):
    """SIGKILL (or the out-of-memory killer) gives zerolens no chance to stop its ranks: they end on
    their own when it does, and the fork server, which they held open, with them."""
    out, stderr = tmp_path / "run", tmp_path / "stderr.txt"
    process = start("verify", "--strategies", "ddp,zero2", "--steps", "2000", "--out", str(out), out=stderr)
    wait_for(lambda: "of ddp at step" in heartbeat(out), "ddp's training", process)
    started = descendants(process.pid)
    assert started, "zerolens had started no process"
    process.kill()
    process.wait()
    assert_all_ended(started)
