"""The DeepSpeed config zerolens writes: no FusedAdam (its JIT build costs ~40 s and crashes on
TORCH_CUDA_ARCH_LIST=9.0a with DeepSpeed 0.19.8), and overrides merged key by key."""
import pytest

from zerolens.strategies import TrainSettings
from zerolens.strategies.deepspeed import DeepSpeedZero, merged, unnamed_loss_scaling_kept_gradients


def test_torch_adamw_is_selected_never_fused_adam():
    config = DeepSpeedZero(TrainSettings(precision="bf16"), stage=2).ds_config()
    assert config["optimizer"]["type"] == "AdamW" and config["optimizer"]["params"]["torch_adam"] is True
    fused = DeepSpeedZero(TrainSettings(precision="bf16", fused_adam=True), stage=2).ds_config()
    assert fused["optimizer"]["params"] == {"lr": 1e-4, "torch_adam": True, "fused": True}  # torch's fused kernel


def test_override_merges_nested_keys():
    settings = TrainSettings(precision="bf16", reduce_bucket_size=123,
                             ds_override={"zero_optimization": {"overlap_comm": True}, "steps_per_print": 10})
    config = DeepSpeedZero(settings, stage=2).ds_config()
    assert config["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 123, "reduce_scatter": True,
                                           "overlap_comm": True}
    assert config["steps_per_print"] == 10
    assert merged({"a": {"b": 1, "c": 2}}, {"a": {"c": 3}, "d": 4}) == {"a": {"b": 1, "c": 3}, "d": 4}


def test_fp16_writes_deepspeeds_loss_scaling_defaults_out_and_a_users_config_is_kept():
    """DeepSpeed 0.17.1 and later apply these whatever the fp16 section says; earlier releases only where it
    names one, else their ZeRO-1/2 start at a loss scale of 2**32 and skip their first steps (FP16_LOSS_SCALING)."""
    constants = pytest.importorskip("deepspeed.runtime.constants")
    section = DeepSpeedZero(TrainSettings(precision="fp16"), stage=1).ds_config()["fp16"]
    assert section == {"enabled": True,
                       "initial_scale_power": constants.FP16_INITIAL_SCALE_POWER_DEFAULT,
                       "loss_scale_window": constants.FP16_LOSS_SCALE_WINDOW_DEFAULT,
                       "hysteresis": constants.FP16_HYSTERESIS_DEFAULT,
                       "consecutive_hysteresis": constants.FP16_CONSECUTIVE_HYSTERESIS_DEFAULT,
                       "min_loss_scale": constants.FP16_MIN_LOSS_SCALE_DEFAULT}
    assert not unnamed_loss_scaling_kept_gradients({"fp16": section}, "0.16.9")  # zerolens's own config
    assert DeepSpeedZero(TrainSettings(precision="bf16"), stage=1).ds_config()["bf16"] == {"enabled": True}
    users = {"train_micro_batch_size_per_gpu": 8, "fp16": {"enabled": True}}
    config = DeepSpeedZero(TrainSettings(precision="fp16", micro_batch=8, user_ds_config=users), stage=1).ds_config()
    assert config["fp16"] == {"enabled": True}


@pytest.mark.parametrize("version, section, kept", [
    ("0.16.9", {"enabled": True}, True), ("0.17.0", {"enabled": True}, True),
    ("0.17.1", {"enabled": True}, False), ("0.16.9", {"enabled": True, "hysteresis": 2}, False),
    ("0.16.9", {"enabled": False}, False), (None, {"enabled": True}, False)])
def test_a_users_fp16_section_without_loss_scaling_under_016_is_not_modelled(version, section, kept):
    """Before 0.17.1 such a section starts ZeRO-1/2 at a loss scale of 2**32: their first steps overflow
    and the first one's gradients stay allocated, which the step model does not do."""
    assert unnamed_loss_scaling_kept_gradients({"fp16": section}, version) is kept
