"""FakeTensorMode's cache of operations' outputs, made to serve operations on views into one flat buffer.

torch's fake tensor mode answers an operation it has seen with the same inputs' metadata from a cache
(FakeTensorMode._cached_dispatch_impl) and computes others through the operation's meta kernel, often
Python (a layer norm's, a matrix product's). Its cache key holds each input's storage offset and storage
size. DeepSpeed's ZeRO-1 and ZeRO-2 keep a model's parameters as views into one flat buffer, each at an
offset of its own: every block's layer norms and matrix products met the cache as new, and a trace of
gpt-1b 26 blocks deep at 8 ranks spent half its time in meta kernels.

An operation whose outputs are fresh tensors (its schema returns no alias of an input and mutates
none) makes outputs whose metadata does not depend on where its inputs lie in their storages: their
shapes, strides and dtypes are in the key all the same. For those operations the key is taken
without the inputs' storage offsets and sizes (cache_blind_to_storage_offsets); views, in-place and
out= operations, whose outputs are inputs or lie in their storages, keep them. The outputs are the
ones torch's own cache would give, and so the trace's allocations: tests/test_fake_cache.py compares
the traces with and without.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading

import torch
from torch._subclasses import fake_tensor

_keying = threading.local()  # set while a key is made for an operation with fresh outputs


@functools.cache
def fresh_outputs(func) -> bool:
    """Whether an operator returns only new tensors: no output an alias of an input, no input mutated."""
    schema = getattr(func, "_schema", None)
    return isinstance(func, torch._ops.OpOverload) and schema is not None and not schema.is_mutable \
        and all(value.alias_info is None for value in schema.returns)


@functools.cache  # read once a process, not at every trace
def supported() -> bool:
    """Whether this torch's fake tensor cache has the shape read here (torch 2.13's and 2.11's have it)."""
    metadata = getattr(fake_tensor, "TensorMetadata", None)
    key = getattr(fake_tensor.FakeTensorMode, "_cache_key", None)
    return (callable(getattr(fake_tensor, "extract_tensor_metadata", None)) and metadata is not None
            and dataclasses.is_dataclass(metadata) and {"storage_offset", "storage_bytes"}
            <= {field.name for field in dataclasses.fields(metadata)} and key is not None
            and list(inspect.signature(key).parameters) == ["self", "state", "func", "args", "kwargs"])


@contextlib.contextmanager
def cache_blind_to_storage_offsets():
    """While in it, FakeTensorMode keys an operation with fresh outputs (fresh_outputs) without its inputs'
    storage offsets and sizes. Restored afterwards, whatever happens; where this torch's cache is not of
    the shape read here, nothing changes."""
    if not supported():
        yield
        return
    extract, cache_key = fake_tensor.extract_tensor_metadata, fake_tensor.FakeTensorMode._cache_key

    def metadata(tensor):
        found = extract(tensor)
        if getattr(_keying, "fresh", False):
            return dataclasses.replace(found, storage_offset=0, storage_bytes=None)
        return found

    def key(self, state, func, args, kwargs):
        _keying.fresh = fresh_outputs(func)
        try:
            return cache_key(self, state, func, args, kwargs)
        finally:
            _keying.fresh = False

    fake_tensor.extract_tensor_metadata, fake_tensor.FakeTensorMode._cache_key = metadata, key
    try:
        yield
    finally:
        fake_tensor.extract_tensor_metadata, fake_tensor.FakeTensorMode._cache_key = extract, cache_key
