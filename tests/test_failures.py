"""How a run fails, on 2 CPU processes: a crash or an out-of-memory error on one rank (injected
through ZEROLENS_FAULT) ends every rank, names the rank and phase, keeps that rank's log and
marks the summary FAIL; run folders are never overwritten unless asked; the same seed gives the
same losses."""
import json
import time

import pytest
from conftest import REPO, zerolens


def said(result) -> str:
    """What a run said on stderr, its words as one line: the terminal wraps at 100 columns."""
    return " ".join(result.stderr.split())


@pytest.mark.slow
def test_a_crash_on_one_rank_ends_the_run_and_says_where(tmp_path):
    out = tmp_path / "crash"
    start = time.monotonic()
    result = zerolens("verify", "--steps", "6", "--out", str(out), timeout=240,
                      env={"ZEROLENS_FAULT": "rank=1,step=2,phase=backward,kind=crash"})
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stdout + result.stderr
    assert "rank 1 failed during backward of zero0 at step 2: RuntimeError: injected crash" in said(result)
    assert "Traceback" not in result.stderr
    assert max(len(line) for line in result.stderr.splitlines()) <= 100, result.stderr  # a line per rank, wrapped
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "FAIL" and "rank 1" in summary["failure"]
    assert "injected crash" in (out / "logs" / "rank1.log").read_text()
    assert json.loads((out / "env.json").read_text())["zerolens_fault"].startswith("rank=1")
    assert elapsed < 60  # start-up included; the ranks do not wait out a collective's timeout


@pytest.mark.slow
def test_out_of_memory_is_reported_with_a_suggestion(tmp_path):
    result = zerolens("verify", "--steps", "6", "--out", str(tmp_path / "oom"), timeout=240,
                      env={"ZEROLENS_FAULT": "rank=0,step=1,phase=step,kind=oom"})
    assert result.returncode == 1
    assert ("rank 0 ran out of GPU memory during step of zero0 at step 1 (tried to allocate 2.00 GiB): "
            "try a smaller --micro-batch") in said(result)


def test_a_malformed_fault_is_a_user_error(cli, tmp_path):
    result = cli("verify", "--out", str(tmp_path / "x"), env={"ZEROLENS_FAULT": "rank=one"})
    assert result.returncode == 2 and "ZEROLENS_FAULT must look like" in result.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_same_seed_same_losses_and_no_overwrite(tmp_path, cli):
    runs = []
    for name in ("a", "b"):
        result = zerolens("verify", "--strategies", "zero2", "--steps", "4", "--seed", "3",
                          "--out", str(tmp_path / name), timeout=240)
        assert result.returncode == 0, result.stdout + result.stderr  # 4 steps: "loss fell" is not checked
        runs.append(json.loads((tmp_path / name / "summary.json").read_text()))
    assert runs[0]["strategies"]["zero2"]["losses"] == runs[1]["strategies"]["zero2"]["losses"]
    # An existing run folder is kept unless --overwrite says otherwise.
    again = cli("verify", "--steps", "4", "--out", str(tmp_path / "a"))
    assert again.returncode == 2 and "--overwrite" in again.stderr
    assert json.loads((tmp_path / "a" / "summary.json").read_text()) == runs[0]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not a run")
    refused = cli("verify", "--overwrite", "--out", str(tmp_path / "mine"))
    assert refused.returncode == 2 and "was not created by zerolens" in refused.stderr
    assert (tmp_path / "mine" / "notes.txt").exists()


@pytest.mark.slow
def test_a_hang_on_one_rank_is_ended_by_the_timeout_and_named(tmp_path):
    out = tmp_path / "hang"
    start = time.monotonic()
    result = zerolens("verify", "--steps", "6", "--timeout", "10", "--out", str(out), timeout=240,
                      env={"ZEROLENS_FAULT": "rank=1,step=2,phase=backward,kind=hang"})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "rank 1 during backward of zero0 at step 2 stopped answering" in said(result), result.stderr
    assert "rank 0 during" in said(result) and "was waiting for it" in said(result)
    assert json.loads((out / "summary.json").read_text())["verdict"] == "FAIL"
    assert "faults.py" in (out / "logs" / "stack_rank1.txt").read_text()
    assert time.monotonic() - start < 120


@pytest.mark.slow
def test_a_failed_bench_is_marked_too(tmp_path):
    out = tmp_path / "bench"
    result = zerolens("bench", "--preset", "gpt-tiny", "--warmup", "1", "--steps", "2", "--out", str(out), timeout=240,
                      env={"ZEROLENS_FAULT": "rank=0,step=1,phase=forward,kind=crash"})
    assert result.returncode == 1 and "rank 0 failed during forward of ddp at step 1" in said(result)
    assert json.loads((out / "summary.json").read_text())["verdict"] == "FAIL"
    assert not (out / "bench.json").exists()


@pytest.mark.slow
def test_a_hang_before_the_process_group_exists_is_ended_too(tmp_path):
    """Rank 1 hangs before init_process_group: rank 0 waits in the rendezvous. Nothing has trained;
    the watchdog still ends both, from its own children rather than from heartbeat files."""
    out = tmp_path / "hang-init"
    start = time.monotonic()
    result = zerolens("verify", "--steps", "6", "--timeout", "10", "--out", str(out), timeout=240,
                      env={"ZEROLENS_FAULT": "rank=1,phase=init,kind=hang"})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "rank 1 during init stopped answering; rank 0 during init was waiting for it" in said(result), \
        result.stderr
    assert time.monotonic() - start < 120


