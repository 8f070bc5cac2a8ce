"""`zerolens verify` end to end through the CLI, on 2 CPU processes (gloo)."""
import json
import time
from pathlib import Path

import pytest
from conftest import zerolens

from zerolens.models.model import ModelConfig, build_model
from zerolens.report.checks import LOSS_MATCH_TOLERANCE
from zerolens.strategies import registry
from zerolens.strategies.layout import zero_partition_layout


@pytest.fixture(scope="module")
def verify_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "verify"
    shared_before = deepspeed_shared_memory()
    result = zerolens("verify", "--out", str(out), timeout=400)
    return result, out, shared_before


def deepspeed_shared_memory() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")}


@pytest.mark.slow
@pytest.mark.xdist_group("verify_run")
def test_default_verify_passes_and_prints_one_table(verify_run):
    result, out, _ = verify_run
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Verdict: PASS" in result.stdout
    assert result.stdout.count("Memory per rank") == 1  # rank 0 alone prints
    # A terminal worth reading: the full report is in report.md, the terminal gets what matters.
    lines = result.stdout.splitlines()
    assert len(lines) <= 30 and max(len(line) for line in lines) <= 100, result.stdout
    assert "bf16 is used instead of the case study's fp16" in result.stdout  # precision change is said
    assert "[INFO]" not in result.stdout + result.stderr  # DeepSpeed's logging stays hidden


@pytest.mark.slow
@pytest.mark.xdist_group("verify_run")
def test_run_folder_holds_config_metrics_report_and_summary(verify_run):
    _, out, _ = verify_run
    for name in ("config.json", "env.json", "metrics_rank0.jsonl", "metrics_rank1.jsonl", "report.md",
                 "summary.json", "memory.png", "loss.png"):
        assert (out / name).is_file(), name
    env = json.loads((out / "env.json").read_text())
    assert env["backend"] == "gloo" and env["world_size"] == 2 and env["torch"] and env["deepspeed"]
    assert env["command"].startswith("zerolens verify") and env["torch_threads"] >= 1
    assert {"zerolens_commit", "devices", "omp_num_threads", "python"} <= set(env)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "PASS" and summary["world_size"] == 2 and summary["device"] == "cpu"
    assert set(summary["strategies"]) == {"zero0", "zero2"}
    # Where the run's wall time went: every part noted by the process that spent it, each strategy's training.
    wall = summary["wall_time"]
    assert list(wall["parts_s"]) == ["imports", "checks", "prediction", "launch", "process_group", "training",
                                     "report", "plots"]
    assert all(seconds > 0 for seconds in wall["parts_s"].values()), wall
    assert set(wall["strategies_s"]) == {"zero0", "zero2"}
    assert sum(wall["strategies_s"].values()) == pytest.approx(wall["parts_s"]["training"])
    assert wall["counted_s"] == pytest.approx(sum(wall["parts_s"].values()))
    for check in summary["checks"]:
        assert {"name", "passed", "measured", "expected"} <= set(check)
    for rank in summary["strategies"]["zero2"]["ranks"]:
        assert {"rank", "grad_bytes_after_backward", "grad_bytes_after_step", "param_bytes",
                "optimizer_state_bytes", "peak_bytes"} <= set(rank)
        # On CPU the peak comes from a tensor-allocation tracker: at least what the rank keeps.
        assert rank["peak_bytes"] >= rank["param_bytes"] + rank["optimizer_state_bytes"]
    lines = (out / "metrics_rank1.jsonl").read_text().splitlines()
    assert len(lines) == 2 * summary["steps"]
    assert json.loads(lines[0])["rank"] == 1
    assert "Verdict: PASS" in (out / "report.md").read_text()
    # Each rank's heartbeat stays; its stack-dump file, empty when no hang was diagnosed, goes. The wall-time
    # log stays beside them.
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["heartbeat_rank0.json", "heartbeat_rank1.json",
                                                                "wall_time.jsonl"]
    # The process that made the folder listed, as it ended, all it holds: what --overwrite may delete
    from zerolens.run.folder import entries, marker_of
    assert marker_of(out)["made"] == sorted(entries(out))


