"""Buffers CUDA kernels allocate and free inside one operation: no output of it, so the dispatch-level
trace (predict/peak.py) sees none, while the caching allocator serves each one, a block as large as a
layer's activations that it keeps cached afterwards.

Found on one H200 (torch 2.11, cuDNN 9.19) by scripts/op_workspaces.py, which reads the allocator's
counters around every operation of a real training step (docs/results/1xh200/issue21/run13/). Three
kinds of operation allocate what matters there:

- Reductions over the rows of a matrix (a linear layer's bias gradient, `grad.sum(0)`; an RMSNorm
  weight's): ATen's reduce kernel (aten/src/ATen/native/cuda/Reduce.cuh) splits a long reduction over
  several blocks per output and stages their partial sums in global memory: `buffer` of
  `global_memory_size()` bytes, then `semaphores` of `semaphore_size()`, both freed when the kernel is
  launched. `reduce_config` follows setReduceConfig line by line; it needs the GPU's multiprocessor
  count and threads per multiprocessor (gpu_geometry). On gpt-1b each bias gradient staged 128 to 132
  MiB, four per layer and step, every one predicted to the byte.
- The attention backward (cuDNN's, which torch 2.11 picks for bf16 and fp16 on the H200, and flash's,
  which the CPU trace stands in with): an fp32 accumulator of the query gradient and the softmax's
  row sums, and where keys and values have fewer heads than queries (grouped-query attention), the
  key and value gradients expanded to every query head, all in one allocation (measured: gpt-100m,
  gpt-1b, the case study, TinyLlama).
- The embedding's backward above 3072 indices (aten/src/ATen/native/cuda/Embedding.cu,
  embedding_dense_backward_cuda, and EmbeddingBackwardKernel.cu, embedding_backward_cuda_kernel): the
  indices sorted with their positions, each index's segment and partial-segment offsets, and the
  partial sums of the gradient rows in fp32, room made for an index count plus a tenth of it (70 MiB
  on gpt-1b at micro-batch 8), held to the operation's end; the positions, cub's unique's
  keys and cub's temporary storage only for a moment. Recorded on the H200 for 4096 to 16384 indices
  of int64 (scripts/embedding_backward_events.py, run15): every request's block as modelled, cub's
  temporary storage included, whose sizes are the measured ones (they follow cub's tuning, not a
  rule in ATen).

Each buffer is given as a rule and the whole numbers it is computed from (shapes, strides, element
sizes), so that predict/micro_batches.py can carry it to another micro-batch: the numbers on a line in
the micro-batch, the bytes computed again (a reduction's buffer stops growing once it has a block per
multiprocessor's share, which no line in its bytes would follow).
"""
from __future__ import annotations

import math

import torch

# Where no GPU is visible: the data-center GPU of each compute capability (multiprocessors, threads
# per multiprocessor), from NVIDIA's specifications. Another GPU of the same capability (an H100 PCIe
# has 114) stages other sizes.
GEOMETRY_BY_CAPABILITY = {(7, 0): (80, 2048), (8, 0): (108, 2048), (9, 0): (132, 2048), (10, 0): (148, 2048)}
DEFAULT_GEOMETRY = (132, 2048)

REDUCTIONS = {"aten.sum.dim_IntList", "aten.sum.default", "aten.mean.dim", "aten.mean.default"}
EMBEDDING_BACKWARD = "aten.embedding_dense_backward.default"
# The embedding's backward sorts its indices only above this many (Embedding.cu); at or below it, one
# kernel adds into the output and allocates nothing else.
EMBEDDING_SORT_ABOVE = 3072
# How many of the operation's next buffers a short-lived one outlives (0: freed at once), where it is
# not held to the operation's end: the positions the sort carries along hold across the sort's
# temporary storage, cub's unique's output keys across its.
LIFETIME = {"embedding_positions": 1, "embedding_unique_keys": 1, "embedding_sort_storage": 0,
            "embedding_cub_storage": 0}
# cub's temporary storage in the embedding's backward, as one H200 allocated it (torch 2.11, CUDA 13;
# int64 indices, 4096 to 16384 of them: run15): the radix sort of (index, position) pairs 16.25 bytes
# per index and 16895 bytes besides; the unique and the exclusive scan 1279 to 1535 bytes, one
# 1536-byte block either way.
SORT_STORAGE_PER_INDEX, SORT_STORAGE_BESIDES = 16.25, 16895
SMALL_CUB_STORAGE = 1279
ATTENTION_BACKWARD = {"aten._scaled_dot_product_cudnn_attention_backward.default",
                      "aten._scaled_dot_product_flash_attention_backward.default"}


