"""Hugging Face `transformers` causal language models, as users bring them: `--model hf:<model type>`
(that type's default configuration, e.g. hf:gpt2, hf:llama) or `--model hf:<path to config.json>`
(the configuration of your model). Built from the configuration alone, with no download and no
weights: zerolens measures memory, and a fresh initialisation holds the same bytes. An optional
extra (pip install 'zerolens[hf]'); nothing else in zerolens imports transformers.

The model zerolens trains is the causal LM wrapped to return its logits (`CausalLMLogits`), which
zerolens's cross-entropy compares with the next tokens of the GPT presets' synthetic task (data.py),
drawn from the model's own vocabulary. Activation checkpointing is transformers' own
(activation_checkpointing_enable, gradient_checkpointing_enable before transformers named it so; non-reentrant).

A factory of --model module:factory may also return a transformers model as it is: zerolens uses its
`.logits` (`TransformersLogits`), and where it is a causal LM, shifts the batch's labels as the
model's own loss does (`shift_labels`): the user's batch gives (input ids, labels) as they would
give them to the model.
"""
from __future__ import annotations

import difflib
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from zerolens.errors import UserError, one_line_error

PREFIX = "hf:"
DEFAULT_SEQ_LEN = 1024  # at most the model's max_position_embeddings


def transformers_or_error():
    try:
        import transformers
    except ImportError:
        raise UserError("--model hf:... needs Hugging Face transformers: pip install 'zerolens[hf]' "
                        "(or pip install transformers)") from None
    return transformers


def read_config(source: str):
    """`source` (after "hf:"): a path to a config.json, or a model type transformers knows, as a
    transformers configuration."""
    transformers = transformers_or_error()
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        try:
            values = json.loads(path.read_text())
        except OSError as e:
            raise UserError(f"--model hf:{source}: cannot read it ({e.strerror})") from None
        except json.JSONDecodeError as e:
            raise UserError(f"--model hf:{source} is not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(values, dict) or "model_type" not in values:
            raise UserError(f"--model hf:{source}: a Hugging Face config.json has a \"model_type\"")
    else:
        values = {"model_type": source}
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if values["model_type"] not in CONFIG_MAPPING_NAMES:  # transformers' own message lists every type it knows
        close = difflib.get_close_matches(str(values["model_type"]), list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), n=3)
        raise UserError(f"--model hf:{source}: unknown to transformers {transformers.__version__}"
                        + (f" (close: {', '.join(close)})" if close else " (hf:gpt2, or a config.json?)"))
    try:
        config = transformers.AutoConfig.for_model(**values)
    except Exception as e:  # ValueError, KeyError, a strict dataclass's validation error (heads, width)
        raise UserError(f"--model hf:{source}: transformers {transformers.__version__} cannot make a configuration "
                        f"of it ({str(e).splitlines()[0][:200]})") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"--model hf:{source}: {config.model_type} is not a causal language model in transformers "
                        f"{transformers.__version__} (zerolens trains AutoModelForCausalLM)")
    return config


def model_config_fields(source: str, *, depth: int | None, seq_len: int | None) -> dict:
    """What ModelConfig keeps of a Hugging Face configuration: the configuration itself (JSON) and
    the figures the rest of zerolens reads (vocabulary, width, heads, layers, sequence length)."""
    config = read_config(source)
    values = config.to_dict()
    longest = getattr(config, "max_position_embeddings", None)
    if seq_len is not None and longest is not None and seq_len > longest:
        raise UserError(f"--seq-len {seq_len} is longer than the model's max_position_embeddings {longest}")
    return {"kind": "hf", "factory": PREFIX + source, "hf_config": json.dumps(values, sort_keys=True),
            "vocab_size": config.vocab_size, "d_model": config.hidden_size, "num_heads": config.num_attention_heads,
            "num_layers": depth if depth is not None else config.num_hidden_layers,
            "seq_len": seq_len if seq_len is not None else min(DEFAULT_SEQ_LEN, longest or DEFAULT_SEQ_LEN)}


class CausalLMLogits(nn.Module):
    """A transformers causal LM returning only its logits (B, T, vocabulary), without a KV cache."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, tokens):
        with as_in_the_real_run_when_fake(tokens):
            return self.lm(input_ids=tokens, use_cache=False).logits


class TransformersLogits(nn.Module):
    """A transformers model of any task, as a user's factory returned it, returning only the `.logits`
    of its output (a sequence classifier's (B, classes), a masked LM's (B, T, vocabulary))."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs):
        with as_in_the_real_run_when_fake(inputs):
            return self.model(inputs).logits


def is_transformers_model(module: nn.Module) -> bool:
    """A transformers PreTrainedModel. Asked without importing transformers: a model transformers
    built has imported it already."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)


def is_causal_lm(module: nn.Module) -> bool:
    """A transformers model whose own loss shifts its labels (ForCausalLMLoss): a class the Auto
    mapping of causal LMs names, or one named like them (a model of remote code)."""
    if not is_transformers_model(module):
        return False
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    name = type(module).__name__
    named = {n for names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
             for n in ((names,) if isinstance(names, str) else names)}
    return name in named or name.endswith("ForCausalLM")


def logits_of(model: nn.Module) -> nn.Module:
    """A user's model as zerolens trains it: a transformers model wrapped to return its logits
    (a causal LM without a KV cache), anything else as it is."""
    if is_causal_lm(model):
        return CausalLMLogits(model)
    return TransformersLogits(model) if is_transformers_model(model) else model


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Labels given as a causal LM's own loss takes them (the input ids, -100 where ignored), aligned
    with its logits as that loss aligns them (transformers' ForCausalLMLoss): position t predicts
    label t + 1, and the last position, with nothing to predict, is ignored (-100, cross-entropy's
    ignore_index)."""
    return nn.functional.pad(labels[..., 1:], (0, 1), value=-100)


