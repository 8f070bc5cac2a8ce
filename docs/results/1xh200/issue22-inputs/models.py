"""The inputs of issue 22 at a size where a GPU's figures mean something: a Llama-shaped causal LM of
about 100M parameters (8 layers, 768 wide, grouped-query attention, vocabulary 32000), as transformers
builds it, in three forms users bring, and the batch they train on (sequence 512)."""
import torch
from torch import nn

VOCAB, SEQ = 32000, 512


def llama():
    import transformers
    config = transformers.AutoConfig.for_model(
        "llama", hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
        num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=SEQ, tie_word_embeddings=False)
    return transformers.AutoModelForCausalLM.from_config(config)


class LoRALinear(nn.Module):
    """A frozen linear layer with a trainable low-rank adapter beside it (what peft's LoRA adds)."""

    def __init__(self, base: nn.Linear, rank: int = 16):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.down = nn.Parameter(torch.randn(rank, base.in_features) * 0.01)
        self.up = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x):
        return self.base(x) + (x @ self.down.t()) @ self.up.t()


def lora_llama():
    """Every weight frozen; rank-16 adapters on each attention's query and value projections."""
    model = llama().requires_grad_(False)
    for layer in model.model.layers:
        layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoRALinear(layer.self_attn.v_proj)
    return model


def bf16_llama():
    """The model built in bf16: weights already half precision."""
    return llama().to(torch.bfloat16)


def llama_with_checkpointing():
    """gradient_checkpointing_enable() called by the user, as a Trainer script does."""
    model = llama()
    model.gradient_checkpointing_enable()
    return model


def batch(step, batch_size, seed):
    """Random tokens, labels as a causal LM's own loss takes them: the input ids."""
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    tokens = torch.randint(VOCAB, (batch_size, SEQ), generator=gen)
    return tokens, tokens.clone()
