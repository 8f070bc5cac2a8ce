"""Data-parallel strategies: the Strategy interface (base.py), one module per backend (ddp.py,
deepspeed.py, fsdp2.py), and the registry (registry.py), the one place that knows each by name."""
from . import registry
from .base import DTYPES, Strategy, TrainSettings, loss_of
from .registry import make_strategy, names, spec

__all__ = ["DTYPES", "Strategy", "TrainSettings", "loss_of", "make_strategy", "names", "registry", "spec"]