@pytest.mark.slow
@pytest.mark.xdist_group("verify_run")
@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="POSIX shared memory is not under /dev/shm here")
def test_deepspeed_cpu_ranks_leave_no_shared_memory_behind(verify_run):
    """DeepSpeed's CPU collective op leaves a 66 MiB buffer per rank in /dev/shm (RAM) at every run
    unless the ranks unlink it: a test suite filled 21 GiB. Another test's ranks may hold theirs until
    that test ends (at most its 240 s timeout); a left-behind one stays."""
    result, _, before = verify_run
    assert result.returncode == 0, result.stdout + result.stderr
    deadline = time.monotonic() + 240
    while (left := deepspeed_shared_memory() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left


@pytest.mark.slow
@pytest.mark.xdist_group("verify_run")
def test_zero2_gradients_are_the_predicted_partition(verify_run):
    _, out, _ = verify_run
    summary = json.loads((out / "summary.json").read_text())
    numels = [p.numel() for p in build_model(ModelConfig(), 0).parameters()]
    layout = zero_partition_layout(numels, 2)
    base = summary["strategies"]["zero0"]["ranks"]
    for r, rank in enumerate(summary["strategies"]["zero2"]["ranks"]):
        assert rank["grad_partition_elements"] == layout[r].partition_elements
        assert abs(rank["grad_partition_elements"] / base[r]["grad_partition_elements"] - 0.5) < 1e-4
        assert rank["grad_bytes_after_backward"] == 2 * layout[r].held_grad_elements  # bf16


@pytest.mark.slow
@pytest.mark.xdist_group("verify_run")
def test_loss_falls_and_zero2_matches_the_baseline(verify_run):
    _, out, _ = verify_run
    summary = json.loads((out / "summary.json").read_text())
    base = summary["strategies"]["zero0"]["losses"]
    zero2 = summary["strategies"]["zero2"]["losses"]
    w = len(base) // 5
    for losses in (base, zero2):
        assert sum(losses[-w:]) / w < 0.95 * sum(losses[:w]) / w
    # The curves agree as moving means (what the check compares), computed here independently.
    means = [(sum(base[i:i + w]) / w, sum(zero2[i:i + w]) / w) for i in range(len(base) - w + 1)]
    assert max(abs(a - b) / b for b, a in means) <= LOSS_MATCH_TOLERANCE["bf16"]
    check = next(c for c in summary["checks"] if c["name"] == "loss matches baseline (zero2 vs zero0)")
    assert check["passed"] and check["measured"]["window_steps"] == w


@pytest.mark.slow
@pytest.mark.xdist_group("verify_run")
def test_existing_run_folder_is_not_overwritten(verify_run, cli):
    _, out, _ = verify_run
    result = cli("verify", "--out", str(out))
    assert result.returncode == 2
    assert "already exists" in result.stderr


@pytest.mark.slow
@pytest.mark.xdist_group("verify_run")
def test_a_ctrl_c_while_plotting_leaves_no_report_saying_pass(verify_run, tmp_path, monkeypatch):
    """Rank 0 writes summary.json, then report.md, after the plots: a Ctrl-C while plotting leaves
    neither, so the launcher's summary.json says INTERRUPTED with no report saying PASS beside it (the
    report was written before the plots, and stood beside an INTERRUPTED summary)."""
    import shutil

    from zerolens.run import worker
    from zerolens.run.config import load_config
    from zerolens.run.train import Phase
    _, out, _ = verify_run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    for name in ("summary.json", "report.md"):
        (copy / name).unlink()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("zerolens.report.plots.verify_plots", interrupted)
    with pytest.raises(KeyboardInterrupt):
        worker.finish_verify(load_config(str(copy / "config.json")), copy, "zerolens verify", Phase(), quiet=True)
    assert not (copy / "report.md").exists() and not (copy / "summary.json").exists()
    monkeypatch.undo()
    summary = worker.finish_verify(load_config(str(copy / "config.json")), copy, "zerolens verify", Phase(),
                                   quiet=True)
    assert json.loads((copy / "summary.json").read_text())["verdict"] == summary["verdict"] == "PASS"
    assert (copy / "report.md").read_text().startswith("# zerolens verify: PASS")


@pytest.mark.slow
def test_every_strategy_on_two_ranks(tmp_path):
    # bf16: DDP and DeepSpeed under autocast, FSDP2 with its MixedPrecisionPolicy; all within the
    # bf16 loss tolerance of the baseline, zero0, and every memory check passes. 15 steps keep
    # seven strategies quick (the CPU suite must stay well under 10 minutes); whether the loss
    # falls over 100 steps is the default verify's test. (At lr 1e-3 the bf16 losses part by 0.07.)
    out = tmp_path / "all"
    result = zerolens("verify", "--strategies", ",".join(registry.names()), "--steps", "15",
                      "--out", str(out), timeout=400)
    # 15 steps cannot tell whether the loss falls: that check is not made, and the verdict is PASS.
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert all(c["passed"] for c in summary["checks"]), [c["detail"] for c in summary["checks"] if not c["passed"]]
    assert [c["name"] for c in summary["not_checked"]] == ["loss fell"]
    assert list(summary["strategies"]) == ["ddp", "zero0", "zero1", "zero2", "zero3", "fsdp2-grad", "fsdp2"]
    names = [c["name"] for c in summary["checks"]]
    assert "gradient bytes held (zero1, rank 1)" in names and "every rank's metrics are complete and agree" in names
    assert "retained memory as predicted (fsdp2, rank 1)" in names
    assert "loss matches baseline (fsdp2-grad vs zero0)" in names
    # ZeRO-3's bucket gets the same advice as ZeRO-1/2's, and its parameter bytes are explained.
    assert any(n.startswith("zero3: reduce_bucket_size 5e+07 elements") and "kept for the whole run" in n
               for n in summary["notes"])
    assert any(n.startswith("zero3 holds") and "param_persistence_threshold" in n for n in summary["notes"])


@pytest.mark.slow
def test_worker_runs_unchanged_under_torchrun(tmp_path):
    import sys

    from conftest import run
    out = tmp_path / "torchrun"
    result = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                  "-m", "zerolens.worker", "--steps", "8", "--fail-exit-code", "0", "--out", str(out)], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    # 8 steps keep this quick: every check passes ("loss fell" wants 40 steps and is not made).
    assert all(c["passed"] for c in summary["checks"]), summary["checks"]
    assert result.stdout.count("Memory per rank") == 1
    # Under another launcher each rank predicted its share of the strategies in a process of its own
    prediction = [json.loads(line) for line in (out / "logs" / "wall_time.jsonl").read_text().splitlines()
                  if json.loads(line)["part"] == "prediction"]
    assert [p["shares"] for p in prediction] == [[["zero0"], ["zero2"]]]
    assert all("ranks" in p for p in json.loads((out / "predicted_peaks.json").read_text()).values())
    assert not list(out.glob("predicted_peaks.rank*"))


