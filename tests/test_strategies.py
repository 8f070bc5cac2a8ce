"""How FSDP2 finds the blocks it shards one group at a time (no process group needed)."""
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
