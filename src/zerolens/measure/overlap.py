"""How much of a step's communication the computation does not hide, from the GPU's kernel timeline:
one step under torch's profiler (bench's last warm-up step, never a timed one), its kernels split into
communication (NCCL's) and computation (every other), and the time when communication runs while no
computation does. That is the "communication not overlapped" of the step-time breakdown (issue 25)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals, as disjoint intervals in order."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def not_overlapped(communication: list[tuple[float, float]], computation: list[tuple[float, float]]) -> float:
    """The time in which some communication interval runs and no computation interval does."""
    busy = merged(computation)
    exposed, i = 0.0, 0
    for start, end in merged(communication):
        covered = 0.0
        while i < len(busy) and busy[i][1] <= start:
            i += 1
        j = i
        while j < len(busy) and busy[j][0] < end:
            covered += min(end, busy[j][1]) - max(start, busy[j][0])
            j += 1
        exposed += (end - start) - covered
    return exposed


def is_communication(kernel_name: str) -> bool:
    return "nccl" in kernel_name.lower()


@dataclass
class KernelTimeline:
    """What kernel_timeline found: seconds of communication kernels (their union) and of those not
    overlapped by any computation kernel."""
    communication_s: float | None = None
    not_overlapped_s: float | None = None


@contextlib.contextmanager
def kernel_timeline():
    """Profile the CUDA kernels run inside the block (synchronised at its end) into a KernelTimeline."""
    from torch.profiler import ProfilerActivity, profile
    timeline = KernelTimeline()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield timeline
        torch.cuda.synchronize()
    communication, computation = [], []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        interval = (event.time_range.start / 1e6, event.time_range.end / 1e6)  # microseconds to seconds
        (communication if is_communication(event.name) else computation).append(interval)
    timeline.communication_s = length(merged(communication))
    timeline.not_overlapped_s = not_overlapped(communication, computation)
