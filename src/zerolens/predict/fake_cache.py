"""FakeTensorMode's cache of operations' outputs, keyed in a way a trace can afford and ZeRO's flat
buffers can use.

torch's fake tensor mode answers an operation it has seen with the same inputs' metadata from a cache
(FakeTensorMode._cached_dispatch_impl) and computes others through the operation's meta kernel, often
Python (a layer norm's, a matrix product's). Two things made that cache cost a trace much:

- Its key holds each input's storage offset and storage size. DeepSpeed's ZeRO-1 and ZeRO-2 keep a
  model's parameters as views into one flat buffer, each at an offset of its own: every block's layer
  norms and matrix products met the cache as new, and a trace of gpt-1b 26 blocks deep at 8 ranks spent
  half its time in meta kernels. An operation whose meta kernel makes its outputs new, at offset 0 of
  storages of their own, makes the same outputs wherever its inputs lie in their storages (their shapes,
  strides and dtypes are in the key all the same): for those (fresh_outputs: elementwise operations and
  reductions, which TensorIterator gives new outputs, and the matrix products, layer norms, casts and
  embeddings a trace meets on those buffers) the key leaves the offsets and sizes out. Every other keeps
  them: views, in-place and out= operations, and those that alias and mutate nothing but lay their
  outputs out as their inputs (slice_scatter's output lies at its input's offset, copy's in a storage of
  its input's size: a schema alone does not tell them apart).
- Its key is made in Python, field by field and each dimension with its type (_prep_args_for_hash,
  TensorMetadata._flatten_into): a fifth of a trace's time (the key alone 1.87 s of 9.4 s in three DDP
  traces of gpt-1b at 8 ranks, timed in the process), the optimizer's operations on lists of every parameter the
  most. Here a tensor is one tuple of what torch's key holds of it: dtype, shape, strides, device,
  storage offset and bytes (where kept, above), requires_grad, conj, neg, inference. The rest of
  torch's metadata follows from those for the strided tensors of a trace (memory format from shape and
  strides, quantization from the dtype); any other input (a sparse tensor, a symbolic size, another
  mode's fake tensor, a process group) leaves the operation to torch's own key. These keys hold a
  marker torch's never do: they cannot meet an entry torch keyed.

Keys equal here are equal in torch's own key but for the offsets of those operations, so the outputs
are the ones torch's cache would give, and so the trace's allocations: tests/test_fake_cache.py checks
each named operator's outputs at two offsets, and compares traces with and without these keys.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect

import torch
from torch._subclasses import fake_tensor

# Arguments kept in a key as their type and value, as torch's key keeps them (1 and 1.0 hash alike)
PLAIN = (int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_OWN_KEY = object()  # the first element of every key made here


class _TorchsKey(Exception):
    """An argument these keys do not hold: the operation is keyed by torch."""


# Operators whose meta kernels make their outputs new, at offset 0 of storages of their own (fresh_outputs):
# by tag, those TensorIterator gives new outputs; by name, those met on ZeRO-1/2's flat buffers besides.
NEW_OUTPUT_TAGS = (torch.Tag.pointwise, torch.Tag.reduction)
NEW_OUTPUT_OPERATORS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::native_layer_norm",
                        "aten::native_layer_norm_backward", "aten::_to_copy", "aten::embedding", "aten::new_empty"}


@functools.cache
def fresh_outputs(func) -> bool:
    """Whether an operator's outputs are new tensors whose metadata does not depend on where its inputs lie
    in their storages: it aliases no input, mutates none, and makes its outputs new (NEW_OUTPUT_TAGS,
    NEW_OUTPUT_OPERATORS). A schema alone does not say it: slice_scatter aliases nothing and lays its output
    out at its input's offset."""
    schema = getattr(func, "_schema", None)
    return isinstance(func, torch._ops.OpOverload) and schema is not None and not schema.is_mutable \
        and all(value.alias_info is None for value in schema.returns) \
        and (schema.name in NEW_OUTPUT_OPERATORS or any(tag in func.tags for tag in NEW_OUTPUT_TAGS))


