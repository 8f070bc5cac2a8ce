"""What DeepSpeed's ZeRO-1/2 gradient partition should look like, from parameter sizes alone.

Pure functions: no torch.distributed, no DeepSpeed. They restate the layout of
deepspeed/runtime/zero/stage_1_and_2.py (0.19.x) so the census can be checked against it:
- the parameters of a group are laid end to end in one flat buffer, padded at the tail to a
  multiple of 2 * N elements (`nccl_start_alignment_factor` = 2, times the world size);
- rank r owns the slice [r * P, (r + 1) * P) of that buffer, P = padded size / N;
- after backward the rank's gradients sit in a buffer (`grads_in_partition`) sized to every
  parameter that overlaps its slice *whole*, so it holds more than P elements when a parameter
  straddles a partition boundary;
- the alignment padding at the tail of the last slice is a separate zero tensor of its own.

FSDP2 (torch.distributed.fsdp.fully_shard, torch 2.13, torch/distributed/fsdp/_fully_shard/) shards
each parameter on its own, so its layout needs the parameters' shapes, not only their sizes:
- a parameter of dim-0 size d is cut with torch.chunk into chunks of c = ceil(d / N) rows: rank r
  holds rows [r * c, min(d, (r + 1) * c)), which is fewer than c on the last ranks and can be none;
- every rank keeps its shard in a buffer of its own, zero-padded to c rows, and the parameter is a
  view into it (_fsdp_param.py, FSDPParam._init_sharded_param);
- after backward the gradients of one FSDP group are views into one flat buffer of the group's
  padded shard sizes, in the reduce dtype cast to the weights' (fp32 here): the reduce-scatter's
  output (_fsdp_collectives.py, foreach_reduce);
- AdamW's moments are DTensors like the parameters; their local tensors are fresh, so unpadded.
"""
from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections import Counter
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed_version

from zerolens.compat import release

ALIGNMENT_FACTOR = 2  # DeepSpeed's nccl_start_alignment_factor (4-byte alignment for 2-byte types)


@dataclass(frozen=True)
class RankPartition:
    rank: int
    start: int  # first element of the rank's slice in the padded flat buffer
    partition_elements: int  # P: the slice, tail padding included
    padding_elements: int  # how much of the slice is alignment padding
    overlapping_params: tuple[int, ...]  # indices of the parameters that overlap the slice
    grad_buffer_elements: int  # sum of their sizes: what grads_in_partition holds

    @property
    def held_grad_elements(self) -> int:
        """Gradient elements the rank holds after backward: the buffer plus the padding tensor."""
        return self.grad_buffer_elements + self.padding_elements


def zero_partition_layout(param_numels: list[int], world_size: int) -> list[RankPartition]:
    """Per-rank partition of one ZeRO-1/2 parameter group (no parameter_alignment, no round-robin)."""
    return [zero_rank_partition(param_numels, world_size, rank) for rank in range(world_size)]


def zero_rank_partition(param_numels: list[int], world_size: int, rank: int) -> RankPartition:
    """One rank's zero_partition_layout, in time that does not grow with the ranks (a 70B model's
    layout is asked for at 4096 ranks, one rank at a time)."""
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    offsets = flat_offsets(tuple(param_numels))  # offsets[i]: where parameter i starts; the last, the total
    total = offsets[-1]
    alignment = ALIGNMENT_FACTOR * world_size
    padded = math.ceil(total / alignment) * alignment
    size = padded // world_size
    start, end = rank * size, (rank + 1) * size
    # Same rule as get_partition_info: a parameter belongs if it starts in the slice or straddles its
    # start (only the last one to start before it can).
    starting = range(bisect.bisect_left(offsets, start, hi=len(param_numels)),
                     bisect.bisect_left(offsets, end, hi=len(param_numels)))
    before = starting.start - 1
    straddles = before >= 0 and offsets[before] < start < offsets[before] + param_numels[before]
    overlapping = ((before,) if straddles else ()) + tuple(starting)
    return RankPartition(
        rank=rank, start=start, partition_elements=size,
        padding_elements=max(0, min(end, padded) - max(start, total)),
        overlapping_params=overlapping,
        grad_buffer_elements=sum(param_numels[i] for i in overlapping))


@functools.lru_cache(maxsize=4)
def flat_offsets(param_numels: tuple[int, ...]) -> tuple[int, ...]:
    """Where each parameter starts in the flat buffer, and (last) where the last one ends."""
    return (0, *itertools.accumulate(param_numels))


