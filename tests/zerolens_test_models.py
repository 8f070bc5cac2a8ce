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