@pytest.mark.slow
def test_the_watchdog_ends_its_own_children_without_any_heartbeat(tmp_path):
    """A worker that never wrote a heartbeat (hung while starting) is ended all the same: the
    watchdog signals the processes it started, not PIDs read from files."""
    import subprocess
    import sys

    from zerolens.run.launch import HangWatchdog, rank_pids
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        assert child.pid in rank_pids()
        watchdog = HangWatchdog(tmp_path, nproc=2, timeout=1)
        watchdog.start()
        assert child.wait(timeout=30) != 0  # killed
        watchdog.join(timeout=10)
        assert "rank 0 before its first heartbeat" in watchdog.verdict
        assert "rank 1 before its first heartbeat" in watchdog.verdict
    finally:
        if child.poll() is None:
            child.kill()


@pytest.mark.slow
def test_a_rank_killed_without_a_python_error_is_named_first(tmp_path):
    """A rank the kernel's out-of-memory killer ends (SIGKILL) writes no log; the other then fails on its
    closed connection. The killed rank is the cause, named first, with where it was."""
    out = tmp_path / "killed"
    result = zerolens("verify", "--steps", "6", "--strategies", "ddp,zero2", "--out", str(out), timeout=240,
                      env={"ZEROLENS_FAULT": "rank=1,step=2,phase=forward,kind=kill"})
    assert result.returncode == 1, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failure"].startswith("rank 1 ended during forward of ddp at step 2 without a Python error"), \
        summary["failure"]
    # (rank 0 then fails on the closed connection, or the launcher stops it first: named after, or not at all)
    assert "rank 1 ended during forward of ddp at step 2" in said(result)


def test_the_rank_that_vanished_first_is_the_cause_and_those_stopped_after_are_not_named(tmp_path):
    """failure_lines from what the ranks left: rank 1 ended first with no log (killed), rank 0 then logged
    its error and ended, rank 2 was stopped by the launcher after that (no log either): not a cause."""
    from types import SimpleNamespace

    from zerolens.run.launch import failure_lines
    since = time.time() - 10
    (tmp_path / "rank0.log").write_text("rank 0 failed during backward of ddp at step 2: RuntimeError: closed\n\n...")
    for rank in (1, 2):
        (tmp_path / f"heartbeat_rank{rank}.json").write_text(json.dumps(
            {"where": f"forward of ddp at step {rank}", "time": since + 1, "pid": 1}))
    now = time.time()
    ended = {1: now - 2, 0: now - 1, 2: now - 0.5}
    failures = {0: SimpleNamespace(message={"message": "RankFailure: rank 0 failed during backward"}, exitcode=1)}
    lines = failure_lines(failures, tmp_path, since, ended)
    assert lines == ["rank 1 ended during forward of ddp at step 1 without a Python error: killed by a signal (the "
                     "kernel's out-of-memory killer?) or a hard exit",
                     "rank 0 failed during backward of ddp at step 2: RuntimeError: closed"]
    # The launcher's own words for a rank it saw killed: the signal named
    killed = {1: SimpleNamespace(message="Signal 9 (SIGKILL) received by PID 7", exitcode=-9)}
    assert failure_lines(killed, tmp_path, since)[0] == (
        "rank 1 ended during forward of ddp at step 1 without a Python error: killed by SIGKILL (the kernel's "
        "out-of-memory killer?)")


def test_a_rank_in_autograds_engine_is_waiting_and_one_in_its_own_forward_is_stuck(tmp_path):
    """DDP's all-reduce runs and is waited for inside autograd's engine (C++): a rank whose innermost Python
    frame is the engine's waits for the others; one sleeping in its model's forward is the one stuck."""
    from zerolens.run.launch import HangWatchdog
    site = "/usr/lib/python3/site-packages/torch"
    (tmp_path / "stack_rank0.txt").write_text(
        f'Stack (most recent call first):\n  File "{site}/autograd/graph.py", line 979 in _engine_run_backward\n'
        f'  File "{site}/_tensor.py", line 623 in backward\n')
    (tmp_path / "stack_rank1.txt").write_text(
        'Stack (most recent call first):\n  File "/home/me/model.py", line 12 in forward\n'
        f'  File "{site}/nn/modules/module.py", line 1784 in _call_impl\n')
    watchdog = HangWatchdog(tmp_path, 2, timeout=1)
    assert watchdog.waiting(0) and not watchdog.waiting(1)


@pytest.mark.slow
def test_a_batch_function_that_fails_is_named_as_the_phase(tmp_path):
    result = zerolens("verify", "--model", "zerolens_test_models:tiny_classifier", "--batch",
                      "zerolens_test_models:batch_failing_at_step_3", "--strategies", "ddp", "--steps", "6",
                      "--out", str(tmp_path / "run"), timeout=240, env={"PYTHONPATH": str(REPO / "tests")})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "failed during making the batch of ddp at step 3: OSError: data shard 3 missing" in said(result)
