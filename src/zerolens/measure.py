"""Per-rank, per-step memory readings, kept apart from the training loop.

Two independent views:
- the tensor census (census.py): the storages behind the tensors each backend holds, by component,
  plus the activations autograd saved for backward, counted through saved-tensor hooks;
- on CUDA, the caching allocator: allocated, active and reserved bytes, their peaks per phase,
  allocation retries and OOMs (torch.cuda.memory_stats).
"""
from __future__ import annotations

import contextlib

import torch

from .census import MeasurementError, count, storage_bytes, storage_keys
from .strategies import Strategy


class MemoryProbe:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def allocated(self) -> int | None:
        """Bytes the CUDA allocator holds now (None on CPU)."""
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    def phase_start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def phase_end(self, phase: str) -> dict:
        """Allocator readings for the phase that just ended; empty on CPU (no allocator to ask)."""
        if not self.cuda:
            return {}
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        return {f"allocated_after_{phase}": stats["allocated_bytes.all.current"],
                f"peak_during_{phase}": stats["allocated_bytes.all.peak"],
                f"active_peak_during_{phase}": stats["active_bytes.all.peak"],
                f"reserved_after_{phase}": stats["reserved_bytes.all.current"],
                f"reserved_peak_during_{phase}": stats["reserved_bytes.all.peak"],
                "alloc_retries": stats["num_alloc_retries"], "ooms": stats["num_ooms"]}

    def cublas_workspace_bytes(self) -> int | None:
        """cuBLAS workspaces live in the caching allocator, outside any tensor. Measured as what the
        allocator frees when torch drops them; the next matrix product allocates them again."""
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if not self.cuda or clear is None:
            return None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        clear()
        return before - torch.cuda.memory_allocated()

    @contextlib.contextmanager
    def cpu_step_peak(self, strategy: Strategy, into: dict):
        """CPU: the peak bytes of a whole training step. torch's MemTracker (a dispatch-level tracker
        of tensor allocations, private API in torch 2.x) follows what the step allocates and frees;
        the peak is what the census held at the start plus the tracker's highest rise. Tensors that
        existed before the step and are freed during it are not seen going, so this errs high. It
        slows a step about tenfold: the training loop asks for it once, on the last step."""
        if self.cuda:
            yield
            return
        from torch.distributed._tools.mem_tracker import MemTracker

        def total(tracker, kind):
            return sum(int(d.get("Total", 0)) for d in tracker.get_tracker_snapshot(kind).values())

        held = self.held_bytes(strategy)
        tracker = MemTracker()
        with tracker:
            start = total(tracker, "current")
            yield
        into["peak_during_train_step"] = held + total(tracker, "peak") - start

    def held_bytes(self, strategy: Strategy) -> int:
        """Everything the census counts, all components together."""
        counted = count(strategy.holdings())
        return sum(v for k, v in counted.items() if k.endswith("_bytes"))

    @contextlib.contextmanager
    def saved_activations(self, strategy: Strategy, into: dict):
        """Counts the tensors autograd saves for backward during the block (forward), each storage
        once and leaving out the parameters' own storages."""
        saved: list[torch.Tensor] = []

        def pack(t):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        params = storage_keys(strategy.holdings().param)
        into["activation_bytes_after_forward"] = storage_bytes(saved, seen=params)
        saved.clear()  # autograd holds them until backward; we must not hold them longer

    def census(self, strategy: Strategy, moment: str) -> dict:
        counted = count(strategy.holdings())
        if moment == "backward" and counted["grad_bytes"] == 0:
            # Every strategy holds gradients right after backward; zero means we looked in the
            # wrong place, which is exactly the case study's mistake.
            raise MeasurementError(f"{strategy.name}: found no gradient tensors after backward")
        return {f"{key}_after_{moment}": value for key, value in counted.items()}
