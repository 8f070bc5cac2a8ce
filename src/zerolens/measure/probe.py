"""verify's probe: per-rank, per-phase memory readings, kept apart from the training loop (run/train.py
calls it around each step and phase).

Two independent views:
- the tensor census (census.py): the storages behind the tensors each backend holds, by component,
  plus the activations autograd saved for backward, counted through saved-tensor hooks;
- on CUDA, the caching allocator (allocator.py): allocated, active and reserved bytes, their peaks
  per phase, allocation retries and OOMs; on the last step, every block alive at each phase's
  peak, by component (peaks.py);
- on CPU, per-phase peaks of the last step from torch's MemTracker (tracker.py), a dispatch-level
  tracker of tensor allocations (not the process RSS).

A probe reads a strategy through its `name` and `holdings()` (strategies/base.py: Strategy) and
imports no backend.
"""
from __future__ import annotations

import contextlib
import time

import torch

from zerolens.measure.allocator import AllocatorReadings, still_referenced_wrappers
from zerolens.measure.census import MeasurementError, count, keep_highest, storage_bytes, storage_keys
from zerolens.measure.tracker import tracked_phase, tracked_step


class MemoryProbe:
    """Readings per phase. On the last step (`detailed=True`) it also records, on CUDA, the
    allocator's events of each phase (the anatomy of each peak) and, on CPU, follows tensor
    allocations with torch's MemTracker for per-phase peaks (CPU has no allocator to ask).
    `backend_code`: the strategy's registry `transient_code`, which names its temporaries."""

    def __init__(self, device: torch.device, *, backend_code: tuple[str, ...], earlier_left: int = 0):
        self.allocator = AllocatorReadings(device) if device.type == "cuda" else None
        # Bytes the strategies before this one in the same processes left allocated (only under a
        # launcher other than zerolens's: worker.run_strategies); then traced to who allocated them.
        self.earlier_left = earlier_left
        self.leftover_blocks: dict[int, int] = {}
        self.backend_code = backend_code
        self.tracker = None  # CPU, last step: torch's MemTracker

    def allocated(self) -> int | None:
        """Bytes the CUDA allocator holds now (None on CPU)."""
        return self.allocator.allocated() if self.allocator else None

    @contextlib.contextmanager
    def detailed_step(self, strategy, batch: list):
        """Around the last step: what the detailed per-phase readings need."""
        if self.allocator:
            self.allocator.start_detailed_step(strategy.holdings())
            yield
            return
        with tracked_step(strategy, batch) as self.tracker:
            try:
                yield
            finally:
                self.tracker = None

    # --- What the training loop (train.train) asks of its probe --------------------------------------
    def label(self, strategy, steps_done: int) -> str:
        return strategy.name

    def before_setup(self, run) -> None:
        # CUDA: what is allocated before setup, as in a fresh process (512 bytes on 2xH200 with
        # NCCL), plus anything earlier strategies left, which is then traced to its allocating code.
        run.measured["allocated_at_start"] = self.allocated()
        run.measured["leftover_sources"] = {}
        if self.earlier_left:
            run.measured["leftover_sources"] = self.allocator.live_block_sources() | {
                f"still referenced: {k}": 0 for k in still_referenced_wrappers()}
            self.leftover_blocks = self.allocator.live_block_sizes()

    def after_setup(self, run) -> None:
        pass

    def step(self, strategy, record: dict, last: bool, batch: list):
        """The last step is measured in detail: per-phase CPU peaks (slow: a tensor tracker) and, on
        CUDA, the allocator's events for the anatomy of each peak."""
        return self.detailed_step(strategy, batch) if last else contextlib.nullcontext()

    @contextlib.contextmanager
    def phase(self, name: str, strategy, record: dict, last: bool, loss: torch.Tensor | None = None,
              census: bool = True):
        """One phase (forward, backward, step), measured into `record`: its peaks and time, the
        activations saved in forward, what the strategy holds after it, and the census after
        backward (unless `census` is False: a micro-batch before the step's last) and after the step."""
        with self.measured_phase(name, record, detailed=last):
            if name == "forward":
                with self.saved_activations(strategy, into=record):
                    yield
            else:
                if name == "backward" and last and loss is not None and self.allocator:
                    # What the strategy holds once backward has begun (e.g. reduce buckets).
                    loss.register_hook(lambda grad: self.allocator.note_held(strategy.holdings))
                yield
        if self.allocator:
            self.allocator.note_held(strategy.holdings)
        if name in ("backward", "step") and census:
            record |= self.census(strategy, name)

    def after_last_step(self, strategy, record: dict, run) -> None:
        if not self.allocator:
            record["census_block_rounding_after_step"] = record["cublas_workspace_bytes"] = None
            return
        record["census_block_rounding_after_step"] = self.allocator.census_block_rounding(strategy.holdings())
        # Clearing the cuBLAS workspaces costs a re-allocation: only once, at the end.
        record["cublas_workspace_bytes"] = self.allocator.cublas_workspace_bytes()
        # What is still allocated of the earlier strategies' leftovers (same block, same size):
        # released at some point during this run, not at its start.
        now = self.allocator.live_block_sizes() if self.leftover_blocks else {}
        record["leftover_bytes_at_end"] = sum(size for addr, size in self.leftover_blocks.items()
                                              if now.get(addr) == size)
        record["peak_anatomy"] = self.allocator.peak_anatomy(
            known_preexisting_bytes=(record["cublas_workspace_bytes"] or 0) + (run.measured["allocated_at_start"] or 0),
            backend_code=self.backend_code)

    def finished(self, run) -> None:
        pass

    # --- The readings ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def measured_phase(self, name: str, into: dict, detailed: bool = False):
        """Peak readings and the wall time of one phase (forward, backward, step) into `into`."""
        start = time.perf_counter()
        try:
            with self._phase_memory(name, into, detailed):
                yield
        finally:  # CUDA: the allocator's readings synchronise, so this is the phase's time on the GPU too
            # Under gradient accumulation, the step's time in the phase over its micro-batches.
            into[f"seconds_{name}"] = into.get(f"seconds_{name}", 0.0) + time.perf_counter() - start

    @contextlib.contextmanager
    def _phase_memory(self, name: str, into: dict, detailed: bool):
        if self.allocator:
            with self.allocator.phase(name, into, detailed):
                yield
        elif detailed and self.tracker is not None:
            with tracked_phase(self.tracker, name, into):
                yield
        else:
            yield

    @contextlib.contextmanager
    def saved_activations(self, strategy, into: dict):
        """Counts the tensors autograd saves for backward during the block (forward), each storage
        once and leaving out the parameters' own storages."""
        saved: list[torch.Tensor] = []

        def pack(t):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        params = storage_keys(strategy.holdings().param)
        keep_highest(into, "activation_bytes_after_forward", storage_bytes(saved, seen=params))
        if self.allocator:
            self.allocator.note_activations(saved)
        saved.clear()  # autograd holds them until backward; we must not hold them longer

    def census(self, strategy, moment: str) -> dict:
        counted = count(strategy.holdings())
        if moment == "backward" and counted["grad_bytes"] == 0:
            # Every strategy holds gradients right after backward; zero means we looked in the
            # wrong place, which is exactly the case study's mistake.
            raise MeasurementError(f"{strategy.name}: found no gradient tensors after backward")
        return {f"{key}_after_{moment}": value for key, value in counted.items()}