@dataclass(frozen=True)
class DeepSpeedLayout:
    """Where DeepSpeed releases differ in what a rank keeps. The default is 0.17 to 0.19's;
    `deepspeed_layout` gives the one of an installed or recorded release. (Releases also differ in
    behaviour that zerolens corrects and detects at run time, not from the version: the fp16 loss
    scale of 0.18/0.19 and the bf16 gradients 0.17 keeps after the step, strategies.py.)"""
    # The optimizer wrapper of bf16 without ZeRO. 0.17 and later: FP16_UnfusedOptimizer (with a torch
    # optimizer): get_data_types defaults the gradient accumulation dtype to the model's, so
    # _do_optimizer_sanity_check returns DDP_BFLOAT16. 0.16: get_data_types defaults it to fp32 for
    # bf16 without ZeRO, which selects BF16_Optimizer: bf16 weights flat and padded, their bf16
    # gradients kept after the step, a flat fp32 gradient buffer of the same size kept for good,
    # fp32 masters and Adam state on 1/N of it (runtime/bf16_optimizer.py).
    stage0_bf16_wrapper: str = "FP16_UnfusedOptimizer"


DEEPSPEED_0_19 = DeepSpeedLayout()


def deepspeed_layout(version: str | None = None) -> DeepSpeedLayout:
    """The layout of DeepSpeed `version` ("0.17.6"), by default the installed one (read from the
    package metadata: DeepSpeed is not imported; 0.19's when it is not installed). Which releases
    zerolens supports is compat.py's business, checked before anything runs."""
    if version is None:
        try:
            version = installed_version("deepspeed")
        except PackageNotFoundError:
            return DEEPSPEED_0_19
    return DeepSpeedLayout(stage0_bf16_wrapper="BF16_Optimizer" if release(version) < (0, 17) else "FP16_UnfusedOptimizer")


# --- What each rank keeps between steps, per strategy -------------------------------------------
# Byte sizes of the pieces. K = 12 in the ZeRO paper's notation: fp32 master weights, momentum
# and variance. torch's AdamW also keeps its `step` counter as a float32 scalar tensor per
# parameter tensor it updates.
ELEMENT_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
FP32 = 4
ADAM_MOMENTS = 8
STEP_COUNTER = 4
STAGE3_PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's param_persistence_threshold default
RETAINED_KEYS = ("param_bytes", "grad_bytes_after_backward", "grad_bytes_after_step", "optimizer_state_bytes",
                 "comm_buffer_bytes_after_backward", "grad_partition_elements")


def stage3_shard_elements(param_numels: list[int], world_size: int) -> int:
    """ZeRO-3 pads each parameter to a multiple of N and gives every rank ceil(n / N) of it."""
    return sum(count * math.ceil(n / world_size) for n, count in Counter(param_numels).items())


def fsdp2_shard_elements(param_shapes: list[tuple[int, ...]], world_size: int, rank: int) -> tuple[int, int]:
    """(elements of the padded shards, elements of the rank's own rows) over all parameters, as
    FSDP2 cuts them: ceil(d / N) rows of dim 0 per rank, torch.chunk's rule."""
    padded = held = 0
    # Per distinct shape, times its count: a model repeats a few shapes in every block (a 70B Llama's
    # 723 parameters have 6 shapes), and estimate asks this of every one of thousands of ranks.
    for shape, count in Counter(map(tuple, param_shapes)).items():
        if not shape:
            raise ValueError("FSDP2 shards on dim 0: a 0-dimensional parameter cannot be sharded")
        rows, row_elements = shape[0], math.prod(shape[1:])
        chunk = math.ceil(rows / world_size)
        padded += count * chunk * row_elements
        held += count * max(0, min(chunk, rows - rank * chunk)) * row_elements
    return padded, held


