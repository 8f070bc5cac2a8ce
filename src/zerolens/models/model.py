"""The models, written for one device. Parallelism is applied from outside by a Strategy;
nothing here knows about ranks.

- "classifier" (the case study's): embedding (vocab, d_model) -> nn.TransformerEncoder
  (batch_first) -> mean over the sequence -> linear head to the classes. Defaults give the case
  study's 0.53M parameters.
- "gpt": a GPT-style decoder for next-token prediction: token and learned position embeddings,
  pre-norm blocks of causal self-attention (torch's scaled_dot_product_attention, which picks
  flash attention on GPUs) and a 4x GELU MLP, a final LayerNorm and an untied output head.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn

from zerolens.errors import UserError

CHECKPOINTABLE_KINDS = ("gpt", "hf")  # model kinds with activation checkpointing


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    kind: str = "classifier"  # classifier | gpt | user | hf
    # kind "user" (--model/--batch): "module:function" of a factory returning your nn.Module, and of
    # a function batch(step, batch_size, seed) -> (inputs, targets); see load_user_function.
    factory: str = ""
    batch: str = ""
    # kind "user" whose factory returns a transformers causal LM: the batch's targets are its labels
    # as the model's own loss takes them, shifted as that loss shifts them (hf.shift_labels).
    shift_labels: bool = False
    # kind "hf" (--model hf:...): the Hugging Face configuration as JSON (hf.py), its depth num_layers.
    hf_config: str = ""
    vocab_size: int = 1000
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 4
    ffn_dim: int = 512
    num_classes: int = 10
    seq_len: int = 32
    norm_first: bool = False  # nn.TransformerEncoderLayer's default (post-norm), as in the case study
    # GPT only: keep each block's input and recompute the block in backward (torch.utils.checkpoint),
    # trading about one more forward per step for most of the activation memory.
    activation_checkpointing: bool = False
    # GPT only: torch.compile each block (fuses the LayerNorms, GELU and residual adds around the
    # matrix products); the first steps pay for the compilation.
    compile_blocks: bool = False

    def __post_init__(self):
        if self.kind not in ("classifier", "gpt", "user", "hf"):
            raise ValueError(f"unknown model kind {self.kind!r}")
        if self.kind == "user" and not (self.factory and self.batch):
            raise ValueError("a user model needs both a factory and a batch function")
        if self.activation_checkpointing and self.kind not in CHECKPOINTABLE_KINDS:
            raise ValueError("activation checkpointing is implemented for the GPT presets and Hugging Face models only")
        if self.compile_blocks and self.kind != "gpt":
            raise ValueError("compiling is implemented for the GPT presets only")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by num_heads {self.num_heads}")


# Built-in models. "case-study" is the demo's; "case-study-130m" is the same architecture scaled to
# 133.5M parameters (a 32000-token vocabulary, width 1024, 8 layers), for memory that is not
# dominated by buffers and workspaces. It normalises before each sublayer (pre-norm): post-norm at
# this width and lr 1e-4 without warm-up jumped from loss 2.4 to 3.7 after one step on 2xH200.
#
# The GPT presets (vocabulary 32000, sequence 1024, MLP 4x width) are sized like GPT-2's family;
# gpt-1b has the shape of the 937M-parameter model of issue 4's reference figures (d 2048, 16
# layers); this decoder's biases and untied head make it 938.9M. gpt-tiny is for
# CPU tests.
def gpt(d_model: int, num_layers: int, num_heads: int, *, vocab_size: int = 32000, seq_len: int = 1024) -> ModelConfig:
    return ModelConfig(kind="gpt", vocab_size=vocab_size, d_model=d_model, num_layers=num_layers,
                       num_heads=num_heads, ffn_dim=4 * d_model, seq_len=seq_len, norm_first=True)


PRESETS = {
    "case-study": ModelConfig(),
    "case-study-130m": ModelConfig(vocab_size=32000, d_model=1024, num_layers=8, num_heads=16, ffn_dim=4096,
                                   seq_len=128, norm_first=True),
    "gpt-tiny": gpt(64, 2, 4, vocab_size=512, seq_len=64),  # 0.17M
    "gpt-100m": gpt(768, 8, 12),  # 106M
    "gpt-350m": gpt(1024, 24, 16),  # 369M
    "gpt-1b": gpt(2048, 16, 16),  # 938.9M
}


class CaseStudyModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.d_model)
        layer = nn.TransformerEncoderLayer(
            d_model=config.d_model,
            nhead=config.num_heads,
            dim_feedforward=config.ffn_dim,
            batch_first=True,
            norm_first=config.norm_first,
        )
        # enable_nested_tensor only matters for padded inference; off keeps a warning away.
        self.encoder = nn.TransformerEncoder(layer, num_layers=config.num_layers, enable_nested_tensor=False)
        self.head = nn.Linear(config.d_model, config.num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)  # (B, T, d_model)
        x = self.encoder(x)  # (B, T, d_model)
        return self.head(x.mean(dim=1))  # (B, num_classes)


class DecoderBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        d = config.d_model
        self.num_heads = config.num_heads
        self.attn_norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.attn_out = nn.Linear(d, d)
        self.mlp_norm = nn.LayerNorm(d)
        self.mlp_in = nn.Linear(d, config.ffn_dim)
        self.mlp_out = nn.Linear(config.ffn_dim, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.num_heads, d // self.num_heads).unbind(2)
        attn = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                          is_causal=True)  # (B, heads, T, head_dim)
        x = x + self.attn_out(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_out(nn.functional.gelu(self.mlp_in(self.mlp_norm(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embedding = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(DecoderBlock(config) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2's initialisation: N(0, 0.02), the residual projections scaled by 1/sqrt(2 * layers)
        so that the residual stream's variance does not grow with depth; biases zero, LayerNorm
        weights one. Every parameter is written, so the model can be built on the meta device."""
        for name, p in self.named_parameters():
            if p.dim() > 1:
                residual = name.endswith(("attn_out.weight", "mlp_out.weight"))
                nn.init.normal_(p, std=0.02 / (2 * self.config.num_layers) ** 0.5 if residual else 0.02)
            elif "norm" in name and name.endswith("weight"):
                nn.init.ones_(p)
            else:
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)  # (B, T, d_model)
        for block in self.blocks:
            if self.config.activation_checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.norm(x))  # (B, T, vocab)


