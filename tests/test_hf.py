"""Hugging Face causal LMs as users bring them (--model hf:...), built from a configuration with no
download: GPT-2 with tied embeddings and a Llama (examples/hf/)."""
import json
from pathlib import Path

import pytest
import torch
from conftest import zerolens
from torch import nn

from zerolens.models.model import to_empty_keeping_ties

transformers = pytest.importorskip("transformers")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "hf"
GPT2 = f"hf:{EXAMPLES / 'gpt2-tiny.json'}"
LLAMA = f"hf:{EXAMPLES / 'llama-tiny.json'}"
MIXTRAL = f"hf:{EXAMPLES / 'mixtral-tiny.json'}"
ALL = "ddp,zero0,zero1,zero2,zero3,fsdp2-grad,fsdp2"


def test_tied_weights_stay_tied_on_fake_storage():
    """to_empty gives each module a parameter of its own: a tied head would count twice."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight
    to_empty_keeping_ties(model, torch.device("cpu"))
    assert model[1].weight is model[0].weight and len(list(model.parameters())) == 1


@pytest.mark.slow
@pytest.mark.parametrize("model", [GPT2, LLAMA])
def test_estimate_predicts_every_strategys_peak(cli, model):
    result = cli("estimate", "--model", model, "--seq-len", "64", "--micro-batch", "2", "--strategies", ALL,
                      "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    for name, entry in out["strategies"].items():
        assert "peak_not_predicted" not in entry, (name, entry.get("peak_not_predicted"))
        assert all(r["peak_bytes"] > r["retained_total_bytes"] for r in entry["ranks"])


def test_gpt2s_tied_embedding_is_one_parameter():
    import argparse

    from zerolens.models.model import parameter_shapes
    from zerolens.run.flags import hf_model_from_args
    args = argparse.Namespace(model=GPT2, batch=None, width=None, heads=None, compile=False, depth=3, seq_len=None,
                              activation_checkpointing=False)
    config = hf_model_from_args(args)
    assert config.kind == "hf" and config.num_layers == 3 and config.seq_len == 256 and config.vocab_size == 1024
    shapes = parameter_shapes(config)
    assert sum(tuple(s) == (1024, 128) for s in shapes) == 1  # the embedding, which is also the head


@pytest.mark.slow
def test_verify_predicts_gpt2s_peaks_on_every_strategy(tmp_path):
    """GPT-2 with tied embeddings, on 2 CPU ranks: every rank's peak of every phase as predicted."""
    out = tmp_path / "run"
    result = zerolens("verify", "--model", GPT2, "--seq-len", "64", "--micro-batch", "2", "--strategies", ALL,
                      "--steps", "4", "--out", str(out), timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    predicted = [c for c in summary["checks"] if c["name"].startswith("peak as predicted")]
    assert len(predicted) == 7 * 2 and all(c["passed"] for c in predicted)


def test_fake_tensors_take_the_real_runs_attention_path():
    """On fake tensors transformers cannot read the position ids and would assume packed sequences:
    a (B, 1, T, T) mask and no SDPA is_causal. The real run builds no mask, and so must the trace."""
    import transformers.models.llama.modeling_llama as llama
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zerolens.models.hf import CausalLMLogits
    config = json.loads(Path(LLAMA[3:]).read_text())
    lm = CausalLMLogits(transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config)))
    masks, create = [], llama.create_causal_mask
    tokens = torch.randint(0, config["vocab_size"], (2, 16))
    try:
        llama.create_causal_mask = lambda *a, **k: masks.append(create(*a, **k)) or masks[-1]
        lm(tokens)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            lm(mode.from_tensor(tokens))
    finally:
        llama.create_causal_mask = create
    assert masks == [None, None]
    import transformers.masking_utils as masking
    assert masking.find_packed_sequence_indices.__name__ == "find_packed_sequence_indices"  # put back


