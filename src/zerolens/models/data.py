"""Synthetic tasks with a rule the model can learn, one per model kind.

Classifier (the case study's model):

Each sample has a class c in [0, num_classes). A fraction `signal` of its tokens is drawn from
the class's own tokens {v : v % num_classes == c}, the rest uniformly from the vocabulary.
The label is c. Because the model mean-pools over the sequence, a bag-of-tokens rule is one it
can represent; the case study's fresh random labels gave it nothing to learn.

Language model (the GPT presets, and Hugging Face causal LMs): each sequence follows a fixed successor table, a random
permutation of the vocabulary drawn from the seed: with probability `signal` the next token is
the successor of the current one, otherwise uniform. The model predicts every next token; the
best achievable loss is the entropy of that rule (about 2.6 nats for a 32000-token vocabulary at
signal 0.8, against ln(32000) = 10.4 for a uniform guess).

Batches are a pure function of (seed, step): every strategy sees the same global batch at a
step, and rank r takes rows [r * micro, (r + 1) * micro).
"""
from __future__ import annotations

import inspect

import torch

from zerolens.models.hf import shift_labels
from zerolens.models.model import ModelConfig, load_user_function


def make_batch(model: ModelConfig, step: int, *, seed: int, batch_size: int,
               signal: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step` for this model's task: (tokens, labels) on the CPU."""
    if model.kind == "user":
        inputs, targets = user_batch(model.batch, step, seed=seed, batch_size=batch_size)
        return (inputs, shift_labels(targets)) if model.shift_labels else (inputs, targets)
    if model.kind in ("gpt", "hf"):  # a Hugging Face causal LM learns the GPT presets' task
        return lm_batch(step, seed=seed, batch_size=batch_size, seq_len=model.seq_len,
                        vocab_size=model.vocab_size, signal=signal)
    return global_batch(step, seed=seed, batch_size=batch_size, seq_len=model.seq_len,
                        vocab_size=model.vocab_size, num_classes=model.num_classes, signal=signal)


def user_batch(spec: str, step: int, *, seed: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Your batch function (--batch module:function): function(step, batch_size, seed), by those
    names where it has them (keyword-only parameters included), else by position. It must return
    (inputs, targets): tensors on the CPU with batch_size rows, the same for the same arguments
    (every rank calls it and takes its own rows), targets integer class indices."""
    function = load_user_function(spec)
    arguments = {"step": step, "batch_size": batch_size, "seed": seed}
    try:
        names = set(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # no signature to read (a builtin, say): by position
        names = set()
    result = function(**arguments) if set(arguments) <= names else function(step, batch_size, seed)
    if not (isinstance(result, tuple) and len(result) == 2 and all(isinstance(t, torch.Tensor) for t in result)):
        raise ValueError(f"{spec} must return a tuple (inputs, targets) of tensors")
    inputs, targets = result
    if inputs.shape[0] != batch_size or targets.shape[0] != batch_size:
        raise ValueError(f"{spec} returned {inputs.shape[0]} inputs and {targets.shape[0]} targets for "
                         f"batch_size {batch_size}")
    if targets.is_floating_point():
        raise ValueError(f"{spec}: targets must be integer class indices, got {targets.dtype}")
    return inputs, targets


def lm_batch(step: int, *, seed: int, batch_size: int, seq_len: int, vocab_size: int,
             signal: float = 0.8) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (tokens (B, T), next tokens (B, T)), int64 on the CPU."""
    successor = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    sequence = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
    sequence[:, 0] = torch.randint(vocab_size, (batch_size,), generator=gen)
    noise = torch.randint(vocab_size, (batch_size, seq_len), generator=gen)
    follows = torch.rand(batch_size, seq_len, generator=gen) < signal
    if follows.any():
        for t in range(seq_len):
            sequence[:, t + 1] = torch.where(follows[:, t], successor[sequence[:, t]], noise[:, t])
    else:  # signal 0 (the peak trace's batch, whose values are not read): the noise, without the loop
        sequence[:, 1:] = noise
    # clone, not contiguous: at batch size 1 both slices are contiguous already and would share one
    # storage, which a trace then sees otherwise than at any other size (predict/micro_batches.py)
    return sequence[:, :-1].clone(), sequence[:, 1:].clone()


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


def rank_batches(model: ModelConfig, *, seed: int, micro_batch: int, signal: float, rank: int, world_size: int):
    """This rank's micro-batch of every step, in order, made when it is needed: the same global batch
    for every strategy at a step, rank r's rows of it here."""
    step = 0
    while True:
        global_batch = make_batch(model, step, seed=seed, batch_size=micro_batch * world_size, signal=signal)
        # A copy of the rank's rows, the global batch dropped: the rank holds its micro-batch only, as
        # with a sampler that loads each rank's own rows (a view would keep every rank's rows alive).
        mine = tuple(t.clone() for t in rank_slice(*global_batch, rank, world_size))
        del global_batch
        yield mine
        step += 1


def rank_slice(tokens: torch.Tensor, labels: torch.Tensor, rank: int, world_size: int):
    """Rank r's micro-batch: rows [r * micro, (r + 1) * micro) of the global batch."""
    micro = tokens.shape[0] // world_size
    rows = slice(rank * micro, (rank + 1) * micro)
    return tokens[rows], labels[rows]
