"""Per-rank, per-step memory readings: the tensor census and, on CUDA, the allocator.

Kept apart from the training loop, which only calls `phase_start` / `phase_end` / `census`.
"""
from __future__ import annotations

import torch

from .census import MeasurementError, count
from .strategies import Strategy


class MemoryProbe:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def phase_start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def phase_end(self, phase: str) -> dict:
        """Allocator readings for the phase that just ended; empty on CPU (no allocator to ask)."""
        if not self.cuda:
            return {}
        torch.cuda.synchronize()
        return {f"allocated_after_{phase}": torch.cuda.memory_allocated(),
                f"peak_during_{phase}": torch.cuda.max_memory_allocated()}

    def census(self, strategy: Strategy, moment: str) -> dict:
        counted = count(strategy.holdings())
        if moment == "backward" and counted["grad_bytes"] == 0:
            # Every strategy holds gradients right after backward; zero means we looked in the
            # wrong place, which is exactly the case study's mistake.
            raise MeasurementError(f"{strategy.name}: found no gradient tensors after backward")
        return {f"{key}_after_{moment}": value for key, value in counted.items()}