def gpu_geometry(cuda_capability: tuple[int, int]) -> tuple[int, int]:
    """The multiprocessors and threads per multiprocessor of the visible GPU where it has this
    capability, else of GEOMETRY_BY_CAPABILITY's GPU (DEFAULT_GEOMETRY for one not listed)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == tuple(cuda_capability):
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return props.multi_processor_count, props.max_threads_per_multi_processor
    return GEOMETRY_BY_CAPABILITY.get(tuple(cuda_capability), DEFAULT_GEOMETRY)


def inside_buffers(func, args: tuple, kwargs: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The buffers `func` allocates inside itself on these arguments, in order: (rule, numbers) each,
    its bytes buffer_bytes(rule, numbers, geometry); none for an operation not listed."""
    name = str(func)
    if name in REDUCTIONS:
        numbers = reduction_numbers(func, args, kwargs)
        return [] if numbers is None else [("reduce_buffer", numbers), ("reduce_semaphores", numbers)]
    if name in ATTENTION_BACKWARD:
        query, key = args[1], args[2]
        batch, heads, length, head_dim = query.shape
        return [("attention_backward", (batch, heads, length, head_dim, key.shape[1], key.shape[2],
                                        query.element_size()))]
    if name == EMBEDDING_BACKWARD:
        return embedding_backward_buffers(args, kwargs)
    return []


