"""strategies: the Strategy interface (base.py), one module per backend (ddp.py, deepspeed.py with
deepspeed_stage3.py, fsdp2.py) with its step model, each backend's retained layout (layout.py), and the
registry (registry.py), the one place that knows each by name. May import measure/, models/ and the
foundation."""
from zerolens.models.model import loss_of
from zerolens.strategies import registry
from zerolens.strategies.base import DTYPES, Strategy, TrainSettings
from zerolens.strategies.registry import make_strategy, names, spec

__all__ = ["DTYPES", "Strategy", "TrainSettings", "loss_of", "make_strategy", "names", "registry", "spec"]
