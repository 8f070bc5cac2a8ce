"""Per-rank, per-step memory readings, kept apart from the training loop.

Two independent views:
- the tensor census (census.py): the storages behind the tensors each backend holds, by component,
  plus the activations autograd saved for backward, counted through saved-tensor hooks;
- on CUDA, the caching allocator: allocated, active and reserved bytes, their peaks per phase,
  allocation retries and OOMs (torch.cuda.memory_stats); on the last step, every block alive at
  each phase's peak, by component (peaks.py);
- on CPU, per-phase peaks of the last step from torch's MemTracker, a dispatch-level tracker of
  tensor allocations (not the process RSS).
"""
from __future__ import annotations

import contextlib
import gc
import time

import torch

from . import peaks
from .census import MeasurementError, count, storage_bytes, storage_keys
from .strategies import Strategy, registry
from .strategies.base import PHASES, dtensor_shapes_untraced


class MemoryProbe:
    """Readings per phase. On the last step (`detailed=True`) it also records, on CUDA, the
    allocator's events of each phase (peaks.py names every byte at the peak) and, on CPU, follows
    tensor allocations with torch's MemTracker for per-phase peaks (CPU has no allocator to ask)."""

    def __init__(self, device: torch.device, earlier_left: int = 0):
        self.cuda = device.type == "cuda"
        # Bytes the strategies before this one in the same processes left allocated (only under a
        # launcher other than zerolens's: worker.run_strategies); then traced to who allocated them.
        self.earlier_left = earlier_left
        self.leftover_blocks: dict[int, int] = {}
        self.device_index = device.index if self.cuda else None
        if self.cuda:
            # Keep the allocating Python stack of every live block (about 2 us per allocation):
            # it names what an earlier strategy left allocated, and feeds the peak anatomy.
            torch.cuda.memory._record_memory_history("state", context="alloc", stacks="python")
        self.device = device
        self.tracker = None
        # For the peak anatomy (CUDA, last step): storage address -> component, taken at each
        # phase boundary and, marked in the trace, during a phase.
        self.boundary_maps: list[dict[int, str]] = []
        self.during_maps: dict[str, list[dict[int, str]]] = {}
        self.recording: str | None = None  # the phase whose allocator events are being recorded
        self.activation_addresses: set[int] = set()
        self.traces: dict[str, dict] = {}

    def allocated(self) -> int | None:
        """Bytes the CUDA allocator holds now (None on CPU)."""
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    def _segments(self) -> list[dict]:
        torch.cuda.synchronize()
        return [s for s in torch.cuda.memory._snapshot()["segments"] if s["device"] == self.device_index]

    def live_block_sources(self) -> dict[str, int]:
        """CUDA: bytes of the blocks allocated now, by the code that allocated them."""
        return peaks.live_block_sources(self._segments())

    def live_block_sizes(self) -> dict[int, int]:
        """CUDA: address -> size of the blocks allocated now."""
        return peaks.live_block_sizes(self._segments())

    @contextlib.contextmanager
    def detailed_step(self, strategy: Strategy):
        """Around the last step: what the detailed per-phase readings need."""
        self.traces, self.during_maps = {}, {}
        self.activation_addresses = set()
        if self.cuda:
            self.boundary_maps = [peaks.address_map(strategy.holdings())]
            yield
            return
        from torch.distributed._tools.mem_tracker import MemTracker
        self.tracker = MemTracker()
        # Tensors that exist before the step: tracked so that their frees during it are seen.
        held = strategy.holdings()
        self.tracker.track_external(*[t for c in ("param", "grad", "optimizer_state", "comm_buffer")
                                      for t in getattr(held, c) if t is not None])
        try:
            with self.tracker, dtensor_shapes_untraced():
                yield
        finally:
            self.tracker = None

    # --- What the training loop (train.train) asks of its probe --------------------------------------
    def label(self, strategy: Strategy, steps_done: int) -> str:
        return strategy.name

    def before_setup(self, run) -> None:
        # CUDA: what is allocated before setup, as in a fresh process (512 bytes on 2xH200 with
        # NCCL), plus anything earlier strategies left, which is then traced to its allocating code.
        run.measured["allocated_at_start"] = self.allocated()
        run.measured["leftover_sources"] = {}
        if self.earlier_left:
            run.measured["leftover_sources"] = self.live_block_sources() | {
                f"still referenced: {k}": 0 for k in still_referenced_wrappers()}
            self.leftover_blocks = self.live_block_sizes()

    def after_setup(self, run) -> None:
        pass

    def step(self, strategy: Strategy, record: dict, last: bool):
        """The last step is measured in detail: per-phase CPU peaks (slow: a tensor tracker) and, on
        CUDA, the allocator's events for the anatomy of each peak."""
        return self.detailed_step(strategy) if last else contextlib.nullcontext()

    @contextlib.contextmanager
    def phase(self, name: str, strategy: Strategy, record: dict, last: bool, loss: torch.Tensor | None = None):
        """One phase (forward, backward, step), measured into `record`: its peaks and time, the
        activations saved in forward, what the strategy holds after it, and the census after
        backward and after the step."""
        with self.measured_phase(name, record, detailed=last):
            if name == "forward":
                with self.saved_activations(strategy, into=record):
                    yield
            else:
                if name == "backward" and last and loss is not None:
                    # What the strategy holds once backward has begun (e.g. reduce buckets).
                    loss.register_hook(lambda grad: self.note_held(strategy))
                yield
        self.note_held(strategy)
        if name in ("backward", "step"):
            record |= self.census(strategy, name)

    def after_last_step(self, strategy: Strategy, record: dict, run) -> None:
        record["census_block_rounding_after_step"] = self.census_block_rounding(strategy)
        # Clearing the cuBLAS workspaces costs a re-allocation: only once, at the end.
        record["cublas_workspace_bytes"] = self.cublas_workspace_bytes()
        if self.cuda:
            # What is still allocated of the earlier strategies' leftovers (same block, same size):
            # released at some point during this run, not at its start.
            now = self.live_block_sizes() if self.leftover_blocks else {}
            record["leftover_bytes_at_end"] = sum(size for addr, size in self.leftover_blocks.items()
                                                  if now.get(addr) == size)
            record["peak_anatomy"] = self.peak_anatomy(
                known_preexisting_bytes=(record["cublas_workspace_bytes"] or 0) + (run.measured["allocated_at_start"] or 0),
                backend_code=registry.spec(strategy.name).transient_code)

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
        finally:  # CUDA: _phase_memory synchronises, so this is the phase's time on the GPU too
            into[f"seconds_{name}"] = time.perf_counter() - start

    @contextlib.contextmanager
    def _phase_memory(self, name: str, into: dict, detailed: bool):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            if detailed:
                self.traces[name], self.during_maps[name], self.recording = {}, [], name
                try:
                    with peaks.record_phase(self.device_index, self.traces[name]):
                        yield
                finally:
                    self.recording = None
            else:
                yield
            torch.cuda.synchronize()
            stats = torch.cuda.memory_stats()
            if detailed:
                self.traces[name]["allocator_peak"] = stats["allocated_bytes.all.peak"]
            into |= {f"allocated_after_{name}": stats["allocated_bytes.all.current"],
                     f"peak_during_{name}": stats["allocated_bytes.all.peak"],
                     f"active_peak_during_{name}": stats["active_bytes.all.peak"],
                     f"reserved_after_{name}": stats["reserved_bytes.all.current"],
                     f"reserved_peak_during_{name}": stats["reserved_bytes.all.peak"],
                     "alloc_retries": stats["num_alloc_retries"], "ooms": stats["num_ooms"]}
        elif detailed and self.tracker is not None:
            reset_tracker_peak(self.tracker)
            yield
            into[f"peak_during_{name}"] = tracker_total(self.tracker, "peak")
        else:
            yield

    def note_held(self, strategy: Strategy) -> None:
        """CUDA, last step: which storages the strategy holds now, for the peak anatomy. Between
        phases it is a boundary (with the activations just saved, after forward); inside a
        recorded phase it is marked in the allocator's trace."""
        if not (self.cuda and self.traces):
            return
        held = peaks.address_map(strategy.holdings())
        if self.recording:
            peaks.trace_marker(self.device)
            self.during_maps[self.recording].append(held)
            return
        for addr in self.activation_addresses:
            held.setdefault(addr, "activation")
        self.activation_addresses = set()
        self.boundary_maps.append(held)

    def peak_anatomy(self, known_preexisting_bytes: int, backend_code: tuple[str, ...]) -> dict:
        """CUDA, after the last step: every byte at each phase's peak, by component. Phase i runs
        from boundary map i to boundary map i + 1."""
        out = {}
        for i, (name, t) in enumerate(self.traces.items()):
            out[name] = peaks.peak_anatomy(
                t["segments"], t["events"], name, at_start=self.boundary_maps[i], during=self.during_maps[name],
                at_end=self.boundary_maps[i + 1], known_preexisting_bytes=known_preexisting_bytes,
                allocator_peak=t["allocator_peak"], backend_code=backend_code)
        self.traces, self.during_maps, self.boundary_maps = {}, {}, []
        return out

    def census_block_rounding(self, strategy: Strategy) -> int | None:
        """CUDA: bytes the allocator's blocks behind the census's storages hold beyond the storages
        themselves. The allocator rounds every request up to 512 bytes and leaves a large block
        unsplit when less than 1 MiB would remain, and its statistics count whole blocks: FSDP2's
        separate per-parameter shards showed 13 MiB of this on gpt-100m (2xH200)."""
        if not self.cuda:
            return None
        blocks = self.live_block_sizes()
        held = strategy.holdings()
        seen, rounding = set(), 0
        for t in (t for c in ("param", "grad", "optimizer_state", "comm_buffer") for t in getattr(held, c)):
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
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        return before - torch.cuda.memory_allocated() if clear_cublas_workspaces() else None

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
        if self.cuda and self.traces:
            self.activation_addresses = {t.untyped_storage().data_ptr() for t in saved if t.is_cuda}
        saved.clear()  # autograd holds them until backward; we must not hold them longer

    def census(self, strategy: Strategy, moment: str) -> dict:
        counted = count(strategy.holdings())
        if moment == "backward" and counted["grad_bytes"] == 0:
            # Every strategy holds gradients right after backward; zero means we looked in the
            # wrong place, which is exactly the case study's mistake.
            raise MeasurementError(f"{strategy.name}: found no gradient tensors after backward")
        return {f"{key}_after_{moment}": value for key, value in counted.items()}


