"""User mistakes end with one line on stderr and exit code 2, before any worker starts."""
import sys

import pytest

from conftest import run, zerolens


@pytest.mark.parametrize("args, message", [
    (["--strategies", "zero2,zero4"], "unknown strategy 'zero4'"),
    (["--nproc", "0"], "--nproc must be at least 1"),
    (["--nproc", "3", "--global-batch", "16"], "--global-batch 16 is not divisible by 3"),
    (["--device", "cuda", "--nproc", "2"], "needs 2 GPUs"),
    (["--device", "cpu", "--precision", "fp16"], "fp16 is not supported on CPU"),
    (["--baseline", "ddp"], "--baseline ddp is not among --strategies"),
    (["--steps", "x"], "invalid int value"),
])
def test_user_error_is_one_line_and_exit_2(args, message, tmp_path):
    if "--device" in args and "cuda" in args:
        import torch
        if torch.cuda.device_count() >= 2:
            pytest.skip("this machine has the GPUs")
    result = zerolens("verify", *args, "--out", str(tmp_path / "run"), timeout=60)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_deepspeed_not_installed(tmp_path):
    # A None entry in sys.modules is how Python marks a module as unavailable: import fails.
    code = ("import sys; sys.modules['deepspeed'] = None; from zerolens.cli import main; "
            f"sys.exit(main(['verify', '--out', {str(tmp_path / 'run')!r}]))")
    result = run([sys.executable, "-c", code], timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == "zerolens: DeepSpeed is not installed: pip install deepspeed (or use --strategies ddp,fsdp2-grad,fsdp2)"


def test_fsdp2_needs_no_deepspeed(monkeypatch):
    import argparse
    from zerolens.config import add_verify_arguments, config_from_args
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if it were not installed
    parser = argparse.ArgumentParser()
    add_verify_arguments(parser)
    config = config_from_args(parser.parse_args(["--strategies", "ddp,fsdp2-grad,fsdp2"]), gpus_visible=0)
    assert config.strategies == ("ddp", "fsdp2-grad", "fsdp2") and config.baseline == "ddp"


def test_ddp_alone_needs_no_deepspeed(tmp_path):
    code = ("import sys; sys.modules['deepspeed'] = None; from zerolens.cli import main; "
            f"sys.exit(main(['verify', '--strategies', 'ddp', '--steps', '40', '--out', {str(tmp_path / 'run')!r}]))")
    result = run([sys.executable, "-c", code], timeout=200)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Verdict: PASS" in result.stdout


def test_unwritable_run_folder(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = zerolens("verify", "--out", str(blocker / "run"), timeout=60)
    assert result.returncode == 2 and "cannot create run folder" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_bad_timeout_and_fault_variable(tmp_path):
    result = zerolens("verify", "--timeout", "0", "--out", str(tmp_path / "run"), timeout=60)
    assert result.returncode == 2 and "--timeout must be positive" in result.stderr
    assert not (tmp_path / "run").exists()
