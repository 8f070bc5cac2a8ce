"""Tracing a CUDA target where no GPU is visible: on fake CPU tensors that do what the GPU would,
where torch on the CPU does otherwise (`gpu_behaviour`, for the trace's duration):
- autocast: CUDA's policy (aten/src/ATen/autocast_mode.h's lists) on the AutocastCPU key in place
  of the CPU's, which keeps pow, softmax, layer_norm and sums in the low precision and casts
  cross-entropy's input to fp32 (`cuda_autocast_on_cpu`);
- attention: `scaled_dot_product_attention` runs the kernel torch's CUDA dispatch would pick for the
  target's compute capability (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp's rules,
  `sdpa_backend`), called as its fused op as the GPU's dispatch calls it (flash: head dimension
  padded to a multiple of 8; memory-efficient: a boolean mask turned into an additive bias): forward
  keeps a row statistic per query, where the CPU's math kernel (taken with dropout) keeps the scores;
- dropout: the fused kernel, which keeps a boolean mask (the CPU's keeps a noise tensor of the
  input's dtype); and each storage counts in whole 512 bytes, as the caching allocator counts it.
Fake CUDA tensors without a GPU are no way round (peak.trace_device says why). cuDNN's attention,
which torch prefers on some GPUs with recent cuDNN builds (check_prefer_cudnn_attention), is not
modelled: flash is taken where cuDNN would be (the same outputs' bytes up to a row statistic's
shape). The CPU-traced and GPU-traced peaks are compared in docs/results/1xh200/issue21/.
"""
from __future__ import annotations

import contextlib
import math
import warnings

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


def fused_dropout(cpu_dropout):
    """F.dropout as on a GPU: in training, the fused kernel (native_dropout), which keeps a boolean
    mask for backward, where the CPU's multiplies by a noise tensor of the input's dtype
    (aten/src/ATen/native/Dropout.cpp, is_fused_kernel_acceptable)."""

    def dropout(input, p=0.5, training=True, inplace=False):
        if not training or not 0 < p < 1 or input.numel() == 0 or inplace:
            return cpu_dropout(input, p, training, inplace)
        return torch.native_dropout(input, p, training)[0]

    return dropout


def cuda_bytes(size: int) -> int:
    """What a storage of `size` bytes costs the caching allocator: a multiple of 512 bytes (MemTracker's
    rule for CUDA storages)."""
    return -(-size // 512) * 512


def round_as_cuda(info) -> int:
    """cuda_bytes of a tracked storage, for the CPU tensors that stand for CUDA ones."""
    return cuda_bytes(info.size * info.element_size)


# CUDA's autocast policy, read from torch's source (aten/src/ATen/autocast_mode.h: AT_FORALL_LOWER_PRECISION_FP,
# AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_PROMOTE), as op.overload ("": the default
# overload); an op a torch release lacks is skipped. The CPU's own policy (autocast_mode.cpp, AutocastCPU) differs: it keeps pow,
# softmax, layer_norm and the sums in the low precision, and casts cross-entropy's input to fp32.
CUDA_LOWER_PRECISION = (
    "_convolution.deprecated", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d.input",
    "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv",
    "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention")
CUDA_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss",
    "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
    "logsumexp")
CUDA_FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList")
CUDA_PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler", "index_put", "tensordot",
                "scatter_add")
# Those the CPU's autocast already treats as CUDA's does: its own kernels stay (they cache weights' casts).
CPU_SAME = {
    "conv1d", "conv2d", "conv3d", "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm", "addbmm", "linear",
    "_convolution.deprecated", "matmul", "conv_tbc", "conv_transpose1d", "conv_transpose2d.input",
    "conv_transpose3d.input", "prelu", "scaled_dot_product_attention", "cdist", "mse_loss", "cosine_embedding_loss",
    "nll_loss", "nll_loss2d", "hinge_embedding_loss", "poisson_nll_loss", "smooth_l1_loss", "l1_loss", "huber_loss",
    "margin_ranking_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "kl_div",
    "multilabel_margin_loss", "binary_cross_entropy_with_logits"}
