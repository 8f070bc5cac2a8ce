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
"""
from __future__ import annotations

import math
from dataclasses import dataclass

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
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    total = sum(param_numels)
    alignment = ALIGNMENT_FACTOR * world_size
    padded = math.ceil(total / alignment) * alignment
    size = padded // world_size
    offsets = [sum(param_numels[:i]) for i in range(len(param_numels))]
    layout = []
    for rank in range(world_size):
        start, end = rank * size, (rank + 1) * size
        # Same rule as get_partition_info: a parameter belongs if it starts in the slice or
        # straddles its start.
        overlapping = tuple(i for i, (off, n) in enumerate(zip(offsets, param_numels))
                            if start <= off < end or off < start < off + n)
        layout.append(RankPartition(
            rank=rank, start=start, partition_elements=size,
            padding_elements=max(0, min(end, padded) - max(start, total)),
            overlapping_params=overlapping,
            grad_buffer_elements=sum(param_numels[i] for i in overlapping)))
    return layout
