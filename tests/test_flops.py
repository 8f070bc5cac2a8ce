"""FLOPs per token for MFU: by formula for the presets, counted by torch's FLOP counter on fake tensors
for any other model (a Hugging Face one, a user's)."""
import argparse
import json
from pathlib import Path

import pytest
from torch import nn

from zerolens.models.flops import COUNTED, counted_flops_per_token, flops_per_token
from zerolens.models.model import PRESETS, ModelConfig, parameter_shapes, training_flops_per_token

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "hf"


def user_config(factory: str, batch: str) -> ModelConfig:
    return ModelConfig(kind="user", factory=f"zerolens_test_models:{factory}", batch=f"zerolens_test_models:{batch}")


def test_a_users_mlp_is_counted_as_by_hand():
    """float_mlp, Linear(12, 32), GELU, Linear(32, 4), on B samples of 12 features: forward 2B(12*32 +
    32*4); backward both weights' gradients (2B*12*32 + 2B*32*4) and the hidden layer's (2B*32*4), not
    the inputs' (they need none): 2304 B FLOPs, over 12 B input elements."""
    counted = flops_per_token(user_config("float_mlp", "float_batch"), 0, micro_batch=4, seed=0)
    assert counted == {"flops_per_token": 192.0, "flop_count": COUNTED}


@pytest.mark.parametrize("preset", ["gpt-100m", "gpt-1b"])
def test_the_counter_agrees_with_the_presets_formula(preset):
    """The counter on a GPT preset against Megatron-LM's formula (attention included, as the counter
    counts it through its matrix products): within 0.1%."""
    config = PRESETS[preset]
    formula = training_flops_per_token(config, sum(s.numel() for s in parameter_shapes(config)))
    assert counted_flops_per_token(config, micro_batch=1, seed=0) == pytest.approx(formula, rel=1e-3)


def test_a_hugging_face_llama_is_counted():
    """The tiny Llama (examples/hf): 6 per weight that multiplies (all but the embedding table) and
    attention's 12 x layers x width x sequence, within 1%: grouped-query attention's smaller key and
    value projections are weights like any other."""
    pytest.importorskip("transformers")
    from zerolens.run.flags import hf_model_from_args
    config = hf_model_from_args(argparse.Namespace(
        model=f"hf:{EXAMPLES / 'llama-tiny.json'}", batch=None, width=None, heads=None, compile=False, depth=None,
        seq_len=None, activation_checkpointing=False))
    hf = json.loads((EXAMPLES / "llama-tiny.json").read_text())
    params = sum(s.numel() for s in parameter_shapes(config))
    formula = 6 * (params - hf["vocab_size"] * hf["hidden_size"]) + \
        12 * hf["num_hidden_layers"] * hf["hidden_size"] * config.seq_len
    counted = flops_per_token(config, params, micro_batch=2, seed=0)
    assert counted["flop_count"] == COUNTED and counted["flops_per_token"] == pytest.approx(formula, rel=0.01)


class NeedsValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(12, 4)

    def forward(self, x):
        return self.linear(x) * float(x.abs().max().item())


def needs_values():
    return NeedsValues()


def test_a_model_that_needs_values_is_not_counted_and_says_why():
    """A forward that reads a value (.item()) cannot run on fake tensors: no FLOPs, and why."""
    config = ModelConfig(kind="user", factory=f"{__name__}:needs_values", batch="zerolens_test_models:float_batch")
    counted = flops_per_token(config, 0, micro_batch=2, seed=0)
    assert counted["flops_per_token"] is None and counted["flop_count"].startswith("not counted: the model does not "
                                                                                   "run on fake tensors")
