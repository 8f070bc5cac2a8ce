"""FSDP2's step model steps torch's AdamW on the shards' local tensors (strategies/fsdp2.py,
TorchFSDP2StepModel.setup): the trace allocates and frees what AdamW on the DTensors does, request for
request, with the same figures beside them."""
import dataclasses

import pytest

from zerolens.models.hf import model_config_fields
from zerolens.models.model import PRESETS, ModelConfig
from zerolens.predict import peak
from zerolens.predict.peak import traced_rank
from zerolens.predict.repeat import alike
from zerolens.strategies import TrainSettings, fsdp2
from zerolens.strategies.base import scaled_step_without_reading_values

H200 = (9, 0)


def on_dtensors(monkeypatch):
    """The step model as TorchFSDP2 steps: AdamW made on the module's parameters, the DTensors."""
    def step(self):
        return scaled_step_without_reading_values(self.scaler, self.optimizer, self.module,
                                                  self.settings.gradient_clipping)
    monkeypatch.setattr(fsdp2.TorchFSDP2StepModel, "setup", fsdp2.TorchFSDP2.setup)
    monkeypatch.setattr(fsdp2.TorchFSDP2StepModel, "step", step)


def case(name: str) -> tuple[ModelConfig, TrainSettings, int]:
    """A model, its settings and the rank traced."""
    if name == "gpt-tiny-3-ranks-padded-ckpt-fp16":  # rank 2's shards are padded; fp16's scaler unscales
        return (dataclasses.replace(PRESETS["gpt-tiny"], activation_checkpointing=True),
                TrainSettings(precision="fp16", micro_batch=3, world_size=3), 2)
    if name == "gpt-tiny-fp32-fused-unclipped":
        return PRESETS["gpt-tiny"], TrainSettings(precision="fp32", micro_batch=2, world_size=2, fused_adam=True,
                                                  gradient_clipping=0.0), 0
    if name == "llama-tiny-accum-2":
        return (ModelConfig(**model_config_fields("examples/hf/llama-tiny.json", depth=None, seq_len=64)),
                TrainSettings(precision="bf16", micro_batch=2, world_size=2, grad_accum=2), 1)
    if name == "mixtral-tiny":  # experts no token reaches have no gradient
        return (ModelConfig(**model_config_fields("examples/hf/mixtral-tiny.json", depth=None, seq_len=64)),
                TrainSettings(precision="bf16", micro_batch=2, world_size=2), 0)
    raise ValueError(name)


def traced(strategy: str, model: ModelConfig, settings: TrainSettings, rank: int, cuda_capability) -> dict:
    """Every step traced, none written from another (predict/repeat.py)."""
    return traced_rank(strategy, model, settings, rank=rank, cuda_capability=cuda_capability, outcome=False,
                       repeat=False)[1]


@pytest.mark.slow  # eight traces twice, ~25 s: the CPU target's test below stays in the quick tier
@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp2-grad"])
@pytest.mark.parametrize("name", ["gpt-tiny-3-ranks-padded-ckpt-fp16", "gpt-tiny-fp32-fused-unclipped",
                                  "llama-tiny-accum-2", "mixtral-tiny"])
def test_adamw_on_the_local_shards_allocates_as_on_the_dtensors(monkeypatch, strategy, name):
    model, settings, rank = case(name)
    local = traced(strategy, model, settings, rank, H200)
    with monkeypatch.context() as m:
        on_dtensors(m)
        dtensors = traced(strategy, model, settings, rank, H200)
    assert len(local["requests"]) == len(dtensors["requests"]) and alike(local["requests"], dtensors["requests"])
    assert local["phase_peaks"] == dtensors["phase_peaks"] and local["held"] == dtensors["held"]
    assert local["raw"] == dtensors["raw"]
    assert peak.rank_outcome(local) == peak.rank_outcome(dtensors)


def test_adamw_on_the_local_shards_counts_as_on_the_dtensors_for_a_cpu_target(monkeypatch):
    model, settings, rank = case("gpt-tiny-3-ranks-padded-ckpt-fp16")
    settings = dataclasses.replace(settings, precision="bf16")  # fp16 is not run on the CPU
    local = traced("fsdp2", model, settings, rank, None)
    with monkeypatch.context() as m:
        on_dtensors(m)
        dtensors = traced("fsdp2", model, settings, rank, None)
    assert local["phase_peaks"] == dtensors["phase_peaks"] and local["held"] == dtensors["held"]
