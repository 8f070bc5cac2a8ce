"""DeepSpeed without ZeRO and at ZeRO-1/2 under gradient accumulation (DeepSpeedStepModel.accumulating):
what each keeps between the micro-batches before the boundary, as DeepSpeed 0.19's source does it, one
trace spliced for every rank, and the CPU measurement of every phase as predicted."""
import dataclasses
import json

import pytest
from conftest import zerolens

from zerolens.models.model import PRESETS, parameter_shapes
from zerolens.predict.peak import predict_peaks, spliced_ranks, why_not_traced
from zerolens.strategies import TrainSettings
from zerolens.strategies.layout import zero_rank_partition

MODEL = PRESETS["gpt-tiny"]
BUCKET = 20_000  # elements: several reductions per backward, and a bucket small beside the gradients


def test_every_deepspeed_stage_is_traced_under_gradient_accumulation():
    accumulated = TrainSettings(precision="bf16", world_size=2, micro_batch=2, grad_accum=2)
    for name in ("zero0", "zero1", "zero2", "zero3"):
        assert why_not_traced(name, MODEL, accumulated) is None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2"])
def test_the_next_micro_batchs_forward_runs_beside_what_deepspeed_keeps_until_the_boundary(name):
    """Against one micro-batch per step, the second micro-batch's forward holds, to the byte: without
    ZeRO, every 16-bit gradient (no reduction before the boundary); ZeRO-1, those and the reduce bucket
    its first gradient set up (released only by the boundary's epilogue); ZeRO-2, the rank's gradient
    buffer, kept as the sum (all_grad_tensors). A third micro-batch holds no more than the second (ZeRO-2
    adds each later buffer into the sum and drops it), and the step is the same."""
    rank = 1
    one = TrainSettings(precision="bf16", world_size=2, micro_batch=2, reduce_bucket_size=BUCKET)
    plain, two, three = (predict_peaks(name, MODEL, dataclasses.replace(one, grad_accum=k), rank=rank)
                         for k in (1, 2, 3))
    numels = [s.numel() for s in parameter_shapes(MODEL)]
    kept = {"zero0": 2 * sum(numels), "zero1": 2 * sum(numels) + 2 * BUCKET,
            "zero2": 2 * zero_rank_partition(numels, 2, rank).grad_buffer_elements}[name]
    assert two["peak_during_forward"] - plain["peak_during_forward"] == kept
    assert two["peak_during_step"] == plain["peak_during_step"]
    assert two["held_after_step_bytes"] == plain["held_after_step_bytes"]
    assert three == two


@pytest.mark.slow
@pytest.mark.parametrize("name, precision, cuda", [
    ("zero2", "bf16", None),
    ("zero1", "fp32", None),
    ("zero2", "fp16", (9, 0)),  # a CUDA target: the allocator model replays each rank's sequence
])
def test_one_trace_spliced_for_every_rank_is_each_ranks_own_under_accumulation(name, precision, cuda):
    """ZeRO-2's later micro-batches each allocate and drop a gradient buffer of the rank's own size
    beside the kept sum: the splice gives every rank what its own trace gives, figure for figure."""
    settings = TrainSettings(precision=precision, world_size=3, micro_batch=2, reduce_bucket_size=BUCKET,
                             grad_accum=3)
    spliced = spliced_ranks(name, MODEL, settings, cuda_capability=cuda, trace_on="cpu")
    own = [predict_peaks(name, MODEL, settings, rank=rank, cuda_capability=cuda, trace_on="cpu") for rank in range(3)]
    assert spliced == own
    if name == "zero2":  # the ranks' kept sums differ, and so do their forward peaks
        assert len({r["peak_during_forward"] for r in own}) > 1


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    [],  # the default reduce bucket (95 MiB in bf16), the largest part of ZeRO-1/2's peaks
    ["--precision", "fp32", "--micro-batch", "2", "--reduce-bucket-size", str(BUCKET)],  # 1% is less than a buffer
])
def test_verify_measures_deepspeeds_peaks_as_predicted_under_accumulation(tmp_path, options):
    """--grad-accum 4 on 2 CPU ranks: every check passes, the peaks of zero0, zero1 and zero2 among them,
    on both ranks."""
    out = tmp_path / "run"
    result = zerolens("verify", "--nproc", "2", "--device", "cpu", "--preset", "gpt-tiny", "--strategies",
                      "ddp,zero0,zero1,zero2", "--grad-accum", "4", "--steps", "4", *options, "--out", str(out),
                      timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert all(c["passed"] for c in summary["checks"]), [c["detail"] for c in summary["checks"] if not c["passed"]]
    peaks = {c["name"] for c in summary["checks"] if c["name"].startswith("peak as predicted")}
    assert peaks == {f"peak as predicted ({name}, rank {rank})" for name in ("ddp", "zero0", "zero1", "zero2")
                     for rank in (0, 1)}
    assert not [c for c in summary["not_checked"] if c["name"].startswith("peak as predicted")]