def build_model(config: ModelConfig, seed: int) -> nn.Module:
    """The same initial weights for every strategy and rank: seeded, built on the CPU in fp32."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if config.kind == "user":
            return user_model(config)
        if config.kind == "hf":
            from zerolens.models.hf import build
            return build(config)
        if config.kind == "classifier":
            return CaseStudyModel(config)
        # Built on the meta device, then initialised once: torch's default initialisation of each
        # layer would be thrown away, and it doubles the time to build gpt-1b on the CPU.
        with torch.device("meta"):
            model = GPT(config)
        model.to_empty(device="cpu")
        model.init_weights()
    if config.compile_blocks:
        for block in model.blocks:
            block.compile()  # one graph serves every block: parameters are the graph's inputs
    return model


def meta_model(config: ModelConfig) -> nn.Module:
    """The model on the meta device: shapes and dtypes, no memory, no time."""
    with torch.device("meta"):
        if config.kind == "hf":
            from zerolens.models.hf import build
            return build(config)
        return user_model(config) if config.kind == "user" else GPT(config) if config.kind == "gpt" \
            else CaseStudyModel(config)


def to_empty_keeping_ties(model: nn.Module, device: torch.device) -> nn.Module:
    """`model.to_empty(device=device)` with its tied parameters tied again: to_empty gives every
    module its own new parameter, so a weight shared by two modules (GPT-2's embedding and head)
    would become two, and count twice. A contiguous tensor's new storage is made from its shape (what
    empty_like keeps of it): empty_like of a meta tensor inside FakeTensorMode first converts the meta
    tensor to a fake one and misses the mode's cache, ~0.3 ms a parameter in each trace."""
    owners: dict[int, tuple[nn.Module, str]] = {}
    ties = []
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if id(p) in owners:
                    ties.append((module, name, owners[id(p)]))
                else:
                    owners[id(p)] = (module, name)
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device) if t.is_contiguous()
                 else torch.empty_like(t, device=device))
    for module, name, (owner, owner_name) in ties:
        setattr(module, name, getattr(owner, owner_name))
    return model


@dataclass(frozen=True)
class Built:
    """What zerolens reads of a model's make-up, from one copy built on the meta device (model_built)."""
    shapes: tuple[torch.Size, ...]  # its parameters', in parameters() order (a tied weight once)
    trainable: tuple[bool, ...]  # requires_grad of each
    weight_bytes: int | None  # weight_bytes_of
    compiled: bool  # compiled_of


@functools.lru_cache(maxsize=64)
def built_from(key: str, config: ModelConfig) -> Built:
    model = meta_model(config)
    return Built(tuple(p.shape for p in model.parameters()), tuple(p.requires_grad for p in model.parameters()),
                 weight_bytes_of(model), compiled_of(model))


def model_built(config: ModelConfig) -> Built:
    """The model's make-up, built once per configuration in a process: a Hugging Face Llama-2-70B takes
    about a second to build even on the meta device, and each strategy's prediction asked for it three
    times (estimate, 512 ranks: 8 s of its 143 s of processor time). Keyed by repr: a Hugging Face
    model's configuration holds dicts, which do not hash."""
    return built_from(repr(config), config)


def parameter_shapes(config: ModelConfig) -> list[torch.Size]:
    """The shapes of the model's parameters, from a copy built on the meta device."""
    return list(model_built(config).shapes)


MIXED_WEIGHTS = ("--model {model}: the model's parameters mix dtypes; zerolens predicts models whose weights share "
                 "one dtype (fp32, or bf16/fp16 throughout): cast the model to one before you return it")


