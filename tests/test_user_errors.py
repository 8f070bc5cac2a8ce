"""User mistakes end with one line on stderr and exit code 2, before any worker starts."""
import sys

import pytest
from conftest import run, zerolens

from zerolens.cli import main


@pytest.mark.parametrize("args, message", [
    (["--strategies", "zero2,zero4"], "unknown strategy 'zero4'"),
    (["--strategies", "ddp,,zero2"], "has an empty name between its commas"),
    (["--nproc", "0"], "--nproc must be at least 1"),
    (["--nproc", "3", "--global-batch", "16"], "--global-batch 16 is not divisible by 3"),
    (["--device", "cuda", "--nproc", "2"], "needs 2 GPUs"),
    (["--device", "cpu", "--precision", "fp16"], "fp16 is not supported on CPU"),
    (["--baseline", "ddp"], "--baseline ddp is not among --strategies"),
    (["--steps", "x"], "invalid int value"),
    (["--batch", "nosuch:fn"], "--batch goes with --model"),  # the case study would have run, and PASSed
])
def test_user_error_is_one_line_and_exit_2(args, message, tmp_path, capsys):
    """In-process: nothing is launched for these."""
    if "--device" in args and "cuda" in args:
        import torch
        if torch.cuda.device_count() >= 2:
            pytest.skip("this machine has the GPUs")
    try:
        code = main(["verify", *args, "--out", str(tmp_path / "run")])
    except SystemExit as e:  # argparse's own errors end the process, as on the command line
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_a_user_error_in_a_real_process_is_exactly_one_line(tmp_path):
    """The same through the command itself: no warning of an imported library adds a line."""
    result = zerolens("verify", "--strategies", "zero2,zero4", "--out", str(tmp_path / "run"), timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == ["zerolens: unknown strategy 'zero4'; choose from "
                                                  "ddp, zero0, zero1, zero2, zero3, fsdp2-grad, fsdp2"]
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

    from zerolens.run.flags import add_verify_arguments, config_from_args
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if it were not installed
    parser = argparse.ArgumentParser()
    add_verify_arguments(parser)
    config = config_from_args(parser.parse_args(["--strategies", "ddp,fsdp2-grad,fsdp2"]), gpus_visible=0)
    assert config.strategies == ("ddp", "fsdp2-grad", "fsdp2") and config.baseline == "ddp"


@pytest.mark.slow
def test_ddp_alone_needs_no_deepspeed(tmp_path):
    code = ("import sys; sys.modules['deepspeed'] = None; from zerolens.cli import main; "
            f"sys.exit(main(['verify', '--strategies', 'ddp', '--steps', '40', '--out', {str(tmp_path / 'run')!r}]))")
    result = run([sys.executable, "-c", code], timeout=200)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Verdict: PASS" in result.stdout


def test_unwritable_run_folder(cli, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = cli("verify", "--out", str(blocker / "run"))
    assert result.returncode == 2 and "cannot create run folder" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_bad_timeout_and_fault_variable(cli, tmp_path):
    result = cli("verify", "--timeout", "0", "--out", str(tmp_path / "run"))
    assert result.returncode == 2 and "--timeout must be positive" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv, message", [
    (["verify", "--reduce-bucket-size", "0"], "--reduce-bucket-size must be from 1 to 2^61 elements"),
    (["verify", "--reduce-bucket-size", "-5"], "--reduce-bucket-size must be from 1 to 2^61 elements"),
    (["verify", "--reduce-bucket-size", "1e20"], "--reduce-bucket-size must be from 1 to 2^61 elements (bytes are "
                                                 "64-bit counts), got 1e+20"),
    (["plan", "--gpu-memory", "8GiB", "--reduce-bucket-sizes", "5e7,1e20"], "--reduce-bucket-sizes must be from 1 to 2^61"),
    (["verify", "--strategies", "zero0,zero2", "--ds-override", '{"zero_optimization": {"reduce_bucket_sise": 5}}'],
     "zero0: DeepSpeed rejects its config: reduce_bucket_sise: Extra inputs are not permitted"),
    (["verify", "--strategies", "zero2", "--ds-override", '{"zero_optimization": {"overlap_comm": "maybe"}}'],
     "zero2: DeepSpeed rejects its config: overlap_comm: Input should be a valid boolean"),
    (["sweep", "--nproc", "3"], "sweep takes its world sizes from --nproc-list, not --nproc"),
    (["estimate", "--params", "inf"], "--params must be a positive, finite parameter count, got inf"),
    (["estimate", "--params", "nan"], "--params must be a positive, finite parameter count, got nan"),
    (["estimate", "--reduce-bucket-size", "0"], "--reduce-bucket-size must be from 1 to 2^61 elements"),
    (["estimate", "--reduce-bucket-size", "1e20"], "--reduce-bucket-size must be from 1 to 2^61 elements"),
    (["verify", "--reduce-bucket-size", "inf"], "--reduce-bucket-size must be a number of elements, got inf"),
    (["sweep", "--reduce-bucket-sizes", "1e6,inf"], "--reduce-bucket-sizes takes finite numbers"),
    (["sweep", "--reduce-bucket-size", "inf"], "--reduce-bucket-size takes finite numbers"),
    (["verify", "--global-batch", "0"], "--global-batch must be at least 1, got 0"),
    (["verify", "--grad-accum", "0"], "--grad-accum must be at least 1, got 0"),
    (["bench", "--global-batch", "20", "--grad-accum", "4"],
     "--global-batch 20 is not divisible by 2 processes x 4 accumulated micro-batches"),
    (["bench", "--steps", "0"], "--steps (timed steps) must be at least 1, got 0"),
    (["plan", "--gpu-memory", "2GiB", "--batch", "nosuch:fn"], "--batch goes with --model"),
    (["bench", "--preset", "gpt-tiny", "--batch", "nosuch:fn"], "--batch goes with --model"),
])
def test_every_setting_is_checked_before_any_worker_starts(argv, message, tmp_path, capsys):
    """In-process: these end before anything is launched or written."""
    out = [] if argv[0] == "estimate" else ["--out", str(tmp_path / "run")]
    assert main([*argv, *out]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("package, version, strategies", [
    ("deepspeed", "0.15.4", "zero0,zero2"), ("deepspeed", "0.20.0", "zero2"), ("torch", "2.10.0", "ddp"),
    ("torch", "2.14.0", "ddp,fsdp2")])
def test_a_release_whose_layout_zerolens_does_not_know_is_refused(package, version, strategies, monkeypatch,
                                                                  tmp_path, capsys):
    import torch

    import zerolens.compat
    real = zerolens.compat.installed_version
    monkeypatch.setattr(zerolens.compat, "installed_version", lambda p: version if p == package else real(p))
    if package == "torch":
        monkeypatch.setattr(torch, "__version__", version)
    assert main(["verify", "--strategies", strategies, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    low, high = zerolens.compat.SUPPORTED[package]
    assert err.startswith(f"zerolens: {package} {version} is not supported")
    assert f"{package}>={low[0]}.{low[1]},<{high[0]}.{high[1]}" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_the_installed_releases_are_supported_and_say_nothing(tmp_path, capsys):
    import zerolens.compat
    zerolens.compat.check_supported("torch")
    zerolens.compat.check_supported("deepspeed")
    assert capsys.readouterr() == ("", "")


def test_supported_ranges_match_pyproject():
    import re

    from conftest import REPO

    import zerolens.compat
    text = (REPO / "pyproject.toml").read_text()
    for package in ("torch", "deepspeed"):
        assert re.search(rf'"{re.escape(zerolens.compat.supported_range(package))}"', text), package
