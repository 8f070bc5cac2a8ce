"""The peak prediction (predict/peak.py): pure (no memory; a fake process group only while it traces),
consistent with the layout theory, and equal to the CPU measurement of every phase within 1% (the
check verify makes)."""
import argparse
import json
import sys
from pathlib import Path

import pytest
from conftest import run, zerolens

from zerolens.models.model import PRESETS, parameter_shapes
from zerolens.predict.peak import cublas_workspace_bytes, predict_peaks
from zerolens.strategies import TrainSettings, registry

PREDICTED = ("ddp", "zero0", "zero1", "zero2", "zero3", "fsdp2-grad", "fsdp2")


@pytest.fixture
def unrounded(monkeypatch):
    """Storages counted at their own bytes where a CUDA target is traced on CPU tensors, not rounded
    up to the caching allocator's 512 (without_gpu.round_as_cuda): the layout theory's bytes."""
    monkeypatch.setattr("zerolens.predict.without_gpu.round_as_cuda", lambda info: info.size * info.element_size)


@pytest.mark.parametrize("name", ["zero3", "fsdp2-grad", "fsdp2"])
@pytest.mark.parametrize("world_size, rank", [(2, 1), (3, 2)])
def test_what_the_step_model_keeps_after_the_step_is_the_layout_theorys(name, world_size, rank, unrounded):
    """No process group and no memory: the step runs on fake tensors. What it holds after the step
    (the workspaces aside) is byte for byte what strategies/layout.py says the rank keeps. Only where the
    step model does not size its buffers from that theory (ZeRO-3's restates DeepSpeed's source, FSDP2's
    is FSDP2 itself); DDP's and DeepSpeed's stages 0-2 do, and are compared with the backends themselves
    (tests/test_step_models_against_backends.py)."""
    model = PRESETS["gpt-tiny"]
    settings = TrainSettings(precision="bf16", world_size=world_size, micro_batch=2)
    predicted = predict_peaks(name, model, settings, rank=rank, cuda_capability=(9, 0), trace_on="cpu")
    shapes = parameter_shapes(model)
    kept = registry.predict_retained(name, [s.numel() for s in shapes], world_size, rank, "bf16",
                                     param_shapes=[tuple(s) for s in shapes])
    assert predicted["held_after_step_bytes"] - predicted["cublas_workspace_bytes"] == (
        kept["param_bytes"] + kept["optimizer_state_bytes"] + kept["grad_bytes_after_step"]
        + kept["comm_buffer_bytes_after_backward"])
    assert predicted["peak_bytes"] == max(predicted[f"peak_during_{p}"] for p in ("forward", "backward", "step"))
    assert predicted["peak_bytes"] > predicted["held_after_step_bytes"]


@pytest.mark.slow
def test_a_billion_parameters_cost_no_memory():
    """gpt-1b (0.94B parameters: 3.5 GiB in fp32 alone) traced as rank 7 of 8 under ZeRO-2: the process's
    resident memory grows by less than 256 MiB over the trace (Linux's high-water mark, reset before
    it), and the backward peak holds at least the rank's weights and optimizer states plus the fp32
    logits the loss makes (micro-batch x sequence x vocabulary x 4 bytes)."""
    import re
    from pathlib import Path

    def high_water_kib() -> int:
        return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the resident high-water mark")
    config = PRESETS["gpt-1b"]
    settings = TrainSettings(precision="bf16", world_size=8, micro_batch=8)
    predict_peaks("zero2", PRESETS["gpt-tiny"], settings, steps=1)  # the imports and caches a first trace makes
    Path("/proc/self/clear_refs").write_text("5")
    before = high_water_kib()
    predicted = predict_peaks("zero2", config, settings, rank=7, cuda_capability=(9, 0))
    assert high_water_kib() - before < 256 * 1024
    shapes = parameter_shapes(config)
    kept = registry.predict_retained("zero2", [s.numel() for s in shapes], 8, 7, "bf16")
    logits = settings.micro_batch * config.seq_len * config.vocab_size * 4
    assert predicted["peak_during_backward"] > kept["param_bytes"] + kept["optimizer_state_bytes"] + logits


def test_a_run_of_one_step_is_predicted_over_one_step():
    """bench --warmup 0 --steps 1: its first step has no optimizer states in forward yet."""
    settings = TrainSettings(precision="bf16", world_size=2, micro_batch=2)
    one = predict_peaks("ddp", PRESETS["gpt-tiny"], settings, steps=1)
    three = predict_peaks("ddp", PRESETS["gpt-tiny"], settings)
    assert one["peak_during_forward"] < three["peak_during_forward"]


def test_gradient_accumulation_holds_the_gradients_through_the_next_micro_batchs_forward():
    """DDP under no_sync, two micro-batches per step: the second forward runs beside the first's
    fp32 gradients (every parameter's, 4 bytes each), the step's peak is the same. DeepSpeed's
    stages are traced under accumulation too (tests/test_zero_grad_accum.py, test_zero3_grad_accum.py)."""
    import dataclasses

    from zerolens.models.model import build_model
    from zerolens.predict.peak import why_not_traced
    one = TrainSettings(precision="bf16", world_size=2, micro_batch=2)
    two = dataclasses.replace(one, grad_accum=2)
    plain, accumulated = (predict_peaks("ddp", PRESETS["gpt-tiny"], s) for s in (one, two))
    gradients = 4 * sum(p.numel() for p in build_model(PRESETS["gpt-tiny"], 0).parameters())
    assert accumulated["peak_during_forward"] - plain["peak_during_forward"] == gradients
    assert accumulated["peak_during_step"] == plain["peak_during_step"]
    for name in ("zero0", "zero1", "zero2", "zero3"):
        assert why_not_traced(name, PRESETS["gpt-tiny"], one) is None
    assert why_not_traced("zero3", PRESETS["gpt-tiny"], two) is None  # tests/test_zero3_grad_accum.py