def check_weights_and_precision(weights: int, precision: str, model: str) -> None:
    """A model built in 16 bits trains, under zerolens, in its own precision: --precision fp32 would
    have DDP and FSDP2 train the 16-bit weights as they are while DeepSpeed's fp32 keeps them otherwise,
    and each figure be predicted for fp32 weights (a bf16 model's ZeRO-2 run was predicted twice its
    parameter bytes)."""
    if weights == 2 and precision == "fp32":
        raise UserError(f"--precision fp32 with --model {model}: its parameters are 16-bit (built in bf16 or fp16), "
                        "and zerolens trains and predicts such a model in its own precision: use --precision bf16 "
                        "or fp16, as it was built, or build it in fp32")


def weight_bytes(config: ModelConfig) -> int | None:
    """The bytes per element of the model's weights as built: 4 for fp32, 2 for a model built in
    bf16 or fp16 (which DDP and FSDP2 train as they are); None where its parameters mix dtypes."""
    return model_built(config).weight_bytes


def weight_bytes_of(model: nn.Module) -> int | None:
    """weight_bytes for a model already built (on the meta device)."""
    sizes = {p.element_size() for p in model.parameters()}
    return sizes.pop() if len(sizes) == 1 else None


def compiled(config: ModelConfig) -> bool:
    """Whether the model is compiled, by --compile or by the user's own factory (torch.compile of the
    model or of a part, or a module's .compile())."""
    return config.compile_blocks or model_built(config).compiled


def compiled_of(model: nn.Module) -> bool:
    """Whether a model built is compiled, whole or in part."""
    from torch._dynamo.eval_frame import OptimizedModule
    return any(isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None
               for m in model.modules())


def trainable_flags(config: ModelConfig) -> list[bool]:
    """Which of the model's parameters train (requires_grad), in parameters() order: a frozen
    embedding or a LoRA base does not."""
    return list(model_built(config).trainable)


def trained_elements(numels: list[int], trainable: list[bool] | None) -> int:
    """The elements of the parameters that train (`trainable`: trainable_flags, None: all), of `numels`."""
    return sum(n for n, trains in zip(numels, trainable or [True] * len(numels)) if trains)


def load_user_function(spec: str):
    """`module:function` -> the function. The module is looked up on sys.path (PYTHONPATH) and in the
    current folder, as `python -m` finds it. ValueError says what is wrong."""
    import importlib
    import os
    import sys
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ValueError(f"expected module:function, got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        # The `zerolens` script, unlike `python -m`, leaves it out. Appended, not put first: a folder
        # in it must not shadow an installed package (a local `deepspeed/`, say).
        sys.path.append(os.getcwd())
    try:
        function = getattr(importlib.import_module(module_name), name)
    except ModuleNotFoundError as e:
        raise ValueError(f"cannot load {spec}: {e} (looked in the current folder {os.getcwd()} and on "
                         "PYTHONPATH)") from None
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load {spec}: {e}") from None
    if not callable(function):
        raise ValueError(f"{spec} is not a function")
    return function


def user_model(config: ModelConfig) -> nn.Module:
    """Your model, from --model module:factory: built for one device, fp32. Its output are logits
    (..., classes) that zerolens compares with the integer targets of your batch function; a
    transformers model's output is read for its `.logits` (hf.logits_of)."""
    from zerolens.models.hf import logits_of
    model = load_user_function(config.factory)()
    if not isinstance(model, nn.Module):
        raise ValueError(f"{config.factory} returned {type(model).__name__}, not a torch.nn.Module")
    return logits_of(model)


def returns_causal_lm(factory: str) -> bool:
    """Whether the factory (module:function) returns a transformers causal LM, built on the meta device
    to tell."""
    from zerolens.models.hf import is_causal_lm
    with torch.device("meta"):
        return is_causal_lm(load_user_function(factory)())


def training_flops_per_token(config: ModelConfig, params: int) -> int | None:
    """Forward and backward FLOPs per token, as Megatron-LM and PaLM (appendix B) count them:
    6 per weight that multiplies (every parameter but the embedding tables) plus 12 * layers *
    width * sequence for attention's two matrix products, counted as if not causal. For the
    classifier the head runs once per sample, not per token: this overcounts it slightly. None for
    a user's model or a Hugging Face one: zerolens does not know its arithmetic."""
    if config.kind in ("user", "hf"):
        return None
    embeddings = config.vocab_size * config.d_model + (config.seq_len * config.d_model if config.kind == "gpt" else 0)
    return 6 * (params - embeddings) + 12 * config.num_layers * config.d_model * config.seq_len


def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss zerolens trains every model on: cross-entropy in fp32, for a classifier ((B, C) logits,
    (B,) labels) and a language model ((B, T, V) logits, (B, T) labels) alike; labels of -100 are
    ignored (hf.shift_labels)."""
    return nn.functional.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())


@functools.cache
def compiled_loss_of():
    """loss_of compiled by torch.compile, for a compiled model (--compile): the cast of the logits to fp32,
    the softmax and its gradient become one pass over the bf16 logits, so no (tokens, vocab) fp32 tensor is
    whole. gpt-1b on one H100, micro-batch 16: 2.6% less step time and 1.3 GiB less allocated at the peak
    (docs/results/1xh100/issue25/run10)."""
    return torch.compile(loss_of)


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
