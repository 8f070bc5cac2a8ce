"""`zerolens plan`: what fits a GPU's memory, predicted on fake tensors (no GPU, no process group)."""
import dataclasses
import json

import pytest

from zerolens.commands import plan
from zerolens.errors import UserError
from zerolens.models.model import PRESETS
from zerolens.predict.allocator import OUTSIDE_ALLOCATOR_MEASURED
from zerolens.predict.micro_batches import MicroBatchScaling
from zerolens.run.config import RunConfig
from zerolens.units import GiB, MiB

# What a DeepSpeed process holds outside the allocator: the memory below gives each allocator 80 MiB or more.
OUTSIDE = OUTSIDE_ALLOCATOR_MEASURED["deepspeed"]


def tiny(*strategies) -> RunConfig:
    return RunConfig(strategies=strategies, baseline=strategies[0], device="cuda", preset="gpt-tiny",
                     model=PRESETS["gpt-tiny"])


@pytest.mark.parametrize("text, size", [("80GiB", 80 * GiB), ("81920MiB", 80 * GiB), ("80GB", 80 * 10**9),
                                        ("24", 24 * GiB), ("0.5 gib", GiB // 2), ("1e3MiB", 1000 * MiB)])
def test_memory_sizes(text, size):
    assert plan.parse_memory(text) == size


@pytest.mark.parametrize("text", ["", "lots", "-1GiB", "0", "80 GiBs", "80KiB"])
def test_a_size_it_cannot_read_is_a_user_error(text):
    with pytest.raises(UserError, match="--gpu-memory"):
        plan.parse_memory(text)


@pytest.mark.slow
def test_what_fits_is_within_memory_and_what_does_not_is_said():
    """ZeRO-2's 50M-element bf16 bucket (95 MiB) cannot fit in 80 MiB for the allocator at any
    micro-batch; DDP fits at small micro-batches, and stops being tried at the first that does not fit.
    What a configuration needs is its smallest allocator cap and what the process holds outside."""
    memory = OUTSIDE + 80 * MiB
    result = plan.plan(tiny("ddp", "zero2"), memory=memory, micro_batches=[1, 2, 4, 64], reduce_bucket_sizes=[50_000_000],
                       cuda_capability=(9, 0), depth_search=False)
    assert result["fits"] and all(r["needs_bytes"] <= memory and r["strategy"] == "ddp" for r in result["fits"])
    # each also run under the memory itself, less what the process holds outside the allocator
    assert all(r["runs_in_memory"] for r in result["fits"])
    for r in result["fits"] + result["does_not_fit"]:
        assert r["needs_bytes"] == r["min_allocator_cap_bytes"] + r["outside_allocator_bytes"]
        assert r["min_allocator_cap_bytes"] >= r["peak_bytes"]  # no cap below the allocated peak
        assert r["min_allocator_cap_bytes"] <= r["reserved_peak_bytes"]  # the uncapped reserve always runs
        assert r["outside_allocator_bytes"] == OUTSIDE_ALLOCATOR_MEASURED["deepspeed" if r["strategy"] == "zero2" else "torch"]
    assert all(r["headroom_bytes"] == memory - r["needs_bytes"] for r in result["fits"])
    assert all(r["barely"] == (r["headroom_bytes"] < plan.PREDICTION_MARGIN * memory) for r in result["fits"])
    failing = {(r["strategy"], r["micro_batch"], r["checkpointing"]) for r in result["does_not_fit"]}
    assert ("zero2", 1, False) in failing and ("zero2", 1, True) in failing
    assert all(r["needs_bytes"] > memory or not r["runs_in_memory"] for r in result["does_not_fit"])
    # Those with room first, then the cheapest: no recomputation before recomputation, then fewer bytes
    # sent per sample.
    keys = [plan.cost_key(r) for r in result["fits"]]
    assert keys == sorted(keys)
    # What a configuration needs grows with the micro-batch: a larger one than a failing one is not tried.
    ddp_plain = {r["micro_batch"] for r in result["fits"] + result["does_not_fit"]
                 if r["strategy"] == "ddp" and not r["checkpointing"]}
    assert 64 not in ddp_plain or max(ddp_plain) == 64


def test_expandable_segments_are_said_where_they_would_make_it_fit(monkeypatch):
    """Between a configuration's need with expandable segments and with the default allocator, it fits
    only with expandable segments, and plan says so with the bytes saved."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    config = RunConfig(strategies=("zero2",), baseline="zero2", device="cuda", preset="case-study",
                       model=PRESETS["case-study"], precision="fp16", micro_batch=16)
    needs = plan.predicted_peak(config, (9, 0))
    assert needs["needs_expandable_bytes"] < needs["needs_bytes"]  # pages mapped as needed waste less
    memory = needs["needs_expandable_bytes"]
    result = plan.plan(config, memory=memory, micro_batches=[1, 16], reduce_bucket_sizes=[50_000_000],
                       cuda_capability=(9, 0), depth_search=False)
    rescued = [r for r in result["does_not_fit"] if r["fits_with_expandable_segments"]]
    assert rescued
    # What fits with the default allocator is not replayed with expandable segments
    assert result["fits"] and all(r["needs_expandable_bytes"] is None and r["fits_with_expandable_segments"] is None
               for r in result["fits"])
    saved = rescued[0]["needs_bytes"] - rescued[0]["needs_expandable_bytes"]
    text = "\n".join(str(line) for line in plan.render_plan(result, top=5))
    assert "With PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True these would fit" in text
    assert f"{saved / MiB:.0f} MiB less" in text
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # then the need is the expandable one
    assert plan.predicted_peak(config, (9, 0))["needs_bytes"] == memory


@pytest.mark.slow
def test_the_deepest_model_fits_and_one_layer_more_does_not():
    memory = OUTSIDE_ALLOCATOR_MEASURED["torch"] + 84 * MiB
    lines = []
    deepest = plan.largest_depth(tiny("ddp"), memory, (9, 0), progress=lines.append)
    assert deepest["max_depth"] >= 2
    assert deepest["needs_bytes"] <= memory < deepest["next_needs_bytes"]
    assert deepest["traced"][str(deepest["max_depth"] + 1)] == deepest["next_needs_bytes"]
    # each trial is told as it ends
    assert len(lines) == len(deepest["traced"]) and lines[0].startswith("ddp: 1 layer needs ")
    assert any(line.endswith("more than the memory") for line in lines)


def test_where_not_one_layer_fits_under_any_strategy_plan_says_so_in_a_line():
    """A large vocabulary's logits at the default micro-batch (a Qwen2-0.5B shape, 8 ranks of 24 GiB: one layer
    needs 36 GiB under every strategy): no table of zeros, but the micro-batch at which it fits at its depth."""
    row = {"strategy": "zero2", "micro_batch": 2, "checkpointing": False, "reduce_bucket_size": 50_000_000,
           "peak_bytes": 14 * GiB, "needs_bytes": 19 * GiB, "headroom_bytes": 5 * GiB, "barely": False, "rank": 0,
           "sent_per_step_bytes": 2 * GiB, "sent_per_sample_bytes": GiB}
    none = {"max_depth": 0, "params": 0, "needs_bytes": None, "depth_scaled_from": {}}
    result = {"model": "hf:qwen.json", "params": 494_032_768, "width": 896, "world_size": 8, "precision": "bf16",
              "gpu_memory_bytes": 24 * GiB, "allocator_setting": "default", "cuda_capability": "9.0",
              "traced_on": "cpu", "micro_batches": [1, 2, 4], "reduce_bucket_sizes": [50_000_000], "fits": [row],
              "does_not_fit": [], "not_predicted": {},
              "deepest": {"micro_batch": 8, "checkpointing": False, "strategies": {
                  "ddp": none | {"next_needs_bytes": 37 * GiB, "traced": {"1": 37 * GiB}},
                  "zero2": none | {"next_needs_bytes": 36 * GiB, "traced": {"1": 36 * GiB}}}}}
    text = "\n".join(str(line) for line in plan.render_plan(result, top=5))
    assert "at micro-batch 8, ckpt off: none, not one layer fits (one layer needs 36.00 GiB under zero2" in text
    assert "--micro-batch 2 searches the depth there" in text and "one layer more" not in text
    # Where one strategy fits a layer, the table stays: it says how deep each goes
    result["deepest"]["strategies"]["zero2"] |= {"max_depth": 3, "params": 60_000_000, "needs_bytes": 23 * GiB}
    text = "\n".join(str(line) for line in plan.render_plan(result, top=5))
    assert "(width 896) each strategy can train, predicted, at micro-batch 8" in text and "none, not one" not in text
    # A strategy that still fits at the search's cap: "≥", and a line saying the search stopped there
    result["deepest"]["strategies"]["zero2"] |= {"max_depth": plan.MAX_DEPTH, "at_search_cap": True,
                                                 "next_needs_bytes": None}
    text = "\n".join(str(line) for line in plan.render_plan(result, top=5))
    assert f"≥ {plan.MAX_DEPTH}" in text
    assert f"≥ {plan.MAX_DEPTH}: zero2 still fits at {plan.MAX_DEPTH} layers, where the search stops" in text


@pytest.mark.slow
def test_the_depth_search_starts_at_the_config_depth_the_grid_predicted(monkeypatch):
    """The depth search's first deep trial is the config's own depth, whose prediction the grid's walk made
    already: taken from it, not traced again."""
    config = dataclasses.replace(tiny("ddp"), micro_batch=2)
    memory = OUTSIDE_ALLOCATOR_MEASURED["torch"] + 84 * MiB
    calls = []
    real = plan.predicted_peak
    monkeypatch.setattr(plan, "predicted_peak", lambda c, cap, trace=None, memory=None: calls.append(
        (c.model.num_layers, c.micro_batch, isinstance(trace, MicroBatchScaling))) or real(c, cap, trace=trace,
                                                                                            memory=memory))
    result = plan.plan(config, memory=memory, micro_batches=[1, 2], reduce_bucket_sizes=[config.reduce_bucket_size],
                       cuda_capability=(9, 0))
    deepest = result["deepest"]["strategies"]["ddp"]
    start = config.model.num_layers
    grid = next(r for r in result["fits"] + result["does_not_fit"] if r["micro_batch"] == 2 and not r["checkpointing"])
    assert deepest["traced"][str(start)] == grid["needs_bytes"]
    assert (start, 2, False) not in calls and (start, 2, True) in calls  # the walk's, not the search's
    assert (1, 2, False) in calls


def test_a_depth_the_model_cannot_be_built_at_ends_the_search_with_the_reason():
    """A Hugging Face model whose layer_types has no pattern to repeat cannot be built deeper (hf.at_depth):
    the depth search says why, and plan goes on, its grid kept."""
    def predict(config, cap, memory):
        if config.model.num_layers > 4:
            raise UserError("the model's layer_types (4 layers) has no repeating pattern")
        return {"needs_bytes": config.model.num_layers * GiB}
    deepest = plan.largest_depth(dataclasses.replace(tiny("ddp"), model=dataclasses.replace(tiny("ddp").model,
                                                                                           num_layers=4)),
                                 40 * GiB, (9, 0), predict=predict)
    assert deepest["max_depth"] == 0 and "no repeating pattern" in deepest["why_not"]


@pytest.mark.slow
def test_a_bigger_bucket_is_a_configuration_of_its_own():
    result = plan.plan(tiny("zero2"), memory=2 * GiB, micro_batches=[1], reduce_bucket_sizes=[200_000, 50_000_000],
                       cuda_capability=(9, 0), depth_search=False)
    peaks = {r["reduce_bucket_size"]: r["peak_bytes"] for r in result["fits"] if not r["checkpointing"]}
    assert set(peaks) == {200_000, 50_000_000} and peaks[50_000_000] > peaks[200_000]


@pytest.mark.slow
def test_plan_command_json(cli):
    result = cli("plan", "--preset", "gpt-tiny", "--gpu-memory", f"{(OUTSIDE + 80 * MiB) // MiB}MiB", "--strategies", "ddp,zero2",
                      "--micro-batches", "1,4", "--reduce-bucket-sizes", "5e7", "--no-depth", "--jobs", "1", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["gpu_memory_bytes"] == (OUTSIDE + 80 * MiB) // MiB * MiB and out["world_size"] == 2 and out["precision"] == "bf16"
    assert {r["strategy"] for r in out["fits"]} == {"ddp"}
    assert {r["strategy"] for r in out["does_not_fit"]} == {"zero2"}
    assert all(r["sent_per_step_bytes"] > 0 for r in out["fits"])
    import torch
    assert out["traced_on"] == ("gpu" if torch.cuda.is_available() else "cpu")  # where the peaks were traced


def test_a_deepspeed_configs_bucket_is_the_one_planned_with(cli):
    """DeepSpeed uses the bucket size of the user's config, so plan does: ZeRO-2's 95 MiB default
    bucket does not fit 80 MiB beside what the process holds outside the allocator, a 1000-element one does."""
    override = '{"zero_optimization": {"reduce_bucket_size": 1000}}'
    memory = f"{(OUTSIDE + 80 * MiB) // MiB}MiB"
    result = cli("plan", "--preset", "gpt-tiny", "--gpu-memory", memory, "--strategies", "zero2",
                      "--micro-batches", "1", "--no-depth", "--jobs", "1", "--ds-override", override, "--json")
    assert result.returncode == 0, result.stderr
    fits = json.loads(result.stdout)["fits"]
    assert fits and all(r["strategy"] == "zero2" and r["reduce_bucket_size"] == 1000 for r in fits)
    result = cli("plan", "--preset", "gpt-tiny", "--gpu-memory", "80MiB", "--reduce-bucket-sizes", "1e6,2e6",
                      "--ds-override", override)
    assert result.returncode == 2 and "would use reduce_bucket_size 1000" in result.stderr, result.stderr


@pytest.mark.slow  # two plans of a model, ~8 s: the slow tier
def test_the_bucket_verify_advises_is_planned_beside_a_default_that_outweighs_the_gradients(cli):
    """gpt-tiny's gradients are under 1M elements: the default bucket (5e7) alone takes 95 MiB; plan tries the
    advised one too (at most one rank's share), which fits where the default does not."""
    memory = f"{(OUTSIDE + 80 * MiB) // MiB}MiB"
    result = cli("plan", "--preset", "gpt-tiny", "--gpu-memory", memory, "--strategies", "zero2",
                 "--micro-batches", "1", "--no-depth", "--jobs", "1", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    advised = out["advised_bucket"]
    assert out["reduce_bucket_sizes"] == [advised, 50_000_000] and advised < 1_000_000
    assert {r["reduce_bucket_size"] for r in out["fits"]} == {advised}
    text = cli("plan", "--preset", "gpt-tiny", "--gpu-memory", memory, "--strategies", "zero2",
               "--micro-batches", "1", "--no-depth", "--jobs", "1").stdout
    assert "The default reduce bucket outweighs all this model's gradients" in " ".join(text.split())
    for chosen in (["--strategies", "ddp,fsdp2"], ["--strategies", "zero2", "--reduce-bucket-size", "1e9"]):
        result = cli("plan", "--preset", "gpt-tiny", "--gpu-memory", memory, *chosen, "--micro-batches", "1",
                     "--no-depth", "--jobs", "1", "--json")  # no bucket, or one the user chose
        assert result.returncode == 0 and json.loads(result.stdout)["advised_bucket"] is None, result.stderr

@pytest.mark.slow
def test_plan_command_table_with_the_deepest_model(cli):
    memory = f"{(OUTSIDE_ALLOCATOR_MEASURED['torch'] + 84 * MiB) // MiB}MiB"
    result = cli("plan", "--preset", "gpt-tiny", "--gpu-memory", memory, "--strategies", "ddp",
                      "--micro-batches", "1", "--jobs", "1")
    assert result.returncode == 0, result.stderr
    assert "configurations fit" in result.stdout and "The deepest gpt-tiny (width 64)" in result.stdout


@pytest.mark.parametrize("flags, message", [
    (["--gpu-memory", "lots"], "--gpu-memory takes a size"),
    (["--gpu-memory", "8GiB", "--device", "cpu"], "plan predicts what fits on GPUs"),
    (["--gpu-memory", "8GiB", "--micro-batches", "0"], "--micro-batches needs positive values"),
    (["--gpu-memory", "8GiB", "--reduce-bucket-sizes", "inf"], "--reduce-bucket-sizes must be from 1 to 2^61 elements"),
    (["--gpu-memory", "8GiB", "--check"], "--check runs the candidates on 2 GPUs"),
    (["--gpu-memory", "8GiB", "--strategies", "zero4"], "unknown strategy"),
])
def test_user_errors_are_one_line(cli, flags, message, tmp_path):
    result = cli("plan", "--preset", "gpt-tiny", *flags, cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not list(tmp_path.iterdir())


def test_plan_offers_no_flag_of_a_training_run_alone(cli):
    from zerolens.run.flags import TRAINING_ONLY
    text = cli("plan", "--help").stdout
    for name in TRAINING_ONLY:
        assert f"--{name}" not in text, name
    assert "--micro-batches" in text and "--check" in text
    refused = cli("plan", "--gpu-memory", "80GiB", "--steps", "3")
    assert refused.returncode == 2 and "unrecognized arguments: --steps 3" in refused.stderr


@pytest.mark.parametrize("need", [
    lambda d: 1000 + 37 * d,  # linear, as a layer's weights and activations are
    lambda d: 1000 + 37 * d + d * d // 3,  # convex
    lambda d: 1000 + 37 * d - (d % 3) * 20,  # bumpy, yet growing over every three layers
    lambda d: 5 + d,  # hardly grows: the cap
])
@pytest.mark.parametrize("memory", [900, 1040, 1500, 3333, 20000])
@pytest.mark.parametrize("start", [None, 2, 16, 40])
def test_the_depth_search_finds_what_trying_every_depth_finds(need, memory, start):
    """plan's depth search against trying every depth: the deepest that fits, one layer more does not
    (or the cap, 64 here), from any depth the config starts at. Where the need is linear it takes one
    layer, the start and the pair that ends it (five without a start: the line through one and two
    layers, then the pair, but where the line reaches past 16 times the deepest depth tried)."""
    tried = []

    def traced(depth):
        tried.append(depth)
        return need(depth)
    found = plan.deepest_fitting(traced, memory, 64, start=start)
    fitting = [d for d in range(1, 65) if need(d) <= memory and all(need(e) <= memory for e in range(1, d))]
    assert found == max(fitting, default=0)
    assert len(tried) == len(set(tried))
    if found:
        assert found in tried and (found == 64 or found + 1 in tried)
        assert start is None or start in tried
    if need(7) == 1000 + 37 * 7 and found < 64:
        assert len(tried) <= (4 if start and found < 16 * start else 5), tried


@pytest.mark.slow
def test_a_deep_trial_of_the_depth_search_is_scaled_from_shallow_traces_to_the_same_figures():
    config = dataclasses.replace(tiny("fsdp2-grad"), micro_batch=2)
    deep = plan.with_depth(config, 25)
    memory = 4 * GiB
    scaled = plan.depth_trial(deep, (9, 0), memory)
    assert scaled["depth_scaled_from"] == [2, 3, 4, 5, 6]
    whole = plan.predicted_peak(deep, (9, 0), memory=memory)
    assert "depth_scaled_from" not in whole
    assert {k: v for k, v in scaled.items() if k != "depth_scaled_from"} == whole