@dataclass(frozen=True, kw_only=True)
class Layout:
    """What a layout prediction is given: the parameters, the rank, and the settings that shape what
    it keeps."""
    param_numels: list[int]
    world_size: int
    rank: int
    precision: str
    reduce_bucket_size: int = 50_000_000
    param_persistence_threshold: int = STAGE3_PERSISTENCE_THRESHOLD  # ZeRO-3: kept whole at most this many
    param_shapes: list[tuple[int, ...]] | None = None  # FSDP2 needs them; the others only sizes
    deepspeed: DeepSpeedLayout = DEEPSPEED_0_19
    # The model's weights as built: fp32, or 2 bytes for a model built in bf16/fp16, which DDP and FSDP2
    # train as they are (gradients and AdamW's moments in the weights' dtype); DeepSpeed casts the
    # model to its own precision whatever it was built in.
    weight_bytes: int = FP32
    # Which parameters train (requires_grad), in param_numels' order; None: all. A frozen one (a LoRA
    # base) has no gradient and no optimizer state with any backend, and DeepSpeed's ZeRO-1/2 leave it
    # out of their flat partition.
    trainable: tuple[bool, ...] | None = None
    # The optimizer's parameter groups: each a tuple of indices into param_numels, in the group's order,
    # of parameters that train; None: one group of them all. DeepSpeed flattens and partitions each
    # group on its own (ZeRO-1/2: a padded flat buffer per group) and keeps a step counter per group;
    # Hugging Face's Trainer makes two (weight decay and none).
    param_groups: tuple[tuple[int, ...], ...] | None = None
    # The bytes of the step count DeepSpeed's optimizer keeps per tensor it steps: torch's AdamW (zerolens's
    # DeepSpeed config: torch_adam) a 4-byte tensor; DeepSpeed's FusedAdam (type Adam or AdamW without
    # torch_adam, the config Hugging Face's integration writes) a Python number, no bytes
    # (deepspeed_step_bytes).
    deepspeed_step_bytes: int = STEP_COUNTER

    @property
    def psi(self) -> int:
        return sum(self.param_numels)

    @property
    def trained_numels(self) -> list[int]:
        return self.param_numels if self.trainable is None else [
            n for n, trains in zip(self.param_numels, self.trainable) if trains]

    @property
    def trained_shapes(self) -> list[tuple[int, ...]] | None:
        return self.param_shapes if self.trainable is None or self.param_shapes is None else [
            s for s, trains in zip(self.param_shapes, self.trainable) if trains]

    @property
    def trained_groups(self) -> list[list[int]]:
        """The sizes of the parameters of each optimizer group, in flattening order."""
        if self.param_groups is None:
            return [self.trained_numels]
        return [[self.param_numels[i] for i in group] for group in self.param_groups]

    @property
    def stepped_numels(self) -> list[int]:
        """The sizes of the parameters the optimizer steps, each group's in turn: with groups given,
        those in them (a loop may leave a parameter that trains out of its optimizer), else all that train."""
        return [n for group in self.trained_groups for n in group]

    @property
    def stepped_shapes(self) -> list[tuple[int, ...]] | None:
        if self.param_groups is None or self.param_shapes is None:
            return self.trained_shapes
        return [self.param_shapes[i] for group in self.param_groups for i in group]

    @property
    def trained_psi(self) -> int:
        return sum(self.trained_numels)

    @property
    def element_bytes(self) -> int:
        return ELEMENT_BYTES[self.precision]


def deepspeed_step_bytes(ds_config: dict, ds_override: dict) -> int:
    """Layout.deepspeed_step_bytes for a run's DeepSpeed config (the user's --ds-config, with
    --ds-override's keys over it): DeepSpeed builds its FusedAdam for type Adam or AdamW without
    torch_adam, and keeps each step count as a Python number; zerolens's own config (torch_adam), or
    any that sets no optimizer, gives torch's AdamW, a 4-byte tensor per parameter it steps."""
    section, override = ds_config.get("optimizer") or {}, ds_override.get("optimizer") or {}
    kind = override.get("type", section.get("type"))
    params = {**section.get("params", {}), **override.get("params", {})}
    fused = kind is not None and str(kind).lower() in ("adam", "adamw") and params.get("torch_adam") is not True
    return 0 if fused else STEP_COUNTER


def retained(param_bytes: int, grad_bytes_after_backward: int, grad_bytes_after_step: int,
             optimizer_state_bytes: int, comm_buffer_bytes_after_backward: int, grad_partition_elements: int) -> dict:
    """Bytes a rank holds per component, right after backward and after the step (RETAINED_KEYS)."""
    return dict(param_bytes=param_bytes, grad_bytes_after_backward=grad_bytes_after_backward,
                grad_bytes_after_step=grad_bytes_after_step, optimizer_state_bytes=optimizer_state_bytes,
                comm_buffer_bytes_after_backward=comm_buffer_bytes_after_backward,
                grad_partition_elements=grad_partition_elements)


# The layouts below are those of torch DDP (gradient_as_bucket_view=False), DeepSpeed with a torch
# AdamW (`torch_adam`) and contiguous_gradients (its default), 0.19 unless `deepspeed` says otherwise
# (see deepspeed_layout), and FSDP2 (torch 2.13). The strategy registry (strategies/registry.py)
# says which strategy keeps which.

