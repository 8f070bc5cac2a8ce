"""zerolens: what data-parallel sharding does to training memory, per rank, measured and predicted."""
from zerolens._version import __version__

__all__ = ["__version__"]
