"""bench's probe: each step timed, and the allocator's peaks read without synchronising, so that the
steps run as they would without zerolens (on the CPU, a warm-up step's peaks, followed tensor by tensor)."""
from __future__ import annotations

import contextlib
import time

import torch

from zerolens.measure.census import keep_highest
from zerolens.measure.overlap import kernel_timeline


class StepTimer:
    """bench's probe for the training loop (train.train): each step timed between two synchronisations
    (the GPU's queue drained before and after), the allocator's peak after setup and over the steps.
    It measures nothing else, so the steps run as they would without zerolens. On CUDA the last warm-up
    step, which is not timed, runs under torch's profiler for how much communication it leaves exposed
    (measure/overlap.py). The CPU has no allocator to ask: there the last warm-up step is followed by
    torch's MemTracker (as verify's last step is) for its peak per phase."""

    def __init__(self, device: torch.device, warmup_steps: int):
        self.device, self.warmup_steps = device, warmup_steps
        self.cuda = device.type == "cuda"
        self.highest = 0  # CUDA: the allocator's peak since setup, over the per-phase resets
        self.highest_reserved = 0  # and its reserve's
        self.tracker = None  # CPU, during the last warm-up step
        self.tracked: dict[str, int] = {}  # CPU: that step's peak per phase
        self.phase_events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []  # CUDA: this step's

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
    def step(self, strategy, record: dict, last: bool, batch: list):
        if not self.cuda and record["step"] == self.warmup_steps - 1:
            start = time.perf_counter()
            with self.tracked_step(strategy, batch):
                yield
            record["seconds"] = time.perf_counter() - start  # a warm-up step's: no timing reads it
            return
        profiled = record["step"] == self.warmup_steps - 1  # CUDA's last warm-up step: its kernels' timeline
        synchronize(self.device)
        start = time.perf_counter()
        with kernel_timeline() if profiled else contextlib.nullcontext() as timeline:
            yield
        synchronize(self.device)
        record["seconds"] = time.perf_counter() - start
        if profiled:
            record["communication"] = {"communication": timeline.communication_s,
                                       "communication_not_overlapped": timeline.not_overlapped_s}
        # Each phase's time on the GPU's timeline, read once the step has synchronised anyway.
        for name, begin, end in self.phase_events:
            record[f"seconds_{name}"] = record.get(f"seconds_{name}", 0.0) + begin.elapsed_time(end) / 1e3
        self.phase_events = []

    @contextlib.contextmanager
    def tracked_step(self, strategy, batch: list):
        """The CPU's last warm-up step under torch's MemTracker, which follows every tensor the step
        allocates (slow, hence never a timed step)."""
        from zerolens.measure.tracker import tracked_step
        with tracked_step(strategy, batch) as self.tracker:
            try:
                yield
            finally:
                self.tracker = None

    @contextlib.contextmanager
    def phase(self, name: str, strategy, record: dict, last: bool, loss=None, census: bool = True):
        """CUDA: the allocator's peak of the phase and its time on the GPU (CUDA events). Reading and
        resetting the peak are host-side figures of the caching allocator and events are recorded
        into the stream, with no synchronisation, so the timing is untouched; what was reached before
        the reset is kept in `highest`. The CPU: the phase's time."""
        if not self.cuda:
            if self.tracker is None:  # the CPU runs each phase as it is called: its time is the host's
                start = time.perf_counter()
                yield
                record[f"seconds_{name}"] = record.get(f"seconds_{name}", 0.0) + time.perf_counter() - start
                return
            from zerolens.measure.tracker import tracked_phase
            with tracked_phase(self.tracker, name, self.tracked):
                yield
            return
        self.highest = max(self.highest, torch.cuda.max_memory_allocated())
        self.highest_reserved = max(self.highest_reserved, torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()
        # The phase's time as CUDA events on the current stream: recorded without synchronising, read at
        # the step's end (step()); under gradient accumulation the phases of every micro-batch add up.
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        yield
        end.record()
        self.phase_events.append((name, begin, end))
        keep_highest(record, f"peak_during_{name}", torch.cuda.max_memory_allocated())

    def after_last_step(self, strategy, record: dict, run) -> None:
        pass

    def finished(self, run) -> None:
        # The peak over every step, warm-up included (the optimizer's states appear in the first),
        # and each phase's highest over them.
        if not self.cuda:  # the last warm-up step's, where there was one
            run.measured["peak_bytes"] = max((v for k, v in self.tracked.items() if k.startswith("peak_during_")),
                                             default=None)
            run.measured |= self.tracked
            return
        run.measured["peak_bytes"] = max(self.highest, torch.cuda.max_memory_allocated())
        # What the caching allocator reserved at its highest over the steps (setup's reserve is still held then).
        run.measured["reserved_peak_bytes"] = max(self.highest_reserved, torch.cuda.max_memory_reserved())
        for key in dict.fromkeys(k for r in run.records for k in r if k.startswith("peak_during_")):
            run.measured[key] = max(r.get(key, 0) for r in run.records)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