def clear_cublas_workspaces() -> bool:
    """Drops torch's cuBLAS workspaces (CUDA); False where this torch cannot."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None or not torch.cuda.is_available():
        return False
    clear()
    return True


# torch's MemTracker (torch.distributed._tools, private in torch 2.x) keeps one running peak; a
# per-phase peak needs it set back to the current total at each phase's start.
def tracker_total(tracker, kind: str) -> int:
    return sum(int(d.get("Total", 0)) for d in tracker.get_tracker_snapshot(kind).values())


def reset_tracker_peak(tracker) -> None:
    if not (hasattr(tracker, "_peak_mem") and hasattr(tracker, "_peak_mem_snap")):
        raise MeasurementError("this torch's MemTracker keeps its peak elsewhere; zerolens cannot read per-phase "
                               "CPU peaks (see measure.reset_tracker_peak)")
    current = tracker.get_tracker_snapshot("current")
    tracker._peak_mem = {dev: snap.get("Total", 0) for dev, snap in current.items()}
    tracker._peak_mem_snap = current


def still_referenced_wrappers() -> list[str]:
    """Diagnosis for memory an earlier strategy left allocated: the data-parallel wrappers still
    alive after their strategy's teardown, and the types of what refers to them."""
    alive = [o for o in gc.get_objects() if isinstance(o, torch.nn.parallel.DistributedDataParallel)]
    return ["DistributedDataParallel by " + ", ".join(sorted({type(r).__name__ for r in gc.get_referrers(o)
                                                               if r is not alive}))
            for o in alive]