# What torch's key holds of a tensor (torch 2.11's and 2.13's TensorMetadata): _flattened's tuple holds these or
# what they follow from for a strided tensor (layout, sparsity and quantization from the dtype and layout,
# memory format from shape and strides).
KEYED_FIELDS = ("dtype", "shape", "stride", "device", "layout", "memory_format", "storage_offset", "storage_bytes",
                "requires_grad", "is_quantized", "is_conj", "is_neg", "is_inference", "is_sparse", "is_coalesced",
                "dense_dim", "sparse_dim")


@functools.cache  # read once a process, not at every trace
def supported() -> bool:
    """Whether this torch's fake tensor cache has the shape read here (torch 2.13's and 2.11's have it): its
    key made by FakeTensorMode._cache_key(state, func, args, kwargs) as a _DispatchCacheKey of one tuple,
    each tensor in it by the fields KEYED_FIELDS names. A torch whose key holds another field of a tensor
    keeps its own keys, which hold it."""
    key = getattr(fake_tensor.FakeTensorMode, "_cache_key", None)
    made = getattr(fake_tensor, "_DispatchCacheKey", None)
    metadata = getattr(fake_tensor, "TensorMetadata", None)
    return (key is not None and made is not None and isinstance(getattr(fake_tensor.FakeTensorMode, "cache", None), dict)
            and list(inspect.signature(key).parameters) == ["self", "state", "func", "args", "kwargs"]
            and list(inspect.signature(made).parameters) == ["tup"]
            and dataclasses.is_dataclass(metadata)
            and tuple(field.name for field in dataclasses.fields(metadata)) == KEYED_FIELDS)


def _flattened(mode, out: list, args, fresh: bool) -> None:
    """`args` (a sequence or a dict) into `out`, as torch's _prep_args_for_hash orders them: a container's
    type and length, then its items; a tensor as one tuple; a plain value with its type."""
    out += (type(args), len(args))
    if isinstance(args, dict):
        out.append(tuple(args))  # the keys' names, then their values
        args = args.values()
    for arg in args:
        kind = type(arg)
        if kind is fake_tensor.FakeTensor:
            if arg.fake_mode is not mode or arg.constant is not None or arg.layout is not torch.strided:
                raise _TorchsKey
            out.append((arg.dtype, tuple(arg.shape), arg.stride(), arg.device,
                        None if fresh else arg.storage_offset(), None if fresh else arg.untyped_storage().nbytes(),
                        arg.requires_grad, arg.is_conj(), arg.is_neg(), arg.is_inference()))
        elif isinstance(arg, (list, tuple)):
            _flattened(mode, out, arg, fresh)
        elif kind in PLAIN:
            out += (kind, arg)
        else:
            raise _TorchsKey


@contextlib.contextmanager
def trace_cache_keys():
    """While in it, FakeTensorMode keys an operation as the module's docstring says: fast, and without its
    inputs' storage offsets and sizes where its outputs are fresh (fresh_outputs). Restored afterwards,
    whatever happens; where this torch's cache is not of the shape read here, nothing changes."""
    if not supported():
        yield
        return
    torchs = fake_tensor.FakeTensorMode._cache_key

    def key(self, state, func, args, kwargs):
        if self.shape_env is not None or torch.fx.experimental.proxy_tensor.get_proxy_mode() is not None:
            return torchs(self, state, func, args, kwargs)
        # What torch's key holds besides the arguments (_cache_key): no shape environment, no tracing
        out = [_OWN_KEY, func, torch.get_default_dtype(), torch._C._get_default_device(),
               torch.is_inference_mode_enabled()]
        try:
            fresh = fresh_outputs(func)
            _flattened(self, out, args, fresh)
            _flattened(self, out, kwargs or {}, fresh)
        except _TorchsKey:
            return torchs(self, state, func, args, kwargs)
        return fake_tensor._DispatchCacheKey(tuple(out))

    fake_tensor.FakeTensorMode._cache_key = key
    try:
        yield
    finally:
        fake_tensor.FakeTensorMode._cache_key = torchs
