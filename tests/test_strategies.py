"""How FSDP2 finds the blocks it shards one group at a time (no process group needed), and what ZeRO-3
leaves behind at its teardown."""
import pytest
from distributed import spawn
from torch import nn

from zerolens.models.model import PRESETS, ModelConfig, build_model
from zerolens.strategies.fsdp2 import repeated_blocks


def test_blocks_are_the_encoder_layers_and_the_gpt_blocks():
    classifier = build_model(ModelConfig(num_layers=3), seed=0)
    assert repeated_blocks(classifier) == list(classifier.encoder.layers)
    gpt = build_model(PRESETS["gpt-tiny"], seed=0)
    assert repeated_blocks(gpt) == list(gpt.blocks)


def test_only_the_outermost_lists_count_and_blocks_without_parameters_are_left_out():
    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))  # inside a block: not split

    model = nn.Module()
    model.layers = nn.ModuleList([Experts(), nn.ReLU(), Experts()])
    assert repeated_blocks(model) == [model.layers[0], model.layers[2]]
    assert repeated_blocks(nn.Linear(4, 4)) == []


def zero3_and_torchs_linear(rank, world_size):
    """(DeepSpeed's ZeRO-3 replaced torch.nn.functional.linear, torch's is back after the teardown)."""
    import torch

    from zerolens.models.model import ModelConfig, build_model
    from zerolens.strategies import TrainSettings, make_strategy
    linear = torch.nn.functional.linear
    strategy = make_strategy("zero3", TrainSettings(precision="fp32", world_size=world_size, micro_batch=2))
    strategy.setup(build_model(ModelConfig(), seed=0), torch.device("cpu"))
    replaced = torch.nn.functional.linear is not linear
    strategy.teardown()
    return replaced, torch.nn.functional.linear is linear


@pytest.mark.slow
def test_zero3_puts_torchs_linear_back_at_its_teardown():
    """So the strategies after it run in the same processes, not in a second launch."""
    assert spawn(zero3_and_torchs_linear, world_size=1, timeout=180) == [(True, True)]
