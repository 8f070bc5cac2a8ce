"""zerolens: what data-parallel sharding does to training memory, per rank, measured and predicted.

The functions a program calls, importable from here (each loaded when first asked for, so that
`import zerolens` costs nothing): `estimate` (each strategy's memory per rank, predicted without
training), `predict_peaks` (one rank's peak per phase, traced on fake tensors) and `predict_retained`
(the bytes a rank keeps per component) and `track` (what a user's own training loop holds, per rank and
phase, measured as verify measures it). Where each part of the code lives: docs/contributing.md.
"""
import time

IMPORTED_AT = time.time()  # the first import of zerolens: run/wall_time.py counts the imports from here

import importlib  # noqa: E402

from zerolens._version import __version__  # noqa: E402

_PUBLIC = {"estimate": "zerolens.commands.estimate", "predict_peaks": "zerolens.predict.peak",
           "predict_retained": "zerolens.strategies.registry", "track": "zerolens.tracking.track"}
__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'zerolens' has no attribute {name!r}")