@pytest.mark.slow
@pytest.mark.xdist_group("verify_run")
def test_summary_carries_predictions_and_the_bucket_advice(verify_run):
    _, out, _ = verify_run
    summary = json.loads((out / "summary.json").read_text())
    for name, s in summary["strategies"].items():
        for rank in s["ranks"]:
            for key, predicted in rank["predicted"].items():
                assert rank[key] == predicted, (name, rank["rank"], key)
            assert rank["activation_bytes_after_forward"] > 0
    names = [c["name"] for c in summary["checks"]]
    assert "retained memory as predicted (zero2, rank 1)" in names
    # The case study's 5e7-element bucket is ~95 MiB against ~1 MiB of gradients: said, with a fix.
    advice = [n for n in summary["notes"] if n.startswith("zero2: reduce_bucket_size")]
    assert advice and "Try --reduce-bucket-size 2e+05" in advice[0]
    # ... and measured: the tracker sees the bucket in ZeRO-2's peak, beyond the baseline's.
    zero2_peak = summary["strategies"]["zero2"]["ranks"][0]["peak_bytes"]
    base_peak = summary["strategies"]["zero0"]["ranks"][0]["peak_bytes"]
    assert zero2_peak - base_peak > 0.5 * 50_000_000 * 2  # the bucket: 5e7 bf16 elements
    assert "so sharding costs memory here" in advice[0]