@contextmanager
def as_in_the_real_run_when_fake(tokens):
    """While the peak is predicted on fake tensors, whose values cannot be read, answer the two
    questions transformers asks of values in training as the real run answers them:

    - Are several sequences packed in one row? (masking_utils.find_packed_sequence_indices, from the
      position ids.) Unable to tell, it would assume so, build a (B, 1, T, T) mask and give up SDPA's
      is_causal: an attention path, and a mask, the real run does not have. zerolens passes no
      position ids and every row is one sequence: "not packed" (None).
    - Is this layer dropped? (LayerDrop in OPT, Whisper, M2M100 and others: torch.rand([]) <
      layerdrop.) A draw of 1.0, which no layerdrop below 1 drops: with the default of 0 the real
      run drops none either, and with more the prediction is of the step that drops none, the
      highest."""
    if not isinstance(tokens, FakeTensor):
        yield
        return
    import torch
    import transformers.masking_utils as masking
    find, rand = masking.find_packed_sequence_indices, torch.rand

    def layer_drop_draw(*size, **kwargs):
        # A Python number: compared with layerdrop it gives a plain bool (a tensor would be fake).
        return 1.0 if size in (([],), ((),), ()) and not kwargs else rand(*size, **kwargs)

    masking.find_packed_sequence_indices = lambda position_ids: None
    torch.rand = layer_drop_draw
    try:
        yield
    finally:
        masking.find_packed_sequence_indices, torch.rand = find, rand


def build(model_config) -> nn.Module:
    """The model of a ModelConfig of kind "hf", fp32, on the current default device (the CPU, or the
    meta device under `with torch.device("meta")`), its depth the ModelConfig's."""
    transformers = transformers_or_error()
    try:
        config = transformers.AutoConfig.for_model(**at_depth(json.loads(model_config.hf_config),
                                                              model_config.num_layers))
        lm = transformers.AutoModelForCausalLM.from_config(config, dtype="float32")
    except UserError:
        raise
    except Exception as e:  # the configuration's values: a pad_token_id past the vocabulary, heads that do not divide
        raise UserError(f"--model {model_config.factory}: transformers {transformers.__version__} cannot build it "
                        f"({type(e).__name__}: {one_line_error(e)})") from None
    if model_config.activation_checkpointing:
        # transformers 5.25 calls it activation_checkpointing_enable, the old name warning that it goes in v6
        enable = getattr(lm, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm.train()
    return CausalLMLogits(lm)


def at_depth(values: dict, depth: int) -> dict:
    """A configuration's values (to_dict's) with `depth` layers. Its list of one entry per layer
    (`layer_types`: Qwen2's, Gemma2's, ... full or sliding attention) goes with the depth: where it is the
    one the configuration works out by itself from its other values, it is left out, to be worked out
    again for the new depth (Qwen2's first max_window_layers full, the rest sliding); else it is
    repeated in its shortest period (Gemma2's sliding, full, sliding, ...). A list with no shorter
    period is cut to a shallower depth, and refused for a deeper one: which kind the added layers
    would be, the configuration does not say. Without this, transformers indexed the old list past its
    end as the deeper model was built (plan's depth search, estimate --depth)."""
    layers = values.get("num_hidden_layers")
    kinds = values.get("layer_types")
    values = dict(values, num_hidden_layers=depth)
    if depth == layers or not isinstance(kinds, list) or len(kinds) != layers:
        return values
    import transformers
    worked_out = transformers.AutoConfig.for_model(**{k: v for k, v in values.items() if k != "layer_types"}
                                                   | {"num_hidden_layers": layers})
    if getattr(worked_out, "layer_types", None) == kinds:
        return {k: v for k, v in values.items() if k != "layer_types"}
    period = next(p for p in range(1, layers + 1) if all(kinds[i] == kinds[i - p] for i in range(p, layers)))
    if period == layers and depth > layers:
        raise UserError(f"the model's layer_types ({layers} layers) has no repeating pattern, so zerolens cannot "
                        f"build it {depth} layers deep (plan --no-depth, or estimate without --depth)")
    return values | {"layer_types": [kinds[i % period] for i in range(depth)]}


@contextmanager
def grouped_mm_of_any_float():
    """torch's meta kernel of _grouped_mm (the experts of Hugging Face's mixture-of-experts models)
    takes bf16 inputs only, the CPU's and CUDA's kernels also fp32 and fp16 (their fallback), which is
    what a model trained in fp32 under autocast gives them (DDP's, on fake tensors: "Expected inputs of
    BF16 type"). For the trace, an unscaled product of such inputs gets its output as the meta kernel
    makes it, in the inputs' dtype."""
    from torch import _meta_registrations as meta
    strict = getattr(meta, "_meta_grouped_mm_common", None)
    if strict is None or not hasattr(meta, "_create_grouped_mm_output_tensor"):  # a torch without them
        yield
        return

    def of_any_float(mat_a, mat_b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None,
                     **kwargs):
        if scale_a is None and scale_b is None and mat_a.dtype == mat_b.dtype and mat_a.dtype in (
                torch.float32, torch.float16):
            return meta._create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)
        return strict(mat_a, mat_b, scale_a, scale_b, offs=offs, bias=bias, scale_result=scale_result,
                      out_dtype=out_dtype, **kwargs)

    meta._meta_grouped_mm_common = of_any_float
    try:
        yield
    finally:
        meta._meta_grouped_mm_common = strict
