"""`zerolens bench` end to end on 2 CPU processes, and the GPT preset's task."""
import json

import pytest
import torch

from conftest import zerolens
from zerolens.bench import datasheet_peak
from zerolens.data import lm_batch
from zerolens.model import PRESETS, build_model, num_params, parameter_shapes, training_flops_per_token


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "run"
    # No --steps: bench's own default (10 timed steps) must reach the workers.
    result = zerolens("bench", "--preset", "gpt-tiny", "--strategies", "ddp,zero2", "--warmup", "1",
                      "--peak-tflops", "1", "--out", str(out), timeout=300)
    return result, out


def test_bench_writes_json_table_and_plot(bench_run):
    result, out = bench_run
    assert result.returncode == 0, result.stdout + result.stderr
    bench = json.loads((out / "bench.json").read_text())
    assert bench["timed_steps"] == 10 and bench["warmup_steps"] == 1
    assert bench["tokens_per_step"] == 8 * 2 * 64
    assert bench["peak_tflops"] == 1 and bench["peak_tflops_source"] == "--peak-tflops"
    for name in ("ddp", "zero2"):
        s = bench["strategies"][name]
        assert len(s["step_times_s"]) == 10 and s["step_time_s"] > 0
        assert s["tokens_per_s"] == pytest.approx(bench["tokens_per_step"] / s["step_time_s"])
        assert s["mfu"] == pytest.approx(s["tflops_per_gpu"] / 1)
        assert s["peak_bytes"] is None  # no allocator on CPU: said, not made up
        assert set(s["vs_ddp"]) == {"step_time", "peak_bytes"}
        assert len(s["losses"]) == 11
    assert bench["strategies"]["ddp"]["vs_ddp"]["step_time"] == 1.0
    # Same model, data and seed: the two strategies' losses agree (bf16).
    assert max(abs(a - b) for a, b in zip(bench["strategies"]["ddp"]["losses"],
                                          bench["strategies"]["zero2"]["losses"])) < 0.05
    assert "| zero2 |" in (out / "bench.md").read_text()
    assert (out / "bench.png").stat().st_size > 0
    assert result.stdout.count("# zerolens bench") == 1  # rank 0 alone prints


def test_bench_rejects_bad_flags():
    result = zerolens("bench", "--steps", "0", timeout=60)
    assert result.returncode == 2 and "--steps" in result.stderr and "Traceback" not in result.stderr
    result = zerolens("bench", "--ds-override", "{not json", timeout=60)
    assert result.returncode == 2 and "--ds-override is not valid JSON" in result.stderr
    result = zerolens("maxsize", "--device", "cpu", timeout=60)
    assert result.returncode == 2 and "maxsize needs GPUs" in result.stderr


def test_lm_task_follows_its_successor_rule():
    tokens, labels = lm_batch(3, seed=0, batch_size=64, seq_len=32, vocab_size=97, signal=0.8)
    again, _ = lm_batch(3, seed=0, batch_size=64, seq_len=32, vocab_size=97, signal=0.8)
    assert torch.equal(tokens, again)  # a pure function of (seed, step)
    assert torch.equal(tokens[:, 1:], labels[:, :-1])  # labels are the next tokens
    successor = torch.randperm(97, generator=torch.Generator().manual_seed(0))
    follows = (labels == successor[tokens]).float().mean().item()
    assert 0.75 < follows < 0.85  # signal 0.8, plus the odd uniform draw that lands on the successor


def test_gpt_presets_sizes_and_flops():
    assert 0.9e9 < sum(s.numel() for s in parameter_shapes(PRESETS["gpt-1b"])) < 1.0e9
    config = PRESETS["gpt-tiny"]
    model = build_model(config, 0)
    params = num_params(model)
    assert params == sum(s.numel() for s in parameter_shapes(config))
    d, L, T, V = config.d_model, config.num_layers, config.seq_len, config.vocab_size
    assert training_flops_per_token(config, params) == 6 * (params - V * d - T * d) + 12 * L * d * T
    logits = model(torch.zeros(2, T, dtype=torch.long))
    assert logits.shape == (2, T, V)


def test_datasheet_peaks():
    assert datasheet_peak("NVIDIA H200", "bf16") == 989.4
    assert datasheet_peak("NVIDIA H200", "fp32") is None
    assert datasheet_peak("Some GPU", "bf16") is None
