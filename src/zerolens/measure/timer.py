"""bench's probe: each step timed, and the allocator's peaks read without synchronising, so that the
steps run as they would without zerolens."""
from __future__ import annotations

import contextlib
import time

import torch


class StepTimer:
    """bench's probe for the training loop (train.train): each step timed between two synchronisations
    (the GPU's queue drained before and after), the allocator's peak after setup and over the steps.
    It measures nothing else, so the steps run as they would without zerolens."""

    def __init__(self, device: torch.device, warmup_steps: int):
        self.device, self.warmup_steps = device, warmup_steps
        self.cuda = device.type == "cuda"
        self.highest = 0  # CUDA: the allocator's peak since setup, over the per-phase resets
        self.highest_reserved = 0  # and its reserve's

    def label(self, strategy, steps_done: int) -> str:
        return f"{strategy.name} ({'warm-up' if steps_done < self.warmup_steps else 'timed'})"

    def before_setup(self, run) -> None:
        # Under zerolens's launcher nothing of an earlier strategy is allocated here: one that leaves
        # memory behind ends its launch (worker.run_strategies). Under another launcher it can be.
        run.measured["allocated_at_start_bytes"] = torch.cuda.memory_allocated() if self.cuda else None
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def after_setup(self, run) -> None:
        run.measured["setup_peak_bytes"] = torch.cuda.max_memory_allocated() if self.cuda else None
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    @contextlib.contextmanager
    def step(self, strategy, record: dict, last: bool):
        synchronize(self.device)
        start = time.perf_counter()
        yield
        synchronize(self.device)
        record["seconds"] = time.perf_counter() - start

    @contextlib.contextmanager
    def phase(self, name: str, strategy, record: dict, last: bool, loss=None):
        """CUDA: the allocator's peak of the phase. Reading and resetting the peak are host-side
        figures of the caching allocator, with no synchronisation, so the timing is untouched; what
        was reached before the reset is kept in `highest`."""
        if not self.cuda:
            yield
            return
        self.highest = max(self.highest, torch.cuda.max_memory_allocated())
        self.highest_reserved = max(self.highest_reserved, torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()
        yield
        record[f"peak_during_{name}"] = torch.cuda.max_memory_allocated()

    def after_last_step(self, strategy, record: dict, run) -> None:
        pass

    def finished(self, run) -> None:
        # The peak over every step, warm-up included (the optimizer's states appear in the first),
        # and each phase's highest over them.
        if not self.cuda:
            run.measured["peak_bytes"] = None
            return
        run.measured["peak_bytes"] = max(self.highest, torch.cuda.max_memory_allocated())
        # What the caching allocator reserved at its highest over the steps (setup's reserve is still held then).
        run.measured["reserved_peak_bytes"] = max(self.highest_reserved, torch.cuda.max_memory_reserved())
        for key in dict.fromkeys(k for r in run.records for k in r if k.startswith("peak_during_")):
            run.measured[key] = max(r.get(key, 0) for r in run.records)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
