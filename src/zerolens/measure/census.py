"""Counting the bytes a rank holds, from the tensors themselves.

Tensors that are views of one buffer share its bytes, so we count storages, not tensors:
each storage once, at its full size (a view into a larger buffer keeps all of it alive).
A storage seen under an earlier component is not counted again under a later one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

COMPONENTS = ("param", "grad", "optimizer_state", "comm_buffer")


class MeasurementError(RuntimeError):
    """A buffer the census relies on is missing: fail loudly rather than report zero."""


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def storage_keys(tensors: Iterable[torch.Tensor]) -> set:
    return {_storage_key(t) for t in tensors if t is not None and t.device.type != "meta"}


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set | None = None) -> int:
    """Bytes of the distinct storages behind `tensors`, skipping those already in `seen`."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            continue
        key = _storage_key(t)
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


@dataclass(frozen=True)
class Holdings:
    """The tensors a strategy holds for each component at one moment, before counting."""
    param: list[torch.Tensor]
    grad: list[torch.Tensor]
    optimizer_state: list[torch.Tensor]
    comm_buffer: list[torch.Tensor]  # reduce buckets (DeepSpeed) and gradient buckets (DDP)
    # Elements of the gradient this rank owns (its partition, padding included). Under ZeRO the
    # buffer holding them can be larger than the partition; see layout.zero_partition_layout.
    grad_partition_elements: int
    # Buffers a backend keeps out of Python's reach and names only by their size in bytes (the buckets
    # of a user's DDP, which zerolens.track reads from DDP's logging data rather than through a
    # communication hook): added to the communication buffers, as storages no tensor here shares.
    sized_comm_buffers: tuple[int, ...] = ()


def count(holdings: Holdings) -> dict[str, int]:
    """Bytes per component, each storage counted once across all components."""
    seen: set = set()
    out = {f"{c}_bytes": storage_bytes(getattr(holdings, c), seen) for c in COMPONENTS}
    out["comm_buffer_bytes"] += sum(holdings.sized_comm_buffers)
    out["grad_partition_elements"] = holdings.grad_partition_elements
    return out


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """exp_avg, exp_avg_sq, step and whatever else a torch optimizer keeps per parameter."""
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def required(obj, name: str):
    """An attribute the census needs; its absence means the backend's layout changed."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise MeasurementError(
            f"{type(obj).__name__} has no attribute '{name}': this version of {type(obj).__module__.split('.')[0]} "
            "keeps its buffers elsewhere, and zerolens will not guess (see census.py)") from None


def required_key(mapping: dict, key: str):
    """A key the census needs in what a backend reports of itself; its absence means the backend changed."""
    if key not in mapping:
        raise MeasurementError(f"the backend's report has no '{key}' (keys: {', '.join(sorted(mapping))}); this "
                               "release keeps it elsewhere, and zerolens will not guess (see census.py)")
    return mapping[key]


def keep_highest(into: dict, key: str, value: int) -> None:
    """A phase's peak into a step's record: under gradient accumulation the phase runs once per
    micro-batch, and the step's figure is the highest of them."""
    into[key] = max(into.get(key, value), value)
