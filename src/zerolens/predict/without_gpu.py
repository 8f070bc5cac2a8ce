"""Tracing a CUDA target where no GPU is visible: on fake CUDA tensors, as on the GPU machine, with
what torch would do there and does not do without a GPU.

Fake CUDA tensors need no GPU (FakeTensorMode gives them meta storage), so a CUDA target is traced
on them on any machine: CUDA's 512-byte rounding and device-side collectives follow. Two things
still differ without a GPU, and `gpu_behaviour` puts them right for the trace's duration:
- autocast: `torch.autocast("cuda")` disables itself where CUDA is not available
  (torch/amp/autocast_mode.py); the CUDA autocast kernels themselves are in every build, so the
  trace turns them on as a GPU would.
- attention: `scaled_dot_product_attention` picks its kernel by the GPU it runs on
  (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, select_sdp_backend); without a GPU it
  takes the math kernel, which holds the whole attention matrix for backward where the GPU's fused
  kernels hold one row statistic per query. `sdpa_backend` applies sdp_utils' rules for the
  target's compute capability, and the fused kernel's op is called as the GPU's dispatch calls it
  (flash: head dimension padded to a multiple of 8; memory-efficient: a boolean mask turned into an
  additive bias), so its outputs and saved tensors are the GPU's.
cuDNN's attention, which torch prefers on some GPUs with recent cuDNN builds (check_prefer_cudnn_
attention), is not modelled: flash is taken where cuDNN would be (the same outputs' bytes up to a row
statistic's shape). The GPU-traced and CPU-traced peaks are compared in docs/results/1xh200/issue21/.
"""
from __future__ import annotations

import contextlib
import math

import torch

FLASH, EFFICIENT, MATH = "flash_attention", "efficient_attention", "math"


def sdpa_backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask, dropout_p: float,
                 is_causal: bool, enable_gqa: bool, capability: tuple[int, int]) -> str:
    """The kernel torch's CUDA dispatch picks for these inputs on a GPU of `capability`, in its
    default order (flash, memory-efficient, math), by sdp_utils.cpp's checks for dense inputs."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return MATH
    if any(t.size(-2) == 0 or t.size(0) == 0 for t in (query, key, value)):
        return MATH
    half = query.dtype in (torch.float16, torch.bfloat16)
    same_heads = query.size(1) == key.size(1) == value.size(1)
    # check_batch_size_and_num_heads_dense: grouped-query attention (fewer key heads) only for flash
    gqa_ok = enable_gqa and query.size(1) % key.size(1) == 0 and key.size(1) == value.size(1)
    head_dim, value_dim = query.size(-1), value.size(-1)
    if (half and attn_mask is None and (8, 0) <= capability <= (12, 1) and (same_heads or gqa_ok)
            and head_dim == key.size(-1) == value_dim and head_dim <= 256
            and not (is_causal and query.size(-2) != key.size(-2))
            and not (((8, 6) <= capability <= (8, 9) or (12, 0) <= capability <= (12, 1)) and query.requires_grad
                     and not (head_dim <= 192 or (dropout_p == 0 and head_dim > 224)))):
        return FLASH
    # minimum_gemm_alignment: tensor cores from sm80 (and for half from sm70) want 128-bit operands
    alignment = (8 if half else 4) if capability >= (8, 0) or (capability >= (7, 0) and half) else 1
    dtypes = (torch.float32, torch.float16, torch.bfloat16) if capability >= (8, 0) else (torch.float32, torch.float16)
    if (query.dtype in dtypes and (5, 0) <= capability <= (12, 1) and same_heads and head_dim == key.size(-1)
            and head_dim % alignment == 0 and value_dim % alignment == 0):
        return EFFICIENT
    return MATH


def fused_attention(capability: tuple[int, int], math_attention):
    """scaled_dot_product_attention as a GPU of `capability` runs it: its fused kernel's op where
    sdp_utils would pick one, else `math_attention` (torch's own function). On fake tensors the
    fused ops' shapes (torch/_meta_registrations.py) need no GPU, nor even CUDA tensors."""

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                     enable_gqa=False):
        device = query.device.type
        if torch.is_autocast_enabled(device):  # autocast casts the operands of attention to its dtype
            dtype = torch.get_autocast_dtype(device)
            query, key, value = (t.to(dtype) if t.is_floating_point() else t for t in (query, key, value))
        backend = sdpa_backend(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, capability)
        if backend == MATH:
            return math_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                  scale=scale, enable_gqa=enable_gqa)
        scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
        with torch.autocast(device, enabled=False):  # the fused ops are called on the cast operands
            if backend == FLASH:
                return _flash(query, key, value, dropout_p, is_causal, scale)
            return _efficient(query, key, value, attn_mask, dropout_p, is_causal, scale)

    return scaled_dot_product_attention


