"""zerolens: what data-parallel sharding does to training memory, per rank, measured and predicted."""
__version__ = "0.1.0"