class StepTimer:
    """bench's probe for the training loop (train.train): each step timed between two synchronisations
    (the GPU's queue drained before and after), the allocator's peak after setup and over the steps.
    It measures nothing else, so the steps run as they would without zerolens."""

    def __init__(self, device: torch.device, warmup_steps: int):
        self.device, self.warmup_steps = device, warmup_steps
        self.cuda = device.type == "cuda"
        self.highest = 0  # CUDA: the allocator's peak since setup, over the per-phase resets

    def label(self, strategy: Strategy, steps_done: int) -> str:
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
    def step(self, strategy: Strategy, record: dict, last: bool):
        synchronize(self.device)
        start = time.perf_counter()
        yield
        synchronize(self.device)
        record["seconds"] = time.perf_counter() - start

    @contextlib.contextmanager
    def phase(self, name: str, strategy: Strategy, record: dict, last: bool, loss=None):
        """CUDA: the allocator's peak of the phase. Reading and resetting the peak are host-side
        figures of the caching allocator, with no synchronisation, so the timing is untouched; what
        was reached before the reset is kept in `highest`."""
        if not self.cuda:
            yield
            return
        self.highest = max(self.highest, torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        yield
        record[f"peak_during_{name}"] = torch.cuda.max_memory_allocated()

    def after_last_step(self, strategy: Strategy, record: dict, run) -> None:
        pass

    def finished(self, run) -> None:
        # The peak over every step, warm-up included (the optimizer's states appear in the first),
        # and each phase's highest over them.
        if not self.cuda:
            run.measured["peak_bytes"] = None
            return
        run.measured["peak_bytes"] = max(self.highest, torch.cuda.max_memory_allocated())
        for name in PHASES:
            run.measured[f"peak_during_{name}"] = max(r.get(f"peak_during_{name}", 0) for r in run.records)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