def _flash(query, key, value, dropout_p, is_causal, scale):
    """sdpa_flash (attention.cpp): the head dimension padded to a multiple of 8, the output cut back."""
    head_dim = query.size(-1)
    pad = -head_dim % 8
    if pad:
        query, key, value = (torch.nn.functional.pad(t, (0, pad)) for t in (query, key, value))
    out = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                             scale=scale)[0]
    return out[..., :head_dim] if pad else out


def _efficient(query, key, value, attn_mask, dropout_p, is_causal, scale):
    """The memory-efficient kernel, with the log-sum-exp backward needs where a gradient is wanted; a
    boolean mask becomes an additive bias of the query's dtype (convert_boolean_attn_mask), broadcast
    to the scores' shape, its last dimension padded to a multiple of 16 (preprocess_mask)."""
    bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.where(attn_mask.logical_not(), -math.inf, 0.0).to(query.dtype)
        target = (query.size(0), query.size(1), query.size(-2), key.size(-2))
        pad = -attn_mask.size(-1) % 16
        if pad:
            attn_mask = torch.nn.functional.pad(attn_mask, (0, pad))[..., : key.size(-2)]
        bias = attn_mask.expand(target)
    needs_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, bias, needs_lse, dropout_p,
                                                                  is_causal, scale=scale)[0]


def cuda_traceable() -> bool:
    """Whether this torch can trace on fake CUDA tensors: where a GPU is visible, or where torch was
    built for CUDA (or ROCm), whose CUDA device guard FakeTensorMode makes a no-op without a GPU. A
    CPU-only build has no CUDA device guard, and autograd needs one for every CUDA tensor that
    requires a gradient (torch::autograd::InputMetadata): there the trace runs on CPU tensors."""
    return torch.cuda.is_available() or torch.version.cuda is not None or torch.version.hip is not None


def fused_dropout(cpu_dropout):
    """F.dropout as on a GPU: in training, the fused kernel (native_dropout), which keeps a boolean
    mask for backward, where the CPU's multiplies by a noise tensor of the input's dtype
    (aten/src/ATen/native/Dropout.cpp, is_fused_kernel_acceptable)."""

    def dropout(input, p=0.5, training=True, inplace=False):
        if not training or not 0 < p < 1 or input.numel() == 0 or inplace:
            return cpu_dropout(input, p, training, inplace)
        return torch.native_dropout(input, p, training)[0]

    return dropout


def round_as_cuda(info) -> int:
    """What a storage costs the caching allocator: a multiple of 512 bytes (MemTracker's rule for
    CUDA storages, here for the CPU tensors that stand for them)."""
    return -(-info.size * info.element_size // 512) * 512


@contextlib.contextmanager
def gpu_behaviour(capability: tuple[int, int], on_cuda_tensors: bool):
    """For the trace of a CUDA target where no GPU is visible: scaled_dot_product_attention runs the
    kernel a GPU of `capability` would. On fake CUDA tensors (`on_cuda_tensors`) autocast("cuda")
    works as on a GPU (bfloat16 as on sm80 and later); on the CPU tensors of a CPU-only build,
    dropout keeps the GPU's boolean mask and each storage counts as the caching allocator would
    count it. Restored afterwards, whatever happens."""
    import torch.cuda.amp.common as amp_common
    import torch.nn.functional as F
    from torch.distributed._tools.mem_tracker import _WeakRefInfo
    saved = (amp_common.amp_definitely_not_available, torch.cuda.is_bf16_supported, F.scaled_dot_product_attention,
             F.dropout, _WeakRefInfo._calculate_mem_consumed)
    if on_cuda_tensors:
        amp_common.amp_definitely_not_available = lambda: False
        torch.cuda.is_bf16_supported = lambda including_emulation=True: capability >= (8, 0)
    else:
        F.dropout = fused_dropout(saved[3])
        _WeakRefInfo._calculate_mem_consumed = round_as_cuda
    F.scaled_dot_product_attention = fused_attention(capability, saved[2])
    try:
        yield
    finally:
        (amp_common.amp_definitely_not_available, torch.cuda.is_bf16_supported, F.scaled_dot_product_attention,
         F.dropout, _WeakRefInfo._calculate_mem_consumed) = saved