def test_layer_drop_is_traced_as_dropping_no_layer():
    """OPT (like Whisper and M2M100) draws torch.rand([]) against its layerdrop in training, a value
    fake tensors cannot give: the trace draws 1.0, which drops no layer, and puts torch.rand back."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zerolens.models.hf import CausalLMLogits
    config = transformers.AutoConfig.for_model(model_type="opt", hidden_size=64, ffn_dim=256, num_hidden_layers=2,
                                               num_attention_heads=4, vocab_size=512, max_position_embeddings=128,
                                               word_embed_proj_dim=64)
    lm = CausalLMLogits(transformers.AutoModelForCausalLM.from_config(config)).train()
    tokens = torch.randint(0, 512, (2, 16))
    rand = torch.rand
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        logits = lm(mode.from_tensor(tokens))
    assert tuple(logits.shape) == (2, 16, 512) and torch.rand is rand


@pytest.mark.slow
def test_verify_predicts_llamas_peaks_where_the_fake_trace_once_missed(tmp_path):
    """The tiny Llama on 2 CPU ranks with zero0 and fsdp2, which the trace once missed (a causal mask
    on fake tensors; gloo's reduce-scatter copy): every rank's peak of every phase as predicted."""
    out = tmp_path / "run"
    result = zerolens("verify", "--model", LLAMA, "--seq-len", "64", "--micro-batch", "2", "--strategies",
                      "zero0,fsdp2", "--steps", "4", "--out", str(out), timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    predicted = [c for c in summary["checks"] if c["name"].startswith("peak as predicted")]
    assert len(predicted) == 2 * 2 and all(c["passed"] for c in predicted)


@pytest.mark.slow
def test_verify_predicts_a_mixture_of_experts_under_ddp(tmp_path):
    """A Mixtral-style model, whose experts multiply through torch's grouped_mm: DDP gives it fp32
    inputs under autocast, which the real kernels take and torch's meta kernel refused, so DDP's peak
    was not predicted; now every rank's peak and retained bytes are as predicted, beside FSDP2's."""
    out = tmp_path / "run"
    result = zerolens("verify", "--model", MIXTRAL, "--seq-len", "32", "--micro-batch", "2", "--strategies",
                      "ddp,fsdp2", "--steps", "4", "--out", str(out), timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "PASS"
    predicted = [c for c in summary["checks"] if c["name"].startswith("peak as predicted")]
    assert len(predicted) == 2 * 2 and all(c["passed"] for c in predicted)


@pytest.mark.parametrize("flags, message", [
    (["--model", "hf:not-a-model-type"], "--model hf:not-a-model-type: unknown to transformers"),
    (["--model", "hf:vit"], "vit is not a causal language model"),
    (["--model", "hf:missing/config.json"], "cannot read it"),
    (["--model", GPT2, "--batch", "x:y"], "--batch is for --model module:factory"),
    (["--model", GPT2, "--seq-len", "4096"], "longer than the model's max_position_embeddings 256"),
])
def test_user_errors(cli, flags, message, tmp_path):
    result = cli("verify", *flags, "--steps", "4", "--nproc", "1", "--strategies", "ddp", "--out",
                      str(tmp_path / "run"), cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_an_unknown_model_type_is_one_short_line_with_the_closest_types(cli, tmp_path):
    """transformers' own message lists every model type it knows (12,000 characters in one line)."""
    result = cli("estimate", "--model", "hf:lama")
    assert result.returncode == 2 and "hf:lama: unknown to transformers" in result.stderr, result.stderr
    assert "(close: llama" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and len(result.stderr.strip()) <= 100
    other = cli("estimate", "--model", "hf:notamodeltype")
    assert "(hf:gpt2, or a config.json?)" in other.stderr and len(other.stderr.strip()) <= 100, other.stderr


def args_of_user_model(factory: str, batch: str):
    import argparse
    return argparse.Namespace(model=f"zerolens_test_models:{factory}", batch=f"zerolens_test_models:{batch}",
                              width=None, depth=None, heads=None, seq_len=None, activation_checkpointing=False,
                              compile=False)


def test_a_causal_lm_from_a_factory_trains_on_its_own_loss():
    """A factory may return a transformers causal LM as it is, and the batch give labels as the model
    takes them (the input ids): zerolens reads its .logits and shifts the labels, so the loss it
    trains on is the model's own, bit for bit."""
    from zerolens.models.data import make_batch
    from zerolens.models.model import build_model
    from zerolens.run.flags import user_model_from_args
    from zerolens.strategies import loss_of
    config = user_model_from_args(args_of_user_model("tiny_llama", "llama_batch"))
    assert config.shift_labels
    model = build_model(config, seed=0)
    tokens, targets = make_batch(config, 3, seed=0, batch_size=2, signal=0.0)
    assert torch.equal(targets[:, :-1], tokens[:, 1:]) and (targets[:, -1] == -100).all()
    own = model.lm(input_ids=tokens, labels=tokens).loss
    assert torch.equal(loss_of(model(tokens), targets), own)


def test_a_sequence_classifier_from_a_factory_keeps_its_labels():
    """A transformers model that is not a causal LM: its .logits, the labels as they are."""
    from zerolens.models.model import build_model
    from zerolens.run.flags import user_model_from_args
    from zerolens.strategies import loss_of
    config = user_model_from_args(args_of_user_model("tiny_bert_classifier", "tiny_batch"))
    assert not config.shift_labels
    model = build_model(config, seed=0).eval()
    tokens, labels = torch.randint(1024, (4, 8)), torch.tensor([0, 1, 2, 3])
    assert torch.equal(loss_of(model(tokens), labels), model.model(tokens, labels=labels).loss)


@pytest.mark.parametrize("model_type, extra, depth, expected", [
    # Worked out by the configuration itself (all full attention): left out, worked out again at the new depth
    ("qwen2", {}, 6, ["full_attention"] * 6),
    # Gemma2's sliding and full layers, in turn: repeated in their period
    ("gemma2", {"head_dim": 16}, 5, ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]),
    # A list of the user's own with a period of 2 (not what Qwen2 works out), made shallower and deeper
    ("qwen2", {"layer_types": ["full_attention", "sliding_attention"] * 2}, 2, ["full_attention", "sliding_attention"]),
    ("qwen2", {"layer_types": ["full_attention", "sliding_attention"] * 2}, 6,
     ["full_attention", "sliding_attention"] * 3),
])
def test_a_configuration_with_one_entry_per_layer_is_built_at_another_depth(model_type, extra, depth, expected):
    """plan's depth search and estimate --depth build the model deeper than its configuration: its
    layer_types must have one entry per layer, or transformers indexes past the list's end."""
    from zerolens.models.hf import build
    from zerolens.models.model import ModelConfig
    values = {"model_type": model_type, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "sliding_window": 32,
              "max_position_embeddings": 128, **extra}
    config = transformers.AutoConfig.for_model(**values).to_dict()
    fields = {"kind": "hf", "hf_config": json.dumps(config), "vocab_size": 256, "d_model": 64, "num_heads": 4,
              "num_layers": depth, "seq_len": 64}
    with torch.device("meta"):
        lm = build(ModelConfig(**fields)).lm
    assert lm.config.num_hidden_layers == depth and list(lm.config.layer_types) == expected
    assert len(lm.model.layers) == depth


def test_a_layer_list_without_a_pattern_is_not_made_deeper():
    from zerolens.errors import UserError
    from zerolens.models.hf import at_depth
    values = transformers.AutoConfig.for_model(
        model_type="qwen2", num_hidden_layers=3, layer_types=["full_attention", "full_attention", "sliding_attention"],
        sliding_window=32).to_dict()
    assert at_depth(values, 2)["layer_types"] == ["full_attention", "full_attention"]
    with pytest.raises(UserError, match="no repeating pattern"):
        at_depth(values, 4)


@pytest.mark.parametrize("values, message", [
    # transformers' default pad_token_id (32000) lies past a small vocabulary: the embedding refuses it
    ({"model_type": "phi3", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 128}, "cannot build it"),
    # a width the heads do not divide
    ({"model_type": "llama", "vocab_size": 1000, "hidden_size": 66, "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4}, "cannot make a configuration of it"),
])
def test_a_configuration_transformers_cannot_build_is_one_line(cli, tmp_path, values, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(values))
    result = cli("estimate", "--model", f"hf:{path}")
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
