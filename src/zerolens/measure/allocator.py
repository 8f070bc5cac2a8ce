"""The CUDA caching allocator's view of a training step: its statistics per phase, and on the last step
every allocation and free, from which each peak's anatomy is named (peaks.py).

Kept apart from what the tensors say (census.py): the two views are checked against each other.
"""
from __future__ import annotations

import contextlib
import gc

import torch

from zerolens.measure import peaks
from zerolens.measure.census import keep_highest


class AllocatorReadings:
    """One rank's allocator, read around each phase. On the last step (`detailed`) it records the
    allocator's events of each phase and, at each phase boundary and marked in the trace during a
    phase, which storage address belongs to which component."""

    def __init__(self, device: torch.device):
        self.device = device
        self.device_index = device.index
        # Keep the allocating Python stack of every live block (about 2 us per allocation):
        # it names what an earlier strategy left allocated, and feeds the peak anatomy.
        torch.cuda.memory._record_memory_history("state", context="alloc", stacks="python")
        # For the peak anatomy (last step): storage address -> component, taken at each phase
        # boundary and, marked in the trace, during a phase.
        self.boundary_maps: list[dict[int, str]] = []
        self.recording: dict | None = None  # the trace of the phase whose allocator events are being recorded
        self.activation_addresses: set[int] = set()
        self.traces: dict[str, dict] = {}

    def allocated(self) -> int:
        """Bytes the allocator holds now."""
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    def _segments(self) -> list[dict]:
        torch.cuda.synchronize()
        return [s for s in torch.cuda.memory._snapshot()["segments"] if s["device"] == self.device_index]

    def live_block_sources(self) -> dict[str, int]:
        """Bytes of the blocks allocated now, by the code that allocated them."""
        return peaks.live_block_sources(self._segments())

    def live_block_sizes(self) -> dict[int, int]:
        """Address -> size of the blocks allocated now."""
        return peaks.live_block_sizes(self._segments())

    def start_detailed_step(self, holdings) -> None:
        """The last step begins: what the strategy holds is the first boundary."""
        self.traces = {}
        self.activation_addresses = set()
        self.boundary_maps = [peaks.address_map(holdings)]

    @contextlib.contextmanager
    def phase(self, name: str, into: dict, detailed: bool):
        """The allocator's statistics of one phase into `into`; its events too when `detailed`."""
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        if detailed:
            # Between the boundary maps `boundary` and `boundary + 1`; `during`: the maps taken inside it.
            trace = self.recording = {"boundary": len(self.boundary_maps) - 1, "during": []}
            try:
                with peaks.record_phase(self.device_index, trace):
                    yield
            finally:
                self.recording = None
        else:
            yield
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        if detailed:
            trace["allocator_peak"] = stats["allocated_bytes.all.peak"]
            # Under gradient accumulation a phase runs once per micro-batch: the anatomy is the highest one's.
            if trace["allocator_peak"] >= self.traces.get(name, {}).get("allocator_peak", -1):
                self.traces[name] = trace
        into |= {f"allocated_after_{name}": stats["allocated_bytes.all.current"],
                 f"reserved_after_{name}": stats["reserved_bytes.all.current"],
                 "alloc_retries": stats["num_alloc_retries"], "ooms": stats["num_ooms"]}
        for key, stat in ((f"peak_during_{name}", "allocated_bytes.all.peak"),
                          (f"active_peak_during_{name}", "active_bytes.all.peak"),
                          (f"reserved_peak_during_{name}", "reserved_bytes.all.peak")):
            keep_highest(into, key, stats[stat])
        if name == "step":
            # What the process holds on the GPU beside the allocator's reserve: CUDA's context, cuBLAS's and
            # NCCL's own buffers, loaded kernels. The device's used memory counts every process on it.
            free, total = torch.cuda.mem_get_info(self.device)
            into["outside_allocator_after_step"] = total - free - stats["reserved_bytes.all.current"]

    def note_held(self, holdings) -> None:
        """Last step: which storages the strategy holds now (`holdings`, called only then). Between
        phases it is a boundary (with the activations just saved, after forward); inside a recorded
        phase it is marked in the allocator's trace."""
        if not self.boundary_maps:  # not the last step
            return
        held = peaks.address_map(holdings())
        if self.recording:
            peaks.trace_marker(self.device)
            self.recording["during"].append(held)
            return
        for addr in self.activation_addresses:
            held.setdefault(addr, "activation")
        self.activation_addresses = set()
        self.boundary_maps.append(held)

    def note_activations(self, saved: list[torch.Tensor]) -> None:
        """Last step: the storages autograd saved in forward, named at the next boundary."""
        if self.boundary_maps:
            self.activation_addresses = {t.untyped_storage().data_ptr() for t in saved if t.is_cuda}

    def peak_anatomy(self, known_preexisting_bytes: int, backend_code: tuple[str, ...]) -> dict:
        """After the last step: every byte at each phase's peak, by component. A phase runs from the
        boundary map its trace names to the next one."""
        out = {}
        for name, t in self.traces.items():
            out[name] = peaks.peak_anatomy(
                t["segments"], t["events"], name, at_start=self.boundary_maps[t["boundary"]], during=t["during"],
                at_end=self.boundary_maps[t["boundary"] + 1], known_preexisting_bytes=known_preexisting_bytes,
                allocator_peak=t["allocator_peak"], backend_code=backend_code)
        self.traces, self.boundary_maps = {}, []
        return out

    def census_block_rounding(self, holdings) -> int:
        """Bytes the allocator's blocks behind the census's storages hold beyond the storages
        themselves. The allocator rounds every request up to 512 bytes and leaves a large block
        unsplit when less than 1 MiB would remain, and its statistics count whole blocks: FSDP2's
        separate per-parameter shards showed 13 MiB of this on gpt-100m (2xH200)."""
        blocks = self.live_block_sizes()
        seen, rounding = set(), 0
        for t in (t for c in ("param", "grad", "optimizer_state", "comm_buffer") for t in getattr(holdings, c)):
            if t is None or not t.is_cuda:
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in seen or storage.nbytes() == 0:
                continue
            seen.add(ptr)
            if ptr in blocks:  # a storage starts its block; anything else is not ours to round
                rounding += blocks[ptr] - storage.nbytes()
        return rounding

    def cublas_workspace_bytes(self) -> int | None:
        """cuBLAS workspaces live in the caching allocator, outside any tensor. Measured as what the
        allocator frees when torch drops them; the next matrix product allocates them again."""
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        return before - torch.cuda.memory_allocated() if clear_cublas_workspaces() else None


def clear_cublas_workspaces() -> bool:
    """Drops torch's cuBLAS workspaces (CUDA); False where this torch cannot."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None or not torch.cuda.is_available():
        return False
    clear()
    return True


def still_referenced_wrappers() -> list[str]:
    """Diagnosis for memory an earlier strategy left allocated: the data-parallel wrappers still
    alive after their strategy's teardown, and the types of what refers to them."""
    alive = [o for o in gc.get_objects() if isinstance(o, torch.nn.parallel.DistributedDataParallel)]
    return ["DistributedDataParallel by " + ", ".join(sorted({type(r).__name__ for r in gc.get_referrers(o)
                                                               if r is not alive}))
            for o in alive]