def torch_ddp_layout(x: Layout) -> dict:
    """The weights as built (fp32 under autocast) and gradients of their dtype; the buckets mirror
    the gradients; AdamW's two moments in the weights' dtype, of the parameters it steps."""
    psi, trained, w, stepped = x.psi, x.trained_psi, x.weight_bytes, x.stepped_numels
    return retained(w * psi, w * trained, 0, 2 * w * sum(stepped) + STEP_COUNTER * len(stepped), w * trained,
                    trained)


def deepspeed_stage0_layout(x: Layout) -> dict:
    """DeepSpeed without ZeRO: whole 16-bit (or fp32) weights and gradients, fp32 masters in 16-bit."""
    psi, trained, e = x.psi, x.trained_psi, x.element_bytes
    if x.precision == "bf16" and x.deepspeed.stage0_bf16_wrapper == "BF16_Optimizer":
        if (x.trainable is not None and not all(x.trainable)) or len(x.trained_groups) > 1:
            raise ValueError("frozen parameters and parameter groups under DeepSpeed 0.16's BF16_Optimizer (bf16 "
                             "without ZeRO) are not modelled")
        # bf16 weights in one flat buffer padded as ZeRO-1/2 pad it, their bf16 gradients (kept
        # after the step), a flat fp32 gradient buffer of the padded size (zeroed at the step,
        # never freed); fp32 masters and one Adam state on the rank's 1/N slice
        # (bf16_optimizer.py, 0.16).
        p = zero_rank_partition(x.param_numels, x.world_size, x.rank).partition_elements
        padded = p * x.world_size
        return retained(e * padded, e * psi + FP32 * padded, e * psi + FP32 * padded,
                        (FP32 + ADAM_MOMENTS) * p + x.deepspeed_step_bytes, 0, psi)
    # 16-bit: FP16_UnfusedOptimizer keeps an fp32 master copy per parameter it trains
    masters = FP32 * trained if e == 2 else 0
    return retained(e * psi, e * trained, 0,
                    masters + ADAM_MOMENTS * trained + x.deepspeed_step_bytes * len(x.trained_numels),
                    0, trained)


def deepspeed_flat_partition_layout(x: Layout) -> dict:
    """ZeRO-1/2: a flat buffer per optimizer group of the parameters that train, each cut in N (frozen
    ones stay whole, in 16-bit, on every rank); the reduce bucket is freed by backward's end."""
    parts = [zero_rank_partition(group, x.world_size, x.rank) for group in x.trained_groups]
    p, e = sum(part.partition_elements for part in parts), x.element_bytes
    frozen = x.psi - x.trained_psi
    return retained(e * (p * x.world_size + frozen), e * sum(part.held_grad_elements for part in parts), 0,
                    (FP32 + ADAM_MOMENTS) * p + x.deepspeed_step_bytes * len(parts), 0, p)


def deepspeed_stage3_layout(x: Layout) -> dict:
    """ZeRO-3: shards of every parameter (frozen ones too), small parameters kept whole, a persistent
    gradient partition of those that train and a bucket."""
    shard, e = stage3_shard_elements(x.param_numels, x.world_size), x.element_bytes
    trained = stage3_shard_elements(x.trained_numels, x.world_size)
    # Small parameters stay gathered after their first use, in a buffer of N padded shards.
    # On one rank the shard is the whole parameter and nothing else is kept (2xH200, N=1).
    persistent = 0 if x.world_size == 1 else sum(math.ceil(n / x.world_size) * x.world_size for n in x.param_numels
                                                 if n <= x.param_persistence_threshold)
    return retained(e * (shard + persistent), e * trained, e * trained,
                    (FP32 + ADAM_MOMENTS) * trained + x.deepspeed_step_bytes * len(x.trained_groups),
                    e * x.reduce_bucket_size,
                    trained)


def fsdp2_layout(x: Layout) -> dict:
    """Shards and gradients in the weights' dtype as built (fp32 for the presets) whatever the
    precision; the same after backward with or without resharding after forward, which only decides
    when the gathered copies go."""
    if x.param_shapes is None:
        raise ValueError("FSDP2's layout needs the parameters' shapes (param_shapes)")
    padded, _ = fsdp2_shard_elements(x.param_shapes, x.world_size, x.rank)
    trained_padded, trained_held = fsdp2_shard_elements(x.trained_shapes, x.world_size, x.rank)
    _, stepped_held = fsdp2_shard_elements(x.stepped_shapes, x.world_size, x.rank)
    w = x.weight_bytes
    return retained(w * padded, w * trained_padded, 0, 2 * w * stepped_held + STEP_COUNTER * len(x.stepped_numels), 0,
                    trained_held)
