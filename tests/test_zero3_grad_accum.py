"""DeepSpeed ZeRO-3 under gradient accumulation (strategies/deepspeed_stage3.py): every micro-batch reduces
into the persistent gradient partitions (partition_grads copies at the step's first, adds at the later ones)
and engine.step() before the boundary only counts, so ZeRO-3 keeps between micro-batches what it keeps after a
step; the CPU measurement of every phase as predicted."""
import dataclasses
import json
import math
import warnings

import pytest
import torch
from conftest import zerolens
from torch._subclasses.fake_tensor import FakeTensorMode

from zerolens.measure.tracker import tracker_total
from zerolens.models.data import make_batch
from zerolens.models.model import PRESETS, meta_model, parameter_shapes
from zerolens.predict.peak import (
    fake_process_group,
    predict_peaks,
    to_empty_keeping_ties,
    totals_tracker,
    why_not_traced,
)
from zerolens.strategies import TrainSettings, registry
from zerolens.strategies.deepspeed import not_modelled

MODEL = PRESETS["gpt-tiny"]
BUCKET = 20_000  # elements: several reductions per backward


def test_zero3_is_traced_under_gradient_accumulation():
    accumulated = TrainSettings(precision="bf16", world_size=2, micro_batch=2, grad_accum=2)
    assert not_modelled(accumulated, 3) == []
    assert why_not_traced("zero3", MODEL, accumulated) is None


@pytest.mark.slow
def test_the_next_micro_batchs_forward_runs_beside_what_zero3_keeps_between_micro_batches():
    """Traced micro-batch by micro-batch (the step model on fake tensors, rank 1 of 2): between micro-batches
    ZeRO-3 holds, to the byte, the 16-bit shards, their fp32 masters, the reduce bucket, the gradient
    partitions and every persistent parameter gathered (gpt-tiny's are all persistent: each in a buffer of N
    shards), and from the second step on AdamW's states: what a step leaves. The first step's first
    micro-batch, recorded by the coordinator's trace, keeps only the embeddings gathered. partition_grads
    copies at the step's first micro-batch and adds at the later ones (micro_step_id 0, 1, 2, then 0 after the
    step). Against one micro-batch per step, two and three predict the same peaks."""
    n, rank, k = 2, 1, 3
    settings = TrainSettings(precision="bf16", world_size=n, micro_batch=2, reduce_bucket_size=BUCKET, grad_accum=k)
    step_model = registry.spec("zero3").build_step_model(settings, rank=rank, cuda=False)
    tokens, labels = make_batch(MODEL, 0, seed=0, batch_size=settings.micro_batch, signal=0.0)
    model = meta_model(MODEL)  # outside FakeTensorMode, which then gives it fake storage (predict/peak.py)
    tracker = totals_tracker(device_type="cpu")
    held, micro_step_ids = [], []
    reduce = step_model.reduce_bucket

    def reduce_bucket():
        if step_model.bucket_params:
            micro_step_ids.append(step_model.micro_step_id)
        reduce()
    step_model.reduce_bucket = reduce_bucket
    with warnings.catch_warnings(), fake_process_group(rank, n), \
            FakeTensorMode(allow_non_fake_inputs=True) as mode, tracker:
        warnings.simplefilter("ignore")
        step_model.setup(to_empty_keeping_ties(model, torch.device("cpu")), torch.device("cpu"))
        tokens, labels = mode.from_tensor(tokens), mode.from_tensor(labels)
        for _ in range(2):
            for micro in range(k):
                tracker.reset_mod_stats()
                loss = step_model.forward_loss(tokens.clone(), labels.clone())
                step_model.backward(loss)
                del loss
                held.append(tracker_total(tracker, "current"))
            step_model.step()
            held.append(tracker_total(tracker, "current"))

    numels = [s.numel() for s in parameter_shapes(MODEL)]
    assert max(numels) <= step_model.config.param_persistence_threshold
    shards = [math.ceil(x / n) for x in numels]
    elements = sum(shards)
    setup = 2 * elements + 4 * elements + 2 * BUCKET + 2 * elements  # shards, masters, bucket, gradient partitions
    gathered = sum(2 * s * n for s in shards)
    embeddings = 2 * (shards[0] + shards[1]) * n  # token_embedding, position_embedding: no post-backward hook
    adamw = 2 * 4 * elements + 4  # exp_avg, exp_avg_sq and the step count of the one sub-group's master
    assert held == [setup + embeddings, setup + gathered, setup + gathered, setup + gathered + adamw,
                    *[setup + gathered + adamw] * (k + 1)]
    bucket_reductions = len(micro_step_ids) // (2 * k)
    assert micro_step_ids == [m for _ in range(2) for m in range(k) for _ in range(bucket_reductions)]

    one = dataclasses.replace(settings, grad_accum=1)
    plain, two, three = (predict_peaks("zero3", MODEL, dataclasses.replace(one, grad_accum=g), rank=rank)
                         for g in (1, 2, 3))
    assert plain == two == three


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    [],  # the default reduce bucket (95 MiB in bf16), the largest part of ZeRO-3's peaks
    ["--precision", "fp32", "--micro-batch", "2", "--reduce-bucket-size", str(BUCKET)],
])
def test_verify_measures_zero3s_peaks_as_predicted_under_accumulation(tmp_path, options):
    """--grad-accum 4 on 2 CPU ranks: every check passes, the peaks of ddp and zero3 among them, on both ranks."""
    out = tmp_path / "run"
    result = zerolens("verify", "--nproc", "2", "--device", "cpu", "--preset", "gpt-tiny", "--strategies",
                      "ddp,zero3", "--grad-accum", "4", "--steps", "4", *options, "--out", str(out), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert all(c["passed"] for c in summary["checks"]), [c["detail"] for c in summary["checks"] if not c["passed"]]
    peaks = {c["name"] for c in summary["checks"] if c["name"].startswith("peak as predicted")}
    assert peaks == {f"peak as predicted ({name}, rank {rank})" for name in ("ddp", "zero3") for rank in (0, 1)}
    assert not [c for c in summary["not_checked"] if c["name"].startswith("peak as predicted")]