def test_a_cpu_target_holds_gloos_copy_of_each_reduce_scatter_input(unrounded):
    """gloo reduces a copy of a reduce-scatter's input (FSDP2's backward), NCCL does not: the CPU
    prediction makes the copy, the CUDA one does not, and the largest is said for the CPU check:
    the largest FSDP2 group's gradients in fp32, FSDP2's reduce dtype here."""
    from zerolens.models.model import meta_model
    from zerolens.strategies.fsdp2 import repeated_blocks
    model_config = PRESETS["gpt-tiny"]
    settings = TrainSettings(precision="bf16", world_size=2, micro_batch=2)
    cpu = predict_peaks("fsdp2", model_config, settings, steps=1)
    cuda = predict_peaks("fsdp2", model_config, settings, steps=1, cuda_capability=(9, 0), trace_on="cpu")
    model = meta_model(model_config)
    blocks = repeated_blocks(model)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    groups = [sum(p.numel() for p in b.parameters()) for b in blocks]
    groups.append(sum(p.numel() for p in model.parameters() if id(p) not in in_blocks))
    # reduce-scatters in backward: each input's copy, and the rank's share (the output, half at N=2)
    assert cpu["gloo_late_free_bytes"] == {"backward": sorted({4 * g for g in groups} | {2 * g for g in groups})}
    assert cuda["gloo_late_free_bytes"] == {}
    assert cpu["peak_during_backward"] > cuda["peak_during_backward"] - cuda["cublas_workspace_bytes"]
    # DDP all-reduces its buckets in place; DeepSpeed a flat copy of its reduce bucket (gpt-tiny's
    # gradients fit one), in bf16.
    assert predict_peaks("ddp", model_config, settings, steps=1)["gloo_late_free_bytes"] == {}
    zero2 = predict_peaks("zero2", model_config, settings, steps=1)
    # ... and gloo reduces a copy of each rank's stretch of it (2 ranks: two stretches, here of one size).
    flat = 2 * sum(p.numel() for p in model.parameters())
    assert zero2["gloo_late_free_bytes"].keys() == {"backward"} and flat in zero2["gloo_late_free_bytes"]["backward"]
    assert sum(zero2["gloo_late_free_bytes"]["backward"]) in (flat + flat // 2, 2 * flat)



def test_a_reduction_through_a_view_of_zero2s_bucket_lets_gloo_free_the_bucket_late(monkeypatch):
    """One gradient of one element: the bucket's one slice is all-reduced through a view of the bucket
    (no flat copy), which gloo's thread holds, and frees now and then during the step (a tiny model's
    step was measured 2000 bytes above the prediction, 3 runs in 7): the bucket is a buffer it may free late."""
    from zerolens.run.flags import add_verify_arguments, config_from_args
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    parser = argparse.ArgumentParser()
    add_verify_arguments(parser)
    config = config_from_args(parser.parse_args(
        ["--model", "zerolens_test_models:one_weight", "--batch", "zerolens_test_models:small_batch", "--nproc", "2",
         "--strategies", "zero2", "--reduce-bucket-size", "1e3"]), world_size=2)
    zero2 = predict_peaks("zero2", config.model, config.train_settings(), steps=1)
    assert zero2["gloo_late_free_bytes"] == {"backward": [2, 2000]}  # the slice's copy, and the bf16 bucket

def test_gloos_copies_are_made_around_the_reduce_scatter_that_torch_2_11_names_reduce_scatter_tensor(monkeypatch):
    """torch 2.11 and 2.12 have no reduce_scatter_single: FSDP2 calls reduce_scatter_tensor, and the
    CPU trace makes gloo's copy around that one (on the GPU machine's torch 2.11, looking for
    reduce_scatter_single failed every CPU prediction), and puts it back afterwards."""
    import torch
    import torch.distributed as dist

    from zerolens.predict.peak import gloo_reduce_scatter_copies
    calls = []
    monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    monkeypatch.setattr(dist, "reduce_scatter_tensor", lambda output, input, **kwargs: calls.append(kwargs))
    original = dist.reduce_scatter_tensor
    with gloo_reduce_scatter_copies() as sizes:
        dist.reduce_scatter_tensor(torch.empty(4), torch.empty(8), async_op=False)
    assert calls == [{"async_op": False}] and sizes == [32, 16]
    assert dist.reduce_scatter_tensor is original and not hasattr(dist, "reduce_scatter_single")


@pytest.mark.parametrize("name", ["case-study-default", "gpt-1b-default"])
def test_the_cublas_workspaces_are_what_an_h200_kept(name):
    """Measured, not restated: after three training steps recorded on an H200 (tests/fixtures/allocator,
    scripts/record_allocator.py: a plain loop, foreach AdamW), what the allocator still holds beyond
    the parameters, AdamW's two moments and step counters is, in blocks of 1 MiB or more, exactly the
    workspaces cublas_workspaces gives compute capability 9.0; the rest (the last batch, a loss) is
    small. No CUDA, no workspaces."""
    import collections
    import gzip
    from pathlib import Path

    from zerolens.models.model import meta_model
    from zerolens.predict.peak import cublas_workspaces
    with gzip.open(Path(__file__).parent / "fixtures" / "allocator" / f"{name}.json.gz", "rt") as f:
        record = json.load(f)
    assert record["gpu"] == "NVIDIA H200"
    alive = {}
    for action, address, size, _ in record["events"]:
        if action == "alloc":
            alive[address] = size
        elif action == "free_completed":
            del alive[address]
    states = collections.Counter()
    for p in meta_model(PRESETS[record["model"]]).parameters():
        states[4 * p.numel()] += 3  # the fp32 weight and AdamW's two moments
        states[4] += 1  # AdamW's step counter
    rest = collections.Counter(alive.values()) - states
    workspaces = collections.Counter(size for sizes in cublas_workspaces((9, 0)).values() for size in sizes)
    assert collections.Counter({size: n for size, n in rest.items() if size >= 2**20}) == workspaces
    assert sum(size * n for size, n in rest.items() if size < 2**20) < 2**20
    assert cublas_workspace_bytes((9, 0)) == sum(size * n for size, n in workspaces.items())
    assert cublas_workspace_bytes(None) == 0


def test_the_cublas_workspace_of_other_gpus_and_of_cublas_workspace_config_is_torchs(monkeypatch):
    """Below compute capability 9.0 a handle's workspace is torch's default ":4096:2:16:8", 8519680 bytes:
    the block one matrix product left allocated on a pre-Hopper GPU (discuss.pytorch.org, "torch.cuda.
    memory_snapshot() shows an unexpected 8519680B memory allocation"). CUBLAS_WORKSPACE_CONFIG, where set,
    is torch's ":SIZE:COUNT" pairs, SIZE in KiB (notes/randomness: ":4096:8" and ":16:8"), whatever the GPU."""
    from zerolens.predict.peak import cublas_workspaces
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert cublas_workspaces((8, 0)) == {"forward": [8519680, 2**20], "backward": [8519680]}
    for config, per_handle in ((":4096:8", 32 * 2**20), (":16:8", 128 * 2**10), (":4096:2:16:8", 8519680)):
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", config)
        for capability in ((8, 0), (9, 0)):
            assert cublas_workspaces(capability) == {"forward": [per_handle, 2**20], "backward": [per_handle]}


def test_a_strategy_without_a_step_model_says_so(unpredicted_strategy):
    with pytest.raises(ValueError, match=f"{unpredicted_strategy} has no step model"):
        predict_peaks(unpredicted_strategy, PRESETS["gpt-tiny"], TrainSettings(precision="bf16"))


@pytest.mark.slow
def test_deepspeeds_reductions_at_backwards_end_are_predicted(tmp_path):
    """Checkpointed, one sample, a reduce bucket larger than the model: backward's peak is where
    DeepSpeed reduces, at its end (stage 0's flat all-reduce copies, stage 1's gradients all kept
    until then, stage 1/2's flat copy of the bucket). The trace once missed these by 2 to 11%."""
    out = tmp_path / "run"
    result = zerolens("verify", "--strategies", "zero0,zero1,zero2", "--preset", "gpt-tiny", "--width", "256",
                      "--depth", "4", "--seq-len", "32", "--micro-batch", "1", "--activation-checkpointing",
                      "--steps", "4", "--out", str(out), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    checks = [c for c in summary["checks"] if c["name"].startswith("peak as predicted")]
    assert len(checks) == 3 * 2 and all(c["passed"] for c in checks), checks


@pytest.mark.slow
def test_verify_on_three_ranks_predicts_every_phase_within_one_percent(tmp_path):
    out = tmp_path / "run"
    result = zerolens("verify", "--strategies", ",".join(PREDICTED), "--preset", "gpt-tiny", "--nproc", "3",
                      "--steps", "4", "--out", str(out), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    checks = [c for c in summary["checks"] if c["name"].startswith("peak as predicted")]
    assert len(checks) == 3 * len(PREDICTED) and all(c["passed"] for c in checks), checks
    assert "Peaks, predicted before training and measured" in (out / "report.md").read_text()


@pytest.mark.slow
def test_zero3_gathering_and_reducing_is_predicted_within_one_percent(tmp_path):
    """gpt-tiny's parameters all stay gathered under ZeRO-3 (none exceeds param_persistence_threshold).
    At width 256 eight weights do: every step gathers them (prefetched from the second step on) and
    releases them, and a bucket of 8e4 elements is reduced several times per backward; a bucket this
    small no longer outweighs the rest of the peak, so 1% is 175 to 262 KB here."""
    out = tmp_path / "run"
    result = zerolens("verify", "--strategies", "zero3", "--preset", "gpt-tiny", "--width", "256", "--nproc", "3",
                      "--reduce-bucket-size", "8e4", "--steps", "4", "--out", str(out), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    checks = [c for c in summary["checks"] if c["name"].startswith("peak as predicted")]
    assert len(checks) == 3 and all(c["passed"] for c in checks), checks


def test_a_model_that_cannot_be_traced_is_not_predicted_and_says_why(monkeypatch, unpredicted_strategy):
    """A model whose step fails on fake tensors (here: a trace that raises) keeps its run going."""
    from zerolens.predict import peak as predict_peak
    from zerolens.run.config import RunConfig

    def fails(*args, **kwargs):
        raise RuntimeError("data-dependent output\nmore lines")
    monkeypatch.setattr(predict_peak, "traced_rank", fails)
    config = RunConfig(strategies=("ddp", unpredicted_strategy), baseline="ddp", preset="gpt-tiny",
                       model=PRESETS["gpt-tiny"])
    predicted = predict_peak.predicted_peaks(config, None)
    assert predicted["ddp"]["why_not"] == "the trace on fake tensors failed (RuntimeError: data-dependent output)"
    assert "more lines" in predicted["ddp"]["traceback"]  # kept whole in predicted_peaks.json
    assert f"does not predict {unpredicted_strategy}" in predicted[unpredicted_strategy]["why_not"]


def test_the_trace_leaves_no_process_group_behind_even_when_it_fails(monkeypatch):
    """The trace runs as its rank under a fake default process group (FSDP2's own code needs one),
    destroyed afterwards whatever happens: the next trace, or another test, makes its own."""
    import torch.distributed as dist

    from zerolens.strategies.fsdp2 import TorchFSDP2StepModel
    settings = TrainSettings(precision="bf16", world_size=2, micro_batch=2)
    predict_peaks("fsdp2", PRESETS["gpt-tiny"], settings, rank=1, steps=1)
    assert not dist.is_initialized()

    def fails(self):
        raise RuntimeError("the step failed")
    monkeypatch.setattr(TorchFSDP2StepModel, "step", fails)
    with pytest.raises(RuntimeError, match="the step failed"):
        predict_peaks("fsdp2", PRESETS["gpt-tiny"], settings, steps=1)
    assert not dist.is_initialized()


def test_a_process_with_a_process_group_is_told_to_predict_in_a_fresh_one():
    """A training worker's default process group leaves no room for the trace's fake one."""
    import torch.distributed as dist

    from zerolens.predict.peak import predict_or_why_not
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        predicted = predict_or_why_not("ddp", PRESETS["gpt-tiny"], TrainSettings(precision="bf16", world_size=1))
    finally:
        dist.destroy_process_group()
    assert "predict in a fresh process" in predicted["why_not"]


def saved_run_config(folder, **settings):
    """A run's config, saved in `folder` as config.json (as zerolens saves it before the workers start)."""
    from zerolens.run.config import RunConfig, save_config
    config = RunConfig(**{"strategies": ("fsdp2-grad", "fsdp2"), "baseline": "fsdp2-grad", "nproc": 3,
                          "preset": "gpt-tiny", "model": PRESETS["gpt-tiny"], "micro_batch": 2, **settings})
    save_config(config, folder / "config.json", "test")
    return config


@pytest.mark.slow
def test_a_fresh_process_predicts_what_this_one_does(tmp_path):
    """What a training worker's rank 0 runs: the run folder's config.json in, predicted_peaks.json
    out, each FSDP2 rank traced (the last one of 3 keeps fewer rows of gpt-tiny's parameters). The
    first FSDP2 trace in a process counts no DTensor shape work (fake global-size tensors, made
    once per process): its step peaks as every later step's."""
    from zerolens.run.prediction import PREDICTED_PEAKS, predict_in_fresh_process
    config = saved_run_config(tmp_path)
    predicted = predict_in_fresh_process(config, tmp_path, None)
    assert json.loads((tmp_path / PREDICTED_PEAKS).read_text()) == predicted
    settings = config.train_settings()
    for name in config.strategies:
        ranks = predicted[name]["ranks"]
        assert ranks[2]["peak_during_step"] < ranks[0]["peak_during_step"]
        assert ranks[2] == predict_peaks(name, config.model, settings, rank=2)
        assert all(r["peak_during_step"] == r["last_step"]["peak_during_step"] for r in ranks)


def test_each_rank_predicts_its_share_and_rank_0_gathers_them(tmp_path):
    """verify's ranks each predict every world_size-th strategy in a process of their own (none where there
    are fewer strategies than ranks); rank 0 gathers the parts, in the run's order of strategies, into
    predicted_peaks.json and removes them; a rank whose part is missing leaves its strategies a why_not."""
    from zerolens.run.prediction import PREDICTED_PEAKS, gathered, part_name, share_of
    strategies = ("ddp", "zero0", "zero1", "zero2", "fsdp2")
    assert [share_of(strategies, r, 2) for r in range(2)] == [("ddp", "zero1", "fsdp2"), ("zero0", "zero2")]
    assert share_of(("ddp",), 1, 2) == ()
    config = saved_run_config(tmp_path, strategies=("fsdp2-grad", "fsdp2", "ddp"))
    (tmp_path / part_name(0)).write_text(json.dumps({"fsdp2-grad": {"ranks": [1]}}))
    (tmp_path / part_name(2)).write_text(json.dumps({"ddp": {"ranks": [3]}}))
    predicted = gathered(config, tmp_path, 4)  # rank 1's part (fsdp2) missing; rank 3 had none to make
    assert list(predicted) == ["fsdp2-grad", "fsdp2", "ddp"]
    assert predicted["ddp"] == {"ranks": [3]} and predicted["fsdp2"] == {"why_not": "rank 1's prediction wrote nothing"}
    assert json.loads((tmp_path / PREDICTED_PEAKS).read_text()) == predicted
    assert not list(tmp_path.glob("predicted_peaks.rank*"))


def test_a_ranks_prediction_process_opens_its_cuda_context_on_the_ranks_own_gpu(monkeypatch):
    """Each rank's prediction process sees the rank's GPU alone (as the rank's CUDA_VISIBLE_DEVICES numbers it):
    without it, every rank's trace opened a CUDA context on GPU 0."""
    import torch

    from zerolens.run.prediction import on_own_gpu
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert on_own_gpu(torch.device("cuda", 3))["CUDA_VISIBLE_DEVICES"] == "3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert on_own_gpu(torch.device("cuda", 1))["CUDA_VISIBLE_DEVICES"] == "5"
    assert on_own_gpu(torch.device("cpu")) is None


def test_a_prediction_that_fails_or_takes_too_long_leaves_each_strategy_why_not(tmp_path):
    """The run goes on without a prediction: each strategy says why, with what the process said."""
    from zerolens.run.prediction import PREDICTED_PEAKS, predict_in_fresh_process
    config = saved_run_config(tmp_path, timeout=0.2)  # half of it for the prediction: too little to start
    predicted = predict_in_fresh_process(config, tmp_path, None)
    assert predicted["fsdp2"]["why_not"] == "the prediction took more than 0.1 s, and its process was ended"
    assert json.loads((tmp_path / PREDICTED_PEAKS).read_text()) == predicted
    config = saved_run_config(tmp_path)
    (tmp_path / "config.json").unlink()
    predicted = predict_in_fresh_process(config, tmp_path, None)
    assert predicted["fsdp2"]["why_not"].startswith("the prediction's process failed (exit code 1: FileNotFoundError")
    assert "Traceback" in predicted["fsdp2"]["traceback"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp2", "zero3"])
@pytest.mark.parametrize("preset, world_size", [("case-study", 5), ("gpt-tiny", 3)])
def test_ranks_traced_once_for_others_would_trace_the_same(name, preset, world_size):
    """predict_or_why_not traces one rank per retained layout (ranks_alike); every rank's own trace
    gives the same peaks as the rank that stands for it."""
    from zerolens.predict.peak import ranks_alike
    settings = TrainSettings(precision="bf16", world_size=world_size, micro_batch=2)
    alike = ranks_alike(name, PRESETS[preset], settings)
    own = {rank: predict_peaks(name, PRESETS[preset], settings, rank=rank, cuda_capability=(9, 0))
           for rank in range(world_size)}
    keys = ("peak_during_forward", "peak_during_backward", "peak_during_step", "held_after_step_bytes")
    for rank, like in alike.items():
        assert [own[rank][k] for k in keys] == [own[like][k] for k in keys], (rank, like)
    if name == "fsdp2" and preset == "gpt-tiny":
        assert len(set(alike.values())) == 2  # the last rank keeps fewer rows: traced apart


def test_the_report_shows_fragmentation_beside_the_prediction_on_cuda():
    """On CUDA each phase's reserved peak and its excess over the allocated peak sit beside the predicted
    (as asked and as the allocator counts it) and measured peaks, and the run's reserved peak beside
    the allocator model's; on the CPU there is no allocator."""
    from zerolens.report.render import peak_prediction_section
    phases = ("forward", "backward", "step")
    predicted = {f"peak_during_{ph}": 100 * 2**20 for ph in phases} | {
        "peak_bytes": 100 * 2**20, "target": "cuda",
        "reserved_peak_bytes": {"default": 118 * 2**20, "expandable_segments": 102 * 2**20},
        "min_allocator_cap_bytes": {"default": 110 * 2**20, "expandable_segments": 102 * 2**20},
        "allocated_phase_peaks": {"default": {ph: 101 * 2**20 for ph in phases},
                                  "expandable_segments": {ph: 100 * 2**20 for ph in phases}}}
    rank = {"rank": 0, "predicted_peaks": predicted, **{f"peak_during_{ph}": 101 * 2**20 for ph in phases},
            **{f"reserved_peak_during_{ph}": 120 * 2**20 for ph in phases}, "reserved_peak_bytes": 120 * 2**20,
            "outside_allocator_after_step": 1300 * 2**20}
    section = peak_prediction_section({"device": "cuda", "strategies": {"zero2": {"ranks": [rank]}}})
    assert "reserved - allocated" in section
    # the bytes asked, then as the allocator model counts them (the run's setting: the default)
    assert "| zero2 | 0 | forward | 100.000 | 101.000 | -0.99% | 101.000 | +0.00% | 120.000 | 19.000 |" in section
    assert "| zero2 | 0 | 118.000 | 120.000 | -1.67% | 110.000 | 1300.000 |" in section
    cpu = {**rank, "predicted_peaks": predicted | {"target": "cpu", "last_step": predicted}}
    assert "reserved" not in peak_prediction_section({"device": "cpu", "strategies": {"zero2": {"ranks": [cpu]}}})


def test_fsdp2s_collective_buffers_are_on_streams_of_their_own():
    """FSDP2 makes its all-gather buffers on its copy-in stream and its reduce outputs on its
    reduce-scatter stream (torch.cpu keeps the current stream as torch.cuda does): the trace numbers
    each request's stream, a free is on its allocation's, and DDP, which has no side stream, is all
    on stream 0. With the streams kept apart the allocator reserves at least as much as with one."""
    from zerolens.predict.allocator import run_requests
    settings = TrainSettings(precision="bf16", world_size=2, micro_batch=2)
    streams = {}
    for name in ("fsdp2", "ddp"):
        requests = []
        predict_peaks(name, PRESETS["gpt-tiny"], settings, steps=1, cuda_capability=(9, 0), trace_on="cpu",
                      requests=requests)
        made_on = {ident: stream for action, ident, _, stream in requests if action == "alloc"}
        assert all(made_on[ident] == stream for action, ident, _, stream in requests if action == "free")
        streams[name] = {stream for *_, stream in requests}
        if name == "fsdp2":
            one_stream = [(action, ident, size, 0) for action, ident, size, _ in requests]
            assert run_requests(requests).reserved_peak >= run_requests(one_stream).reserved_peak
    assert streams == {"fsdp2": {0, 1, 2}, "ddp": {0}}


def numbered(requests: list) -> list:
    """A sequence with each allocation named by its place among the allocations: two traces' compare."""
    ids, out, allocations = {}, [], 0
    for action, ident, size, stream in requests:
        if action == "alloc":  # a name alive once at a time may be allocated again
            ids[ident], allocations = allocations, allocations + 1
        out.append((action, ids[ident] if action in ("alloc", "free") else ident, size, stream))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name, preset, precision, world_size, cuda, bucket, deepspeed", [
    ("zero2", "gpt-tiny", "bf16", 5, None, 20_000, None),  # small buckets: each rank's buffer made at its own reduction
    ("zero1", "gpt-tiny", "fp32", 3, None, 50_000_000, None),  # fp32: the norm's copies are the views themselves
    ("zero2", "case-study", "fp16", 4, (9, 0), 500_000, None),  # a CUDA target: sizes in whole 512 bytes
    ("zero1", "gpt-tiny", "bf16", 7, (9, 0), 20_000, None),
    # The overflow check before 0.19.6: an fp32 copy and masks of each of the slice's pieces in turn
    ("zero2", "gpt-tiny", "fp16", 5, (9, 0), 20_000, "0.16.9"),
    ("zero1", "gpt-tiny", "bf16", 3, None, 20_000, "0.18.9"),
    ("zero2", "gpt-tiny", "bf16", 4, None, 20_000, "0.19.5"),
])
def test_zero12s_one_trace_spliced_for_every_rank_is_each_ranks_own_trace(name, preset, precision, world_size, cuda,
                                                                        bucket, deepspeed, monkeypatch):
    """ZeRO-1/2 trace rank 0 once and splice each rank's gradient buffer, slice pieces and padding into its
    sequence: each rank's sequence, request for request, and every figure (peaks per phase and step, held,
    the allocator's needs) equal what that rank's own trace gives."""
    from zerolens.predict.peak import (
        cuda_bytes,
        plain_requests,
        predict_or_why_not,
        rank_outcome,
        spliced_ranks,
        spliced_requests,
        traced_rank,
    )
    from zerolens.strategies.deepspeed import DeepSpeedStepModel
    if deepspeed:  # the step model as it follows that release (the trace runs in this process)
        import zerolens.compat
        installed = zerolens.compat.installed_version
        monkeypatch.setattr(zerolens.compat, "installed_version",
                            lambda package: deepspeed if package == "deepspeed" else installed(package))
    settings = TrainSettings(precision=precision, world_size=world_size, micro_batch=2, reduce_bucket_size=bucket,
                             grad_overflow_check=True if precision == "bf16" else None)
    assert DeepSpeedStepModel(settings, rank=0, cuda=bool(cuda), stage=1).overflow_check == (
        "masks" if deepspeed else None if precision == "fp32" else "scalars")  # 0.19.8 installed
    spliced = spliced_ranks(name, PRESETS[preset], settings, cuda_capability=cuda, trace_on="cpu")
    records = [traced_rank(name, PRESETS[preset], settings, rank=rank, cuda_capability=cuda, trace_on="cpu",
                           brackets=True, outcome=False)[1] for rank in range(world_size)]
    own = [rank_outcome(record | {"brackets": False}) for record in records]
    assert spliced == own
    tracked_bytes = cuda_bytes if cuda else (lambda size: size)
    for rank, record in enumerate(records):
        made = plain_requests(spliced_requests(records[0]["requests"], records[0]["step_model"].rank_requests(rank),
                                               tracked_bytes))
        assert numbered(made) == numbered(plain_requests(record["requests"])), f"rank {rank}"
    # The ranks do allocate differently: gradient buffers of different sizes
    from zerolens.models.model import parameter_shapes
    from zerolens.strategies.layout import zero_partition_layout
    layout = zero_partition_layout([s.numel() for s in parameter_shapes(PRESETS[preset])], world_size)
    assert len({part.grad_buffer_elements for part in layout}) > 1
    assert predict_or_why_not(name, PRESETS[preset], settings, cuda_capability=cuda, trace_on="cpu")["ranks"] == own


def test_ranks_whose_requests_are_alike_make_the_same_requests_in_every_bracket():
    """At many ranks most of ZeRO-1/2's slices lie inside one parameter: their requests' `alike` is the
    same, and spliced_ranks walks the brackets once for them. Each rank's walk equals that of the first
    rank alike, bracket for bracket (the content), and in every figure."""
    from zerolens.predict.peak import cuda_bytes, rank_peaks, traced_rank, without_brackets
    settings = TrainSettings(precision="bf16", world_size=64, micro_batch=2, reduce_bucket_size=20_000)
    record = traced_rank("zero2", PRESETS["gpt-tiny"], settings, cuda_capability=(9, 0), brackets=True,
                         outcome=False)[1]
    base, _ = without_brackets(record["requests"])
    first_alike = {}
    for rank in range(settings.world_size):
        own = record["step_model"].rank_requests(rank)
        first = first_alike.setdefault(own.alike, rank)
        assert rank_peaks(base, own, cuda_bytes) == \
            rank_peaks(base, record["step_model"].rank_requests(first), cuda_bytes), f"rank {rank}"
    assert 1 < len(first_alike) < settings.world_size / 2  # the test means something: ranks alike and not


@pytest.mark.slow
def test_the_allocator_model_replays_the_neediest_distinct_sequences_where_there_are_too_many(monkeypatch):
    """At thousands of ranks ZeRO-2's ranks make hundreds of distinct sequences, each a replay of seconds:
    the allocator model replays the ALLOCATOR_REPLAYS with the highest allocated peaks, exactly; the other
    ranks say so and carry no allocator figures (plan asks only for the neediest: the next test)."""
    from zerolens.predict import peak
    monkeypatch.setattr(peak, "ALLOCATOR_REPLAYS", 2)
    settings = TrainSettings(precision="bf16", world_size=7, micro_batch=2, reduce_bucket_size=20_000)
    spliced = peak.spliced_ranks("zero2", PRESETS["gpt-tiny"], settings, cuda_capability=(9, 0), trace_on="cpu")
    replayed = [r for r in spliced if "min_allocator_cap_bytes" in r]
    others = [r for r in spliced if "min_allocator_cap_bytes" not in r]
    assert replayed and others and all("allocator_not_replayed" in r for r in others)
    assert min(r["peak_bytes"] for r in replayed) >= max(r["peak_bytes"] for r in others)
    for rank, predicted in enumerate(spliced):
        if predicted in replayed:
            own = predict_peaks("zero2", PRESETS["gpt-tiny"], settings, rank=rank, cuda_capability=(9, 0),
                                trace_on="cpu")
            assert predicted == own


def test_plans_neediest_caps_are_the_highest_of_every_ranks():
    """plan asks of ZeRO-2's ranks only the smallest caps that could be the highest (allocator.neediest_needs):
    every rank's reserved and allocated peaks as before, and per allocator setting the highest smallest cap,
    and every rank that has it, as where each rank's cap is searched."""
    from zerolens.predict import peak
    settings = TrainSettings(precision="bf16", world_size=7, micro_batch=2, reduce_bucket_size=20_000)
    every, neediest = (peak.spliced_ranks("zero2", PRESETS["gpt-tiny"], settings, cuda_capability=(9, 0),
                                          trace_on="cpu", allocator_caps=caps) for caps in ("every", "neediest"))
    for setting in ("default", "expandable_segments"):
        caps = {r: ranks["min_allocator_cap_bytes"][setting] for r, ranks in enumerate(every)}
        found = {r: ranks["min_allocator_cap_bytes"][setting] for r, ranks in enumerate(neediest)
                 if setting in ranks["min_allocator_cap_bytes"]}
        highest = max(caps.values())
        assert max(found.values()) == highest and all(caps[r] == cap for r, cap in found.items())
        assert {r for r, cap in caps.items() if cap == highest} <= set(found)
    for a, b in zip(every, neediest):
        assert {k: v for k, v in a.items() if k != "min_allocator_cap_bytes"} == \
            {k: v for k, v in b.items() if k != "min_allocator_cap_bytes"}


@pytest.mark.slow
def test_the_first_fsdp2_trace_of_a_process_is_the_next_ones():
    """DTensor works out an op's output shape on fake tensors of the global shape the first time a process
    meets it; the trace keeps them out of its count, so FSDP2's first trace in a fresh process makes the
    same allocations as the next (it made an alloc-free pair more per parameter in its set-up)."""
    code = """
import json
from zerolens.models.model import PRESETS
from zerolens.predict.peak import traced_rank
from zerolens.strategies import TrainSettings
settings = TrainSettings(precision="bf16", micro_batch=2, world_size=8)
out = []
for _ in range(2):
    peaks, record = traced_rank("fsdp2-grad", PRESETS["gpt-tiny"], settings, cuda_capability=(9, 0))
    out.append([[r[0], r[2], r[3]] for r in record["requests"]] + [peaks["min_allocator_cap_bytes"]])
print(json.dumps(out))
"""
    result = run([sys.executable, "-c", code], timeout=120)
    assert result.returncode == 0, result.stderr
    first, second = json.loads(result.stdout.splitlines()[-1])
    assert first == second


def test_a_traces_totals_count_the_traced_device_only():
    """A trace on fake CUDA tensors also meets CPU tensors that take no GPU memory (AdamW's step counts,
    made on the CPU unless fused or capturable): its peaks count the traced device's storages only. Counted
    with them, a second step written from the first (predict/repeat.py) was 4 bytes short of the traced
    one on the GPU machine, and the check that allows writing it failed for every strategy. Here meta
    tensors stand for the other device."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from zerolens.measure.tracker import tracker_total
    with MemTracker() as tracker:
        on_meta, on_cpu = torch.empty(1000, device="meta"), torch.empty(10)
        assert tracker_total(tracker, "current", "cpu") == on_cpu.nbytes
        assert tracker_total(tracker, "current", "meta") == on_meta.nbytes
        assert tracker_total(tracker, "current") == on_cpu.nbytes + on_meta.nbytes


def test_autograd_sums_a_second_gradient_in_place_and_a_cuda_targets_trace_does_too():
    """torch's autograd engine adds a tensor's second gradient into the first where it holds the last
    reference (InputBuffer::accumulate), so no block is made for the sum; a fake tensor is summed out of
    place. A CUDA target's trace follows the engine (no block for the sum, in the peak or the
    allocator's sequence); a CPU target's does not, as its measurement under torch's MemTracker, a
    dispatch mode, sums out of place too."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zerolens.measure.tracker import reset_tracker_peak, tracker_total
    from zerolens.predict.peak import totals_tracker

    def leaves():
        return [torch.randn(64, 64, requires_grad=True) for _ in range(3)]

    def two_gradients(x, w, v):  # h's gradient comes from two products
        h = x.exp()
        return h, h * w, h * v

    x, w, v = leaves()
    h, a, b = two_gradients(x, w, v)
    firsts, sums = [], []
    for node in (a.grad_fn, b.grad_fn):
        node.register_hook(lambda grad_inputs, grad_outputs: firsts.append(grad_inputs[0].data_ptr()))
    h.register_hook(lambda grad: sums.append(grad.data_ptr()))
    (a.sum() + b.sum()).backward()
    assert sums[0] in firsts  # the sum is in the first gradient's memory

    def traced(in_place_sums: bool):
        requests = []
        tracker = totals_tracker(requests, "cpu", in_place_sums=in_place_sums)
        with FakeTensorMode(), tracker:
            _, a, b = two_gradients(*leaves())
            loss = a.sum() + b.sum()
            reset_tracker_peak(tracker)
            loss.backward()
            tracker.settle()
            return tracker_total(tracker, "peak"), len([r for r in requests if r[0] == "alloc"])
    (peak_in_place, allocs_in_place), (peak_out, allocs_out) = traced(True), traced(False)
    assert peak_out - peak_in_place == 64 * 64 * 4 and allocs_out - allocs_in_place == 1


def test_under_accumulation_the_cublas_workspaces_are_allocated_once():
    """The first step's first matrix products allocate cuBLAS's workspaces, once per phase: a second
    micro-batch's forward and backward allocated them again (a duplicate request the allocator model
    never freed: 65 MiB more counted at every phase after, on gpt-tiny at two micro-batches)."""
    from zerolens.predict.peak import WORKSPACE_ID, plain_requests, traced_rank
    settings = TrainSettings(precision="bf16", world_size=1, micro_batch=2, grad_accum=2)
    _, record = traced_rank("ddp", PRESETS["gpt-tiny"], settings, cuda_capability=(9, 0), steps=2)
    workspaces = [r[1] for r in plain_requests(record["requests"])
                  if r[0] == "alloc" and str(r[1]).startswith(WORKSPACE_ID)]
    assert workspaces and len(workspaces) == len(set(workspaces))


@pytest.mark.parametrize("rows, n", [(10, 4), (5, 8), (64, 512), (7, 7)])
def test_fsdp2s_shards_made_when_read_are_torch_chunks_views(rows, n):
    import torch

    from zerolens.strategies.fsdp2 import ChunksWhenRead
    tensor = torch.zeros(rows, 3)
    chunks = list(torch.chunk(tensor, n))
    read = ChunksWhenRead(tensor, n, 0)
    assert len(read) == n
    for i in range(n):
        if i < len(chunks):
            assert (read[i].shape, read[i].stride(), read[i].storage_offset()) == \
                (chunks[i].shape, chunks[i].stride(), chunks[i].storage_offset())
        else:
            assert read[i].numel() == 0
    assert read[-1].shape == (read[n - 1]).shape


@pytest.mark.slow
def test_an_fsdp2_trace_at_many_ranks_allocates_as_with_every_chunk_made(monkeypatch):
    """The step model's set-up makes a shard's chunks when read (fsdp2.chunks_when_read); the trace's
    allocations are those of torch's own _chunk_with_empty, on the last rank of 100 (empty shards)."""
    import contextlib

    from zerolens.predict.peak import traced_rank
    from zerolens.strategies import fsdp2
    settings = TrainSettings(precision="bf16", micro_batch=2, world_size=100)
    made = traced_rank("fsdp2", PRESETS["gpt-tiny"], settings, rank=99, cuda_capability=(9, 0))[1]
    monkeypatch.setattr(fsdp2, "chunks_when_read", contextlib.nullcontext)
    whole = traced_rank("fsdp2", PRESETS["gpt-tiny"], settings, rank=99, cuda_capability=(9, 0))[1]
    assert made["requests"] == whole["requests"] and made["phase_peaks"] == whole["phase_peaks"]


def test_a_traces_sequence_ends_with_the_trace():
    """A trace's storages die when its step model is dropped, after the trace: MemTracker still reports each,
    and they were appended to the record's sequence as frees (every optimizer state freed at its end)."""
    import gc

    from zerolens.predict.peak import traced_rank
    settings = TrainSettings(precision="bf16", world_size=2, micro_batch=2)
    _, record = traced_rank("fsdp2", PRESETS["gpt-tiny"], settings, cuda_capability=(9, 0), trace_on="cpu")
    ended = list(record["requests"])
    record.pop("step_model")
    gc.collect()
    assert record["requests"] == ended


@pytest.mark.parametrize("release, precision, flag, check", [
    ("0.16.9", "fp16", None, "masks"), ("0.16.9", "bf16", True, None), ("0.17.0", "bf16", True, None),
    ("0.17.1", "bf16", None, None), ("0.17.1", "bf16", True, "masks"), ("0.19.2", "bf16", None, None),
    ("0.19.3", "bf16", None, "masks"), ("0.19.5", "fp16", None, "masks"), ("0.19.6", "bf16", None, "scalars"),
    ("0.19.8", "bf16", False, None), ("0.19.8", "fp32", None, None), (None, "fp16", None, "scalars"),
])
def test_zero12s_overflow_check_is_each_deepspeed_releases(release, precision, flag, check):
    """Which runs DeepSpeed's ZeRO-1/2 step checks for inf and NaN, and how, per release (read from each
    one's stage_1_and_2.py, engine.py and precision_config.py): bf16's setting read from 0.17.1, on by
    default from 0.19.3, scalars instead of masks from 0.19.6; fp16 always checked, fp32 never."""
    from zerolens.strategies.deepspeed import zero12_overflow_check
    settings = TrainSettings(precision=precision, grad_overflow_check=flag)
    assert zero12_overflow_check(settings, release) == check


def test_a_trace_thaws_what_it_froze_unless_the_process_is_zerolenss(monkeypatch):
    """traced_rank freezes what is alive before it (on_a_collected_heap): a caller's objects are thawed
    after, so that Python collects them as before; zerolens's own processes keep them frozen."""
    import gc

    from zerolens.predict import peak
    settings = TrainSettings(precision="bf16", world_size=2, micro_batch=2)
    gc.unfreeze()
    peak.traced_rank("ddp", PRESETS["gpt-tiny"], settings)
    assert gc.get_freeze_count() == 0
    monkeypatch.setattr(peak, "THAW_AFTER_TRACE", False)
    try:
        peak.traced_rank("ddp", PRESETS["gpt-tiny"], settings)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
