"""The DeepSpeed config zerolens writes: no FusedAdam (its JIT build costs ~40 s and crashes on
TORCH_CUDA_ARCH_LIST=9.0a with DeepSpeed 0.19.8), and overrides merged key by key."""
from zerolens.strategies import TrainSettings
from zerolens.strategies.deepspeed import DeepSpeedZero, merged


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