# The CPU's own autocast kernels CUDA has none of (or another policy for): they fall through, as on CUDA.
CPU_ONLY = (
    "conv1d.padding", "conv2d.padding", "conv3d.padding", "_addmm_activation", "mkldnn_rnn_layer", "_native_multi_head_attention", "avg_pool3d", "binary_cross_entropy",
    "polar", "quantile", "quantile.scalar", "nanquantile", "nanquantile.scalar", "stft", "stft.center",
    "grid_sampler_2d", "_grid_sampler_2d_cpu_fallback", "grid_sampler_3d", "trace", "view_as_complex",
    "cross_entropy_loss", "max_pool3d", "adaptive_avg_pool3d", "reflection_pad1d", "reflection_pad2d",
    "replication_pad1d", "replication_pad2d", "replication_pad3d", "stack", "cat", "index_copy")


def _overload(name: str):
    op, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, op, None)
    return None if packet is None else getattr(packet, overload or "default", None)


def _cast(value, dtype):
    """`value`'s floating tensors (autocast's eligible ones), in lists, tuples and keyword arguments too,
    cast to `dtype`."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if _floating(value) and value.dtype != dtype else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


def _floating(t: torch.Tensor) -> bool:  # autocast's is_eligible: floating point, not double
    return t.is_floating_point() and t.dtype != torch.float64


def _autocast_kernel(op, policy: str):
    """A kernel of `op` under CUDA's autocast `policy`, for the AutocastCPU key: the operands cast as
    CUDA's autocast casts them, then the op below autocast."""
    exclude = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    dtype_index = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)

    def kernel(*args, **kwargs):
        if policy == "lower":
            low = torch.get_autocast_dtype("cpu")
            args, kwargs = _cast(args, low), _cast(kwargs, low)
        elif policy == "fp32":
            args, kwargs = _cast(args, torch.float32), _cast(kwargs, torch.float32)
        elif policy == "promote":
            widest = torch.float32 if any(isinstance(a, torch.Tensor) and a.dtype == torch.float32 for a in args) else None
            if widest:
                args = _cast(args, widest)
        elif policy == "set_dtype" and isinstance(args[0], torch.Tensor) and _floating(args[0]):
            if dtype_index is not None and len(args) > dtype_index:
                if args[dtype_index] is None:
                    args = (*args[:dtype_index], torch.float32, *args[dtype_index + 1:])
            elif kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
        with torch._C._ExcludeDispatchKeyGuard(exclude):
            return op(*args, **kwargs)

    return kernel


@contextlib.contextmanager
def cuda_autocast_on_cpu():
    """autocast("cpu") with CUDA's policy in place of the CPU's, for the CPU tensors that stand for a
    GPU's: each op of CUDA's lists gets a kernel on the AutocastCPU key that casts as CUDA's does, and
    the CPU's own kernels fall through. The kernels go when the context ends (Library._destroy)."""
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns that the CPU's kernels are overridden: they are meant to be
            register(library)
        yield
    finally:
        library._destroy()


def register(library) -> None:
    """CUDA's autocast kernels on the AutocastCPU key of `library` (cuda_autocast_on_cpu)."""
    for names, policy in ((CUDA_LOWER_PRECISION, "lower"), (CUDA_FP32, "fp32"),
                          (CUDA_FP32_SET_OPT_DTYPE, "set_dtype"), (CUDA_PROMOTE, "promote")):
        for name in names:
            op = None if name in CPU_SAME else _overload(name)
            if op is not None:
                library.impl(op, _autocast_kernel(op, policy), "AutocastCPU")
    for name in CPU_ONLY:
        op = _overload(name)
        if op is not None:
            library.impl(op, torch.library.fallthrough_kernel, "AutocastCPU")


@contextlib.contextmanager
def gpu_behaviour(capability: tuple[int, int]):
    """For the trace of a CUDA target on CPU tensors (no GPU visible): autocast casts as CUDA's does,
    scaled_dot_product_attention runs the kernel a GPU of `capability` would, dropout keeps the GPU's
    boolean mask, and each storage counts as the caching allocator counts it. Restored afterwards,
    whatever happens."""
    import torch.nn.functional as F
    from torch.distributed._tools.mem_tracker import _WeakRefInfo
    saved = F.scaled_dot_product_attention, F.dropout, _WeakRefInfo._calculate_mem_consumed
    F.dropout = fused_dropout(saved[1])
    _WeakRefInfo._calculate_mem_consumed = round_as_cuda
    F.scaled_dot_product_attention = fused_attention(capability, saved[0])
    try:
        with cuda_autocast_on_cpu():
            yield
    finally:
        F.scaled_dot_product_attention, F.dropout, _WeakRefInfo._calculate_mem_consumed = saved
