"""The peak prediction (predict_peak.py): pure (no process group, no memory), consistent with the
layout theory, and equal to the CPU measurement of every phase within 1% (the check verify makes)."""
import json

import pytest

from conftest import zerolens
from zerolens.model import PRESETS, parameter_shapes
from zerolens.predict_peak import cublas_workspace_bytes, predict_peaks
from zerolens.strategies import TrainSettings, registry

PREDICTED = ("ddp", "zero0", "zero1", "zero2")


@pytest.mark.parametrize("name", PREDICTED)
@pytest.mark.parametrize("world_size, rank", [(2, 1), (3, 2)])
def test_what_the_step_model_keeps_after_the_step_is_the_layout_theorys(name, world_size, rank):
    """No process group and no memory: the step runs on fake tensors. What it holds after the step
    (the workspaces aside) is byte for byte what theory.py says the rank keeps."""
    model = PRESETS["gpt-tiny"]
    settings = TrainSettings(precision="bf16", world_size=world_size, micro_batch=2)
    predicted = predict_peaks(name, model, settings, rank=rank, cuda_capability=(9, 0))
    kept = registry.predict_retained(name, [s.numel() for s in parameter_shapes(model)], world_size, rank, "bf16")
    assert predicted["held_after_step_bytes"] - predicted["cublas_workspace_bytes"] == (
        kept["param_bytes"] + kept["optimizer_state_bytes"] + kept["grad_bytes_after_step"]
        + kept["comm_buffer_bytes_after_backward"])
    assert predicted["peak_bytes"] == max(predicted[f"peak_during_{p}"] for p in ("forward", "backward", "step"))
    assert predicted["peak_bytes"] > predicted["held_after_step_bytes"]


def test_a_billion_parameters_cost_no_memory():
    settings = TrainSettings(precision="bf16", world_size=8, micro_batch=8)
    predicted = predict_peaks("zero2", PRESETS["gpt-1b"], settings, rank=7, cuda_capability=(9, 0))
    assert 8 * 2**30 < predicted["peak_bytes"] < 40 * 2**30


def test_a_run_of_one_step_is_predicted_over_one_step():
    """bench --warmup 0 --steps 1: its first step has no optimizer states in forward yet."""
    settings = TrainSettings(precision="bf16", world_size=2, micro_batch=2)
    one = predict_peaks("ddp", PRESETS["gpt-tiny"], settings, steps=1)
    three = predict_peaks("ddp", PRESETS["gpt-tiny"], settings)
    assert one["peak_during_forward"] < three["peak_during_forward"]


def test_cublas_workspaces_by_compute_capability():
    assert cublas_workspace_bytes(None) == 0
    assert cublas_workspace_bytes((9, 0)) == 68157440  # measured on H200 (docs/results/2xh200/issue14/)


def test_a_strategy_without_a_step_model_says_so():
    with pytest.raises(ValueError, match="zero3 has no step model"):
        predict_peaks("zero3", PRESETS["gpt-tiny"], TrainSettings(precision="bf16"))


@pytest.mark.slow
def test_verify_on_three_ranks_predicts_every_phase_within_one_percent(tmp_path):
    out = tmp_path / "run"
    result = zerolens("verify", "--strategies", ",".join(PREDICTED) + ",zero3", "--preset", "gpt-tiny", "--nproc", "3",
                      "--steps", "4", "--out", str(out), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    checks = [c for c in summary["checks"] if c["name"].startswith("peak as predicted")]
    assert len(checks) == 3 * len(PREDICTED) and all(c["passed"] for c in checks), checks
    assert "does not predict zero3" in summary["strategies"]["zero3"]["peak_not_predicted"]
    assert "Peaks, predicted before training and measured" in (out / "report.md").read_text()


def test_a_model_that_cannot_be_traced_is_not_predicted_and_says_why(monkeypatch):
    """A model whose step fails on fake tensors (here: a trace that raises) keeps its run going."""
    from zerolens import predict_peak
    from zerolens.config import RunConfig

    def fails(*args, **kwargs):
        raise RuntimeError("data-dependent output\nmore lines")
    monkeypatch.setattr(predict_peak, "predict_peaks", fails)
    config = RunConfig(strategies=("ddp", "zero3"), baseline="ddp", preset="gpt-tiny", model=PRESETS["gpt-tiny"])
    predicted = predict_peak.predicted_peaks(config, None)
    assert predicted["ddp"]["why_not"] == "the trace on fake tensors failed (RuntimeError: data-dependent output)"
    assert "more lines" in predicted["ddp"]["traceback"]  # kept whole in predicted_peaks.json
    assert "does not predict zero3" in predicted["zero3"]["why_not"]