@pytest.mark.slow
def test_in_fp32_ddp_deepspeed_and_fsdp2_follow_the_same_trajectory(tmp_path):
    # Same data, weights, dropout stream, AdamW and gradient clipping (DeepSpeed's default 1.0):
    # in fp32 only the order of floating-point additions differs. For FSDP2 this checks that the
    # reduce-scatter averages and that the clipping norm of the sharded gradients is the global one.
    out = tmp_path / "fp32"
    result = zerolens("verify", "--precision", "fp32", "--strategies", "ddp,zero0,zero2,fsdp2-grad,fsdp2",
                      "--steps", "40", "--out", str(out), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    base = summary["strategies"]["zero0"]["losses"]
    for name in ("ddp", "zero2", "fsdp2-grad", "fsdp2"):
        assert max(abs(a - b) for a, b in zip(summary["strategies"][name]["losses"], base)) < 1e-4


def test_one_gpu_says_why_verify_runs_on_cpu_processes_and_how_to_use_the_gpu():
    import argparse

    from zerolens.run.flags import add_verify_arguments, config_from_args
    parser = argparse.ArgumentParser()
    add_verify_arguments(parser)

    def resolved(flags, gpus):
        return config_from_args(parser.parse_args(flags), gpus_visible=gpus, checked=True)
    one = resolved([], 1)
    assert (one.device, one.nproc) == ("cpu", 2)
    assert one.device_note.startswith("1 GPU visible: running on CPU processes (gloo), because without --device "
                                      "zerolens takes GPUs only when there are 2 or more")
    assert one.device_note.endswith("add --nproc 1 --device cuda")
    # Said only where zerolens chose: no GPU, two GPUs, or a device the user gave.
    assert resolved([], 0).device_note == resolved([], 2).device_note == resolved(["--device", "cpu"], 1).device_note == ""
    single = resolved(["--nproc", "1", "--device", "cuda"], 1)
    assert (single.device, single.nproc, single.device_note) == ("cuda", 1, "")


@pytest.mark.parametrize("flags, said", [
    (["--strategies", "zero0,zero2"], "CPU run: DeepSpeed has no fp16 on CPU, so bf16 is used instead of the case "
                                      "study's fp16"),
    (["--strategies", "ddp,fsdp2"], "CPU run: bf16 is used, where a GPU run of the case study trains in fp16"),
    (["--preset", "gpt-tiny"], None),  # a preset trained in bf16 on GPUs too: nothing changed, nothing said
    (["--model", "zerolens_test_models:tiny_classifier", "--batch", "zerolens_test_models:tiny_batch"], None),
])
def test_the_cpu_precision_note_is_said_where_a_gpu_run_would_differ_and_for_its_reason(flags, said):
    import argparse

    from zerolens.commands import verify
    from zerolens.run.flags import config_from_args
    parser = argparse.ArgumentParser()
    verify.add_parser(parser.add_subparsers())
    config = config_from_args(parser.parse_args(["verify", "--device", "cpu", *flags]), gpus_visible=0, checked=True)
    assert config.precision == "bf16"
    assert config.precision_note == (said or "")


def test_more_cpu_processes_than_cores_are_said(monkeypatch):
    """verify --nproc 6 on 2 cores runs, slowly: the header says why, before the wait."""
    import argparse

    from zerolens.commands import verify
    from zerolens.run.flags import config_from_args
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    parser = argparse.ArgumentParser()
    verify.add_parser(parser.add_subparsers())
    for nproc, said in ((2, ""), (6, "6 CPU processes on 2 cores: they take turns")):
        config = config_from_args(parser.parse_args(["verify", "--device", "cpu", "--nproc", str(nproc)]),
                                  gpus_visible=0, checked=True)
        assert config.device_note.startswith(said) and bool(config.device_note) == bool(said)


@pytest.mark.slow
def test_gradient_accumulation_trains_every_backend_alike_and_is_predicted_where_modelled(tmp_path):
    """--grad-accum 3 in fp32: DDP under no_sync, DeepSpeed counting micro-batches in engine.step(),
    FSDP2 reduce-scattering each; the same AdamW steps on the mean over three micro-batches, so the
    same trajectory. Every check passes, every peak as predicted (DeepSpeed's micro-batches before the
    boundary: DeepSpeedStepModel.accumulating)."""
    out = tmp_path / "accumulated"
    result = zerolens("verify", "--precision", "fp32", "--strategies", "ddp,zero0,zero2,fsdp2", "--grad-accum", "3",
                      "--steps", "6", "--out", str(out), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert all(c["passed"] for c in summary["checks"]), [c["detail"] for c in summary["checks"] if not c["passed"]]
    base = summary["strategies"]["zero0"]["losses"]
    for name in ("ddp", "zero2", "fsdp2"):
        assert max(abs(a - b) for a, b in zip(summary["strategies"][name]["losses"], base)) < 1e-4
    predicted = [c["name"] for c in summary["checks"] if c["name"].startswith("peak as predicted")]
    assert sorted(predicted) == sorted(f"peak as predicted ({name}, rank {r})"
                                       for name in ("ddp", "zero0", "zero2", "fsdp2") for r in (0, 1))
    assert not [c for c in summary["not_checked"] if c["name"].startswith("peak as predicted")]


def test_the_bucket_is_said_on_the_terminal_only_where_it_costs_memory():
    """A bucket larger than the gradients is in report.md's notes either way; the terminal's line only where
    the strategy's peak is above the baseline's (a user saw it when ZeRO-2 saved memory all the same)."""
    from zerolens.models.model import PRESETS
    from zerolens.report.summary import bucket_notes
    from zerolens.run.config import RunConfig
    config = RunConfig(strategies=("zero0", "zero2"), baseline="zero0", preset="gpt-tiny", model=PRESETS["gpt-tiny"],
                       reduce_bucket_size=20_000)

    def strategies(zero2_peak):
        return {"zero0": {"ranks": [{"peak_bytes": 600_000}]}, "zero2": {"ranks": [{"peak_bytes": zero2_peak}]}}
    notes, headlines = bucket_notes(config, strategies(500_000), 19_000)
    assert len(notes) == 1 and "Measured on rank 0: peak 488 KiB under zero2 against 586 KiB under zero0." in notes[0]
    assert headlines == []
    notes, headlines = bucket_notes(config, strategies(700_000), 19_000)
    assert len(headlines) == 1 and "; peak 684 KiB against 586 KiB. Try --reduce-bucket-size" in headlines[0]
