"""A synthetic classification task with a rule the model can learn.

Each sample has a class c in [0, num_classes). A fraction `signal` of its tokens is drawn from
the class's own tokens {v : v % num_classes == c}, the rest uniformly from the vocabulary.
The label is c. Because the model mean-pools over the sequence, a bag-of-tokens rule is one it
can represent; the case study's fresh random labels gave it nothing to learn.

Batches are a pure function of (seed, step): every strategy sees the same global batch at a
step, and rank r takes rows [r * micro, (r + 1) * micro).
"""
from __future__ import annotations

import torch


def global_batch(step: int, *, seed: int, batch_size: int, seq_len: int, vocab_size: int,
                 num_classes: int, signal: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (tokens (B, T) int64, labels (B,) int64) on the CPU."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    labels = torch.randint(num_classes, (batch_size,), generator=gen)
    noise = torch.randint(vocab_size, (batch_size, seq_len), generator=gen)
    # A class token: a random multiple of num_classes plus the label, kept inside the vocabulary.
    per_class = (vocab_size - 1 - labels) // num_classes + 1  # (B,) tokens of that class
    pick = (torch.rand(batch_size, seq_len, generator=gen) * per_class[:, None]).long()
    class_tokens = pick * num_classes + labels[:, None]
    is_signal = torch.rand(batch_size, seq_len, generator=gen) < signal
    return torch.where(is_signal, class_tokens, noise), labels


def rank_slice(tokens: torch.Tensor, labels: torch.Tensor, rank: int, world_size: int):
    """Rank r's micro-batch: rows [r * micro, (r + 1) * micro) of the global batch."""
    micro = tokens.shape[0] // world_size
    rows = slice(rank * micro, (rank + 1) * micro)
    return tokens[rows], labels[rows]
