"""Models for the estimate tests, importable as module:factory."""
from torch import nn


def three_big_layers():
    return nn.Sequential(*(nn.Linear(4096, 4096) for _ in range(3)))
