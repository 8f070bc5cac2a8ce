"""Models for the estimate tests, importable as module:factory."""
from torch import nn


def three_big_layers():
    return nn.Sequential(*(nn.Linear(4096, 4096) for _ in range(3)))


class WithAScalar(nn.Module):
    """A 0-dimensional parameter: FSDP2 shards on dim 0 and cannot take it."""

    def __init__(self):
        super().__init__()
        import torch
        self.scale = nn.Parameter(torch.tensor(1.0))
        self.linear = nn.Linear(8, 8)


def with_a_scalar():
    return WithAScalar()


def tiny_classifier():
    """For --model: an embedding and two blocks in an nn.ModuleList (FSDP2 shards each block)."""
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(64, 16)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(2))
            self.head = nn.Linear(16, 4)

        def forward(self, tokens):
            x = self.embedding(tokens)
            for block in self.blocks:
                x = x + block(x)
            return self.head(x[:, 0])  # the class is in the first token
    return Tiny()


def tiny_batch(step, batch_size, seed):
    """For --batch: 6 tokens per sample; the class is the first token modulo 4."""
    import torch
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    tokens = torch.randint(64, (batch_size, 6), generator=gen)
    return tokens, tokens[:, 0] % 4


def wrong_batch(step, batch_size, seed):
    import torch
    return torch.zeros(batch_size + 1, 6, dtype=torch.long), torch.zeros(batch_size + 1, dtype=torch.long)


def tuple_output():
    """Returns (logits, hidden), as many models do."""
    class TupleOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = tiny_classifier()

        def forward(self, tokens):
            return self.inner(tokens), None
    return TupleOut()


def dict_output():
    """Returns {"logits": ...}, as a Hugging Face model's output does."""
    class DictOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = tiny_classifier()

        def forward(self, tokens):
            return {"logits": self.inner(tokens)}
    return DictOut()


def per_token_targets(step, batch_size, seed):
    """Targets per token (batch, 6) for a model whose logits are per sample (batch, 4)."""
    tokens, _ = tiny_batch(step, batch_size, seed)
    return tokens, tokens % 4


def batch_named_otherwise(i, n, s):
    """The batch contract is positional: (step, batch_size, seed) under any names."""
    return tiny_batch(i, n, s)


def keyword_only_batch(*, seed, batch_size, step):
    """The same batch, with keyword-only parameters in another order."""
    return tiny_batch(step, batch_size, seed)


def frozen_embedding():
    """A LoRA-style fine-tune in small: tiny_classifier with its embedding frozen (requires_grad off)."""
    model = tiny_classifier()
    model.embedding.weight.requires_grad_(False)
    return model


def bf16_weights():
    """tiny_classifier built in bf16: a model whose weights are already half precision."""
    import torch
    return tiny_classifier().to(torch.bfloat16)


def mixed_weights():
    """tiny_classifier with one layer in bf16 and the rest fp32."""
    import torch
    model = tiny_classifier()
    model.head.to(torch.bfloat16)
    return model


def lora_classifier():
    """LoRA in small: tiny_classifier's weights frozen, a trainable low-rank adapter (rank 2) beside each
    block's first linear layer."""
    import torch

    class LoRALinear(nn.Module):
        def __init__(self, base: nn.Linear, rank: int = 2):
            super().__init__()
            self.base = base.requires_grad_(False)
            self.down = nn.Parameter(torch.randn(rank, base.in_features) * 0.01)
            self.up = nn.Parameter(torch.zeros(base.out_features, rank))

        def forward(self, x):
            return self.base(x) + (x @ self.down.t()) @ self.up.t()

    model = tiny_classifier().requires_grad_(False)
    for block in model.blocks:
        block[0] = LoRALinear(block[0])
    model.head.requires_grad_(True)
    return model


def tiny_llama():
    """The tiny Llama of examples/hf, as transformers builds it: zerolens reads its .logits and shifts
    the labels as its own loss does."""
    import json
    from pathlib import Path

    import transformers
    config = json.loads((Path(__file__).parent.parent / "examples" / "hf" / "llama-tiny.json").read_text())
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))


def llama_with_checkpointing():
    """tiny_llama with transformers' gradient checkpointing enabled by the user."""
    lm = tiny_llama()
    lm.gradient_checkpointing_enable()
    return lm


def llama_batch(step, batch_size, seed):
    """16 random tokens of the tiny Llama's vocabulary (1024), with labels as a causal LM's own loss takes
    them: the input ids."""
    import torch
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    tokens = torch.randint(1024, (batch_size, 16), generator=gen)
    return tokens, tokens.clone()


def tiny_bert_classifier():
    """A transformers sequence classifier (4 classes, as tiny_batch labels them), as transformers builds it."""
    import transformers
    config = transformers.BertConfig(vocab_size=1024, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64, num_labels=4)
    return transformers.BertForSequenceClassification(config)


def compiled_classifier():
    """tiny_classifier under the user's own torch.compile."""
    import torch
    return torch.compile(tiny_classifier())


def float_mlp():
    """An MLP on float features (no embedding): its inputs are floating point, as the batch makes them."""
    return nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 4))


def float_batch(step, batch_size, seed):
    """For float_mlp: 12 float features per sample; the class is the sign pattern of the first two."""
    import torch
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    features = torch.randn(batch_size, 12, generator=gen)
    return features, (features[:, 0] > 0).long() * 2 + (features[:, 1] > 0).long()


def broken_factory():
    """A factory that fails as a user's can (a checkpoint it cannot find)."""
    raise RuntimeError("missing checkpoint file")


def with_an_unused_layer():
    """tiny_classifier with a layer its forward never calls: no gradient reaches it."""
    model = tiny_classifier()
    model.spare = nn.Linear(16, 16)
    return model


def targets_past_the_classes(step, batch_size, seed):
    """tiny_batch's tokens with targets 4 to 7, for a model of 4 classes."""
    tokens, targets = tiny_batch(step, batch_size, seed)
    return tokens, targets + 4


def batch_failing_at_step_3(step, batch_size, seed):
    """tiny_batch, but the data of step 3 cannot be read."""
    if step == 3:
        raise OSError("data shard 3 missing")
    return tiny_batch(step, batch_size, seed)


def small_layers():
    """For --model: 3,950 parameters in odd widths, every one under ZeRO-3's persistence threshold and
    its activations small: the peak of backward is at the reduce-scatter of the gradients."""
    class Small(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(7, 33)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(33, 17), nn.GELU(), nn.Linear(17, 33)) for _ in range(3))
            self.out = nn.Linear(33, 5)

        def forward(self, x):
            x = self.inp(x)
            for block in self.blocks:
                x = x + block(x)
            return self.out(x)
    return Small()


def small_batch(step, batch_size, seed):
    """For --batch with small_layers: 7 features; the class is the signs of the first two (4 of 5 used)."""
    import torch
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    x = torch.randn(batch_size, 7, generator=gen)
    return x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()


def with_batch_norm():
    """For --model with tiny_batch: a BatchNorm1d between two layers (its running statistics are fp32 buffers)."""
    class WithBatchNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(64, 16)
            self.norm = nn.BatchNorm1d(16)
            self.head = nn.Linear(16, 4)

        def forward(self, tokens):
            return self.head(self.norm(self.embedding(tokens).mean(1)))
    return WithBatchNorm()


def one_weight():
    """For --model with small_batch: one parameter of one element, scaling the first 5 of its 7 features."""
    class OneWeight(nn.Module):
        def __init__(self):
            super().__init__()
            import torch
            self.scale = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return x[:, :5] * self.scale
    return OneWeight()