def embedding_backward_buffers(args: tuple, kwargs: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The embedding backward's buffers in the order Embedding.cu and EmbeddingBackwardKernel.cu
    allocate them (the output, grad_weight, is the trace's own). Their numbers start with the index
    count and whether gradients are scaled by frequency, which decide whether the indices are sorted."""
    grad, indices = args[0], args[1]
    by_freq = int(bool(args[4] if len(args) > 4 else kwargs.get("scale_grad_by_freq", False)))
    numel, width, index = indices.numel(), grad.shape[-1], indices.element_size()
    accumulator = 8 if grad.dtype == torch.float64 else 4
    buffers = []
    if not indices.is_contiguous():
        buffers.append(("embedding_copy", (numel, by_freq, index, 1)))
    if not grad.is_contiguous():
        buffers.append(("embedding_copy", (numel, by_freq, grad.element_size(), width)))
    indices_ = ("embedding_indices", (numel, by_freq, index))
    scalar = ("embedding_scalar", (numel, by_freq))
    cub = ("embedding_cub_storage", (numel, by_freq))
    buffers += [indices_, indices_, ("embedding_positions", (numel, by_freq, index)),  # sorted, their positions
                ("embedding_sort_storage", (numel, by_freq, index))]
    if by_freq:  # its two scans' own storage not recorded
        buffers.append(("embedding_count", (numel, by_freq, index)))
    partials = ("embedding_partial_offsets", (numel, by_freq, index))
    buffers += [indices_, scalar, ("embedding_unique_keys", (numel, by_freq, index)), cub,  # the segments
                indices_, indices_, cub, scalar, partials,  # the partial segments: per segment, offsets, count, starts
                ("embedding_partial_sums", (numel, by_freq, width, accumulator))]
    return buffers


def buffer_bytes(rule: str, numbers: tuple[int, ...], geometry: tuple[int, int]) -> int:
    if rule == "attention_backward":
        batch, heads, length, head_dim, kv_heads, kv_length, element = numbers
        accumulator = 4 * batch * heads * length * (head_dim + 1)  # the fp32 query gradient, the row sums
        expanded = 2 * batch * heads * kv_length * head_dim * element if kv_heads != heads else 0
        # The block measured was 512 bytes more than these, in every case: a few bytes besides, rounded.
        return accumulator + expanded + 512
    if rule.startswith("embedding_"):
        numel, by_freq, *sizes = numbers
        if rule == "embedding_copy":  # made contiguous before anything is decided
            return numel * math.prod(sizes)
        if numel <= EMBEDDING_SORT_ABOVE and not by_freq:
            return 0
        if rule == "embedding_scalar":
            return 8
        if rule == "embedding_cub_storage":
            return SMALL_CUB_STORAGE
        if rule == "embedding_sort_storage":  # keys and values of sizes[0] bytes each; measured for 8
            return math.ceil((SORT_STORAGE_PER_INDEX - 16 + 2 * sizes[0]) * numel) + SORT_STORAGE_BESIDES
        if rule in ("embedding_partial_offsets", "embedding_partial_sums"):
            # Room for every partial segment there can be: a segment per index, and one more per
            # NROWS_PER_THREAD (10) indices of a segment (EmbeddingBackwardKernel.cu).
            return (numel + numel // 10) * math.prod(sizes)
        return numel * math.prod(sizes)
    config = reduce_config(numbers, geometry)
    if rule == "reduce_buffer":
        return config["global_memory_size"]
    return config["semaphore_size"]


def reduction_numbers(func, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
    """A sum's or mean's input in whole numbers: (element size of the input, of the accumulator, then
    per dimension of the input: size, stride in bytes, reduced or not). None where the kernel would
    not stage anything this model knows (an integer or complex input, more than 2^31 elements, which
    the kernel splits)."""
    tensor = args[0]
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.numel() == 0:
        return None
    if tensor.numel() >= 2**31:
        return None
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        reduced = set(range(tensor.dim()))
    else:
        dims = [dims] if isinstance(dims, int) else dims
        reduced = {d % max(tensor.dim(), 1) for d in dims}
    element = tensor.element_size()
    accumulator = 8 if tensor.dtype == torch.float64 else 4
    return (element, accumulator, *(int(v) for d, (size, stride) in enumerate(zip(tensor.shape, tensor.stride()))
                                    for v in (size, stride * element, d in reduced)))


def iterator_dimensions(numbers: tuple[int, ...]) -> list[list[int]]:
    """The reduce kernel's TensorIterator dimensions, [size, input stride in bytes, reduced] each, from
    reduction_numbers' (each input dimension in its order): dimensions of size 1 dropped, the reduced
    first, each group by its input stride, fastest first; then neighbours that are one contiguous run
    merge."""
    _, _, *flat = numbers
    dimensions = sorted(((size, stride, bool(r)) for size, stride, r in zip(flat[0::3], flat[1::3], flat[2::3])
                         if size != 1), key=lambda x: (not x[2], x[1]))
    merged: list[list] = []
    for size, stride, is_reduced in dimensions:
        if merged and merged[-1][2] == is_reduced and merged[-1][0] * merged[-1][1] == stride:
            merged[-1][0] *= size
        else:
            merged.append([size, stride, is_reduced])
    return merged


def reduce_config(numbers: tuple[int, ...], geometry: tuple[int, int]) -> dict:
    """Reduce.cuh's setReduceConfig for the reduction `numbers` describes (reduction_numbers), on a
    GPU of `geometry`, and what gpu_reduce_kernel allocates with it: global_memory_size and
    semaphore_size (0 and 0 where the reduction is not split across blocks)."""
    element, accumulator = numbers[:2]
    merged = iterator_dimensions(numbers)
    shape, strides, reduced = [d[0] for d in merged], [d[1] for d in merged], [d[2] for d in merged]
    ndim, num_reduce_dims = len(shape), sum(reduced)
    numel = math.prod(shape)
    num_outputs = math.prod(s for s, r in zip(shape, reduced) if not r)
    inputs_per_output = numel // num_outputs
    output_vec_size, step_input, step_output = 1, 1, 1
    input_mult, ctas_per_output = [0, 0, 0], 1
    if ndim > 0:
        on_fastest = num_reduce_dims == ndim or strides[0] < strides[num_reduce_dims]
        if on_fastest:
            dim0, dim1, fastest_stride = inputs_per_output, num_outputs, strides[0]
        else:
            dim0, dim1, fastest_stride = num_outputs, inputs_per_output, strides[num_reduce_dims]
    else:
        on_fastest, fastest_stride, dim0, dim1 = True, element, 1, 1
    if fastest_stride == element:
        if on_fastest and dim0 > 128 and num_reduce_dims == 1:  # vt0 (4) >= input_vec_size (4)
            dim0 //= 4
        elif not on_fastest:
            # get_output_vec_size: 4, halved until it divides the output dimension's size and the
            # input's other strides (in elements; the input's address is taken as aligned)
            output_vec_size = 4
            for value in [shape[num_reduce_dims]] + [strides[j] // element for j in range(ndim) if j != num_reduce_dims]:
                while value % output_vec_size:
                    output_vec_size //= 2
            dim0 //= output_vec_size
    # set_block_dimension (MAX_NUM_THREADS 512 for every real type)
    max_threads = 512 // output_vec_size
    warp = 32
    dim0_pow2 = last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = last_pow2(dim1) if dim1 < max_threads else max_threads
    block_width = min(dim0_pow2, warp)
    block_height = min(dim1_pow2, max_threads // block_width)
    block_width = min(dim0_pow2, max_threads // block_height)
    num_threads = block_width * block_height
    if ndim == 0 or on_fastest:
        input_mult[0] = step_input
        step_input *= block_width
    else:
        step_output *= block_width

    def values_per_thread() -> int:
        return -(-inputs_per_output // step_input)

    if values_per_thread() >= block_height * 16 or values_per_thread() >= 256:
        input_mult[1] = step_input
        step_input *= block_height
    else:
        step_output *= block_height
    multiprocessors, threads_per_multiprocessor = geometry
    target_grid_size = multiprocessors * (threads_per_multiprocessor // num_threads)
    grid_x = -(-(num_outputs // output_vec_size) // step_output)
    if input_mult[1] != 0 and values_per_thread() >= 256 and grid_x <= target_grid_size:
        ctas_per_output = max(min(-(-target_grid_size // grid_x), -(-values_per_thread() // 16)),
                              -(-values_per_thread() // 256))
        if ctas_per_output > 1:
            input_mult[2] = step_input
            step_input *= ctas_per_output
    if input_mult[2] == 0:
        return {"global_memory_size": 0, "semaphore_size": 0, "ctas_per_output": ctas_per_output}
    size = accumulator * num_outputs * ctas_per_output
    if input_mult[0] == 0:  # no block_x reduction: a value per lane
        size *= block_width * output_vec_size
    return {"global_memory_size": size, "semaphore_size": 4 * grid_x, "ctas_per_output": ctas_per_output}


def last_pow2(n: int) -> int:
    """Reduce.cuh's last_pow2: the largest power of two not above n (1 at least)."""
    return max(1, 1 << (max(int(n), 1).bit_length() - 1))
