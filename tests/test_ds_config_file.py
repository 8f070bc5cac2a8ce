"""--ds-config FILE: a user's DeepSpeed JSON with Hugging Face-style "auto" values, filled from
zerolens's settings; bad files and inconsistent batch arithmetic end in one line, exit 2."""
import json

import pytest
from conftest import zerolens

from zerolens.strategies import TrainSettings, make_strategy

AUTO_CONFIG = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "bf16": {"enabled": "auto"}, "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True, "weight_decay": 0.0}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "contiguous_gradients": True},
}


def test_autos_are_filled_and_the_strategy_decides_the_stage():
    settings = TrainSettings(precision="bf16", micro_batch=4, world_size=3, lr=3e-4, reduce_bucket_size=1000,
                             user_ds_config=AUTO_CONFIG)
    zero2 = make_strategy("zero2", settings)
    config = zero2.ds_config()
    assert config["train_batch_size"] == 12 and config["train_micro_batch_size_per_gpu"] == 4
    assert config["gradient_accumulation_steps"] == 1 and config["bf16"] == {"enabled": True}
    assert config["optimizer"]["params"] == {"lr": 3e-4, "torch_adam": True, "weight_decay": 0.0}
    assert config["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 1000, "contiguous_gradients": True}
    assert zero2.notes() == ["zero2: --ds-config says stage 3; zero2 runs stage 2"]


@pytest.mark.slow
def test_verify_with_a_user_config(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(AUTO_CONFIG))
    out = tmp_path / "run"
    result = zerolens("verify", "--ds-config", str(path), "--steps", "6", "--out", str(out), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr  # 6 steps: "loss fell" is not checked
    config = json.loads((out / "config.json").read_text())["strategy_settings"]["zero2"]["ds_config"]
    assert config["optimizer"]["params"]["weight_decay"] == 0.0 and config["zero_optimization"]["stage"] == 2
    summary = json.loads((out / "summary.json").read_text())
    memory = [c for c in summary["checks"] if c["name"].startswith(("gradient", "retained"))]
    assert memory and all(c["passed"] for c in memory)
    # Every setting of this config is one the step models model: the peaks are predicted, and as measured.
    peaks = [c for c in summary["checks"] if c["name"].startswith("peak as predicted")]
    assert len(peaks) == 2 * 2 and all(c["passed"] for c in peaks), peaks


@pytest.mark.slow
def test_a_users_bucket_and_zero3_settings_are_predicted_retained_and_at_the_peak(tmp_path):
    """reduce_bucket_size, ZeRO-3's prefetch, live-parameter and persistence settings from the
    user's config: what each rank keeps and its peaks, as predicted (they once used zerolens's
    defaults, and the retained check failed)."""
    user = AUTO_CONFIG | {"zero_optimization": {"stage": 3, "reduce_bucket_size": 2_000_000,
                                                "stage3_prefetch_bucket_size": 100_000,
                                                "stage3_param_persistence_threshold": 1000,
                                                "stage3_max_live_parameters": 1_000_000}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(user))
    out = tmp_path / "run"
    result = zerolens("verify", "--ds-config", str(path), "--strategies", "zero1,zero2,zero3", "--preset", "gpt-tiny",
                      "--steps", "4", "--out", str(out), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    peaks = [c for c in summary["checks"] if c["name"].startswith("peak as predicted")]
    assert len(peaks) == 3 * 2 and all(c["passed"] for c in summary["checks"]), summary["checks"]


def test_deepspeeds_fusedadam_keeps_its_step_counts_in_no_tensor():
    """Type Adam or AdamW without torch_adam: DeepSpeed's FusedAdam, whose state['step'] is a Python
    number; torch's AdamW (zerolens's config, or torch_adam) keeps a 4-byte tensor per parameter."""
    from zerolens.strategies.layout import STEP_COUNTER, deepspeed_step_bytes
    assert deepspeed_step_bytes({}, {}) == STEP_COUNTER
    assert deepspeed_step_bytes(AUTO_CONFIG, {}) == STEP_COUNTER
    hf_style = {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    assert deepspeed_step_bytes(hf_style, {}) == 0
    assert deepspeed_step_bytes({"optimizer": {"type": "adam"}}, {}) == 0
    assert deepspeed_step_bytes(hf_style, {"optimizer": {"params": {"torch_adam": True}}}) == STEP_COUNTER
    assert deepspeed_step_bytes(AUTO_CONFIG, {"optimizer": {"params": {"torch_adam": False}}}) == 0
    assert deepspeed_step_bytes({}, {"optimizer": {"type": "Lamb"}}) == STEP_COUNTER  # not modelled: said elsewhere


@pytest.mark.slow
def test_verify_with_the_optimizer_section_hugging_face_writes(tmp_path):
    """{"type": "AdamW", "params": {"lr": "auto"}}: DeepSpeed's own FusedAdam. What each rank keeps is
    predicted without per-parameter step tensors (the retained check failed by 4 bytes a tensor); its
    peaks are said not to be modelled."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}))
    out = tmp_path / "run"
    result = zerolens("verify", "--ds-config", str(path), "--strategies", "zero0,zero1,zero3", "--steps", "4",
                      "--out", str(out), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    retained = [c for c in summary["checks"] if c["name"].startswith("retained")]
    assert len(retained) == 3 * 2 and all(c["passed"] for c in retained), retained
    assert all("FusedAdam" in summary["strategies"][n]["peak_not_predicted"] for n in ("zero0", "zero1", "zero3"))


def test_what_the_step_models_do_not_model_is_said_by_name():
    from zerolens.strategies import registry
    settings = TrainSettings(precision="bf16", user_ds_config=AUTO_CONFIG)
    assert all(registry.spec(n).not_modelled(settings) == [] for n in ("zero0", "zero1", "zero2", "zero3", "ddp"))
    theirs = AUTO_CONFIG | {"optimizer": {"type": "Lamb", "params": {"torch_adam": True}},
                            "zero_optimization": {"stage": 2, "overlap_comm": True,
                                                  "offload_optimizer": {"device": "cpu"}},
                            "activation_checkpointing": {"partition_activations": True}}
    said = registry.spec("zero2").not_modelled(TrainSettings(precision="bf16", user_ds_config=theirs))
    assert sorted(said) == sorted(["optimizer.type: Lamb", 'activation_checkpointing: {"partition_activations": true}',
                                   'zero_optimization.offload_optimizer: {"device": "cpu"}',
                                   "zero_optimization.overlap_comm: true"])
    # ZeRO-3 overlaps by default: the same overlap_comm is modelled there, and not without ZeRO.
    assert "zero_optimization.overlap_comm: true" not in registry.spec("zero3").not_modelled(
        TrainSettings(precision="bf16", user_ds_config=theirs))
    assert registry.spec("zero0").not_modelled(TrainSettings(precision="bf16", ds_override={
        "zero_optimization": {"overlap_comm": True}})) == []
    assert registry.spec("zero2").not_modelled(TrainSettings(precision="bf16", ds_override={
        "zero_optimization": {"offload_optimizer": {"device": "none"}}})) == []  # no offload
    assert registry.spec("zero1").not_modelled(TrainSettings(precision="bf16", ds_override={
        "optimizer": {"params": {"torch_adam": False}}})) == [
        "optimizer.params.torch_adam: not true (DeepSpeed's own FusedAdam)"]


def test_the_deepspeed_config_sets_the_bucket_and_persistence_zerolens_predicts_with():
    from zerolens.errors import UserError
    from zerolens.run.deepspeed_config import deepspeed_zero_setting
    config = {"zero_optimization": {"reduce_bucket_size": 2e6, "stage3_param_persistence_threshold": "auto"}}
    assert deepspeed_zero_setting(config, {}, "reduce_bucket_size", 5e7) == 2_000_000
    assert deepspeed_zero_setting(config, {"zero_optimization": {"reduce_bucket_size": 7}}, "reduce_bucket_size",
                                  5e7) == 7
    assert deepspeed_zero_setting(config, {}, "stage3_param_persistence_threshold", 100_000) == 100_000
    # Left out of the user's config: DeepSpeed's own default, which is what it runs with (an "auto" is
    # zerolens's to fill, and so is a run without a config of the user's).
    assert deepspeed_zero_setting({"zero_optimization": {"stage": 2}}, {}, "reduce_bucket_size", 5e7) == 500_000_000
    assert deepspeed_zero_setting({"bf16": {"enabled": True}}, {}, "stage3_param_persistence_threshold", 7) == 100_000
    assert deepspeed_zero_setting({}, {}, "reduce_bucket_size", 5e7) == 50_000_000
    assert deepspeed_zero_setting({"zero_optimization": {"param_persistence_threshold": 10}}, {},
                                  "stage3_param_persistence_threshold", 100_000) == 10
    with pytest.raises(UserError, match="zero_optimization.reduce_bucket_size must be a number"):
        deepspeed_zero_setting({"zero_optimization": {"reduce_bucket_size": "big"}}, {}, "reduce_bucket_size", 5e7)


@pytest.mark.parametrize("content, message", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "must hold a JSON object"),
    ('{"train_batch_size": 10}', "train_batch_size 10 != train_micro_batch_size_per_gpu 8 x 2 ranks x "
                                 "gradient_accumulation_steps 1 = 16"),
    ('{"gradient_accumulation_steps": 2}', "the run accumulates 1 micro-batches per step: pass --grad-accum 2"),
    ('{"train_micro_batch_size_per_gpu": 4}', "pass --micro-batch 4"),
    ('{"fp16": {"enabled": true}}', "enables fp16 but the run's precision is bf16"),
    # DeepSpeed itself passes over a top-level key it does not know: a misspelt section would leave the run
    # on zerolens's defaults.
    ('{"zero_optimizaton": {"stage": 2}}', "--ds-config: DeepSpeed has no key 'zero_optimizaton' "
                                           "(did you mean 'zero_optimization'?)"),
])
def test_bad_config_files(cli, tmp_path, content, message):
    path = tmp_path / "ds.json"
    path.write_text(content)
    result = cli("verify", "--ds-config", str(path), "--out", str(tmp_path / "run"))
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_top_level_keys_deepspeed_reads_are_taken(tmp_path):
    """The keys DeepSpeed's own parser looks up are its known ones: sections zerolens never sets pass."""
    import argparse

    from zerolens.commands import verify
    from zerolens.run.flags import config_from_args
    from zerolens.run.validate import check_config
    path = tmp_path / "ds.json"
    path.write_text('{"steps_per_print": 5, "wall_clock_breakdown": false, "tensorboard": {"enabled": false}}')
    parser = argparse.ArgumentParser()
    verify.add_parser(parser.add_subparsers())
    config = config_from_args(parser.parse_args(["verify", "--ds-config", str(path), "--strategies", "zero2"]),
                              gpus_visible=0, checked=True)
    check_config(config, gpus_visible=0)  # raises UserError on a key DeepSpeed does not read


@pytest.mark.parametrize("flag, value", [("--ds-config", '{"steps_per_print": 5}'),
                                         ("--ds-override", '{"zero_optimization": {"overlap_comm": true}}')])
def test_a_deepspeed_config_without_a_deepspeed_strategy_is_refused(cli, tmp_path, flag, value):
    if flag == "--ds-config":
        (tmp_path / "ds.json").write_text(value)
        value = str(tmp_path / "ds.json")
    result = cli("verify", flag, value, "--strategies", "ddp,fsdp2", "--out", str(tmp_path / "run"))
    assert result.returncode == 2 and f"{flag}: unused, as none of ddp, fsdp2 runs DeepSpeed" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_unreadable_config_file(cli, tmp_path):
    result = cli("verify", "--ds-config", str(tmp_path / "missing.json"), "--out", str(tmp_path / "run"))
    assert result.returncode == 2 and "cannot read it" in result.stderr


def test_a_users_gradient_accumulation_agrees_with_the_runs(cli, tmp_path):
    """--grad-accum is what the run does; a config that says otherwise is refused, one that agrees or
    says "auto" is taken, and the DeepSpeed config zerolens writes carries it into the batch arithmetic."""
    from zerolens.strategies.base import TrainSettings
    from zerolens.strategies.deepspeed import DeepSpeedZero
    path = tmp_path / "ds.json"
    path.write_text('{"gradient_accumulation_steps": 4, "train_batch_size": 64}')
    result = cli("verify", "--ds-config", str(path), "--grad-accum", "2", "--out", str(tmp_path / "run"))
    assert result.returncode == 2 and "pass --grad-accum 4" in result.stderr, result.stderr
    settings = TrainSettings(precision="bf16", micro_batch=8, world_size=2, grad_accum=4)
    config = DeepSpeedZero(settings, stage=2).ds_config()
    assert (config["gradient_accumulation_steps"], config["train_batch_size"]) == (4, 64)


def test_a_bucket_flag_the_deepspeed_config_would_overrule_is_a_user_error(cli, tmp_path):
    """With --ds-config, DeepSpeed takes the bucket from the file (its default where the file has none):
    --reduce-bucket-size was silently dropped, while the bucket note advised it."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    result = cli("verify", "--ds-config", str(path), "--strategies", "zero2", "--reduce-bucket-size", "2e5",
                 "--out", str(tmp_path / "run"))
    assert result.returncode == 2 and "DeepSpeed takes zero_optimization.reduce_bucket_size from the file (5e+08" \
        in result.stderr and not (tmp_path / "run").exists()
