"""A plugin that registers a name zerolens already has: refused in one line (tests/test_registry.py)."""
from zerolens.strategies.registry import register, spec

register(spec("ddp"))
