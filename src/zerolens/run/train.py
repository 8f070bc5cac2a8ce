"""The training loop: the same data and seed for every strategy, measured at phase boundaries."""
from __future__ import annotations

import contextlib
import gc
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from zerolens.models.model import ModelConfig, build_model
from zerolens.report.tables import progress
from zerolens.run.faults import Fault, inject
from zerolens.strategies import Strategy


@dataclass
class Phase:
    """Which phase a rank is in, so a failure or a hang can say where it happened. `at` and `enter`
    also write the rank's heartbeat, which the launcher's hang watchdog reads (launch.py)."""
    strategy: str = "-"
    step: int = -1
    name: str = "start"
    rank: int = 0
    fault: Fault | None = None  # ZEROLENS_FAULT, for tests of failures
    device: torch.device | None = None  # where a `leak` fault allocates
    heartbeat: Heartbeat | None = None

    def at(self, **where) -> None:
        """Now at `where` (strategy, step, name); said in the heartbeat."""
        for key, value in where.items():
            setattr(self, key, value)
        if self.heartbeat is not None:
            self.heartbeat.write(str(self))

    def enter(self, name: str) -> None:
        """Now in training phase `name`; where ZEROLENS_FAULT says so, fail here (faults.py)."""
        self.at(name=name)
        inject(self.fault, self.rank, self.step, name, self.device)

    def __str__(self):
        where = self.name if self.strategy == "-" else f"{self.name} of {self.strategy}"
        return where if self.step < 0 else f"{where} at step {self.step}"


class Heartbeat:
    """A rank's heartbeat file: where it is, when it got there, its pid, as JSON, rewritten in place at
    every change of phase (four a step). One pwrite of a record padded to RECORD bytes on a file kept
    open: a temporary file written and renamed each time took 143 us on a 2-core machine, about 0.5%
    of gpt-1b's 116 ms DDP step on an H200, inside the timed steps. A read that meets a write half
    done fails to parse, and the watchdog keeps the beat it read before (launch.HangWatchdog)."""
    RECORD = 512

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None

    def write(self, where: str) -> None:
        record = json.dumps({"where": where, "time": time.time(), "pid": os.getpid()}).encode()
        if len(record) > self.RECORD:  # a phase named at great length: written whole, another way
            self.close()
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_bytes(record)
            tmp.replace(self.path)
            return
        if self.fd is None:
            # truncated: a longer record written another way may be there
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self.fd, record.ljust(self.RECORD), 0)  # spaces after JSON still parse

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@dataclass
class StrategyRun:
    """One strategy's run on this rank: what the loop and its probe found."""
    name: str
    records: list[dict] = field(default_factory=list)  # one per step, this rank
    losses: list[float] = field(default_factory=list)  # global-batch loss per step (mean over ranks)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    measured: dict = field(default_factory=dict)  # the probe's own figures (peaks, leftovers)


def train(strategy: Strategy, *, model_config: ModelConfig, seed: int, batches, steps: int, device: torch.device,
          phase: Phase, probe, grad_accum: int = 1) -> StrategyRun:
    """The one training loop of verify and bench: set up, `steps` steps of forward, backward and
    optimizer step on this rank's `batches`, the losses averaged over the ranks, teardown. Under
    gradient accumulation a step runs forward and backward on `grad_accum` micro-batches before
    its optimizer step. The probe does the measuring (verify's MemoryProbe, bench's StepTimer), around
    the steps and their phases (a phase's figures in a step: its highest peak and its total time over
    the micro-batches)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    run = StrategyRun(strategy.name)
    phase.at(strategy=strategy.name, step=-1, name="setup")
    probe.before_setup(run)
    strategy.setup(build_model(model_config, seed), device)
    probe.after_setup(run)
    # Dropout draws from the RNG: the same stream for every strategy, a different one per rank.
    torch.manual_seed(seed + 1 + rank)
    losses = []
    start = time.perf_counter()
    with progress(steps, probe.label(strategy, 0)) if rank == 0 else contextlib.nullcontext() as bar:
        for step in range(steps):
            # next() rather than zip(range(steps), batches): zip's cached result tuple would hold the
            # step's first micro-batch until the next step, beside the later ones under accumulation.
            phase.at(step=step, name="making the batch")  # the batch function is the user's, and may fail
            tokens, labels = next(batches)
            record = {"strategy": strategy.name, "rank": rank, "step": step}
            last = step == steps - 1
            micro_losses = []
            with probe.step(strategy, record, last, batch=[tokens, labels]):
                for micro in range(grad_accum):
                    if micro:  # the step's next micro-batch, made when needed, as a data loader would
                        phase.at(name="making the batch")
                        tokens, labels = next(batches)
                    with strategy.accumulating(sync=micro == grad_accum - 1):
                        phase.enter("forward")
                        with probe.phase("forward", strategy, record, last):
                            loss = strategy.forward_loss(tokens, labels)
                        phase.enter("backward")
                        # The census after backward is the step's last micro-batch's, after its reduction.
                        with probe.phase("backward", strategy, record, last, loss=loss,
                                         census=micro == grad_accum - 1):
                            strategy.backward(loss)
                    if micro < grad_accum - 1:
                        micro_losses.append(loss.item())
                phase.enter("step")
                with probe.phase("step", strategy, record, last):
                    record["step_applied"] = strategy.step()
            if last:
                phase.at(name="measuring the last step")
                probe.after_last_step(strategy, record, run)
            micro_losses.append(loss.item())  # floats: no tensor of the loop's outlives its step
            losses.append(sum(micro_losses) / grad_accum)
            run.records.append(record)
            if bar is not None:
                bar.advance(probe.label(strategy, step + 1))
    run.seconds = time.perf_counter() - start
    # One all-reduce for every step's loss: equal micro-batches, so their mean is the global-batch loss.
    phase.at(step=-1, name="loss all-reduce")
    total = torch.tensor(losses, dtype=torch.float32, device=device)
    dist.all_reduce(total)
    for record, mine, mean in zip(run.records, losses, (total / world_size).tolist()):
        record["local_loss"], record["loss"] = mine, mean
    run.losses = [r["loss"] for r in run.records]
    run.notes = strategy.notes()  # after the steps: some notes are about what a step did
    probe.finished(run)
    phase.at(name="teardown")
    # The last loss's graph reaches the parameters, and through DeepSpeed's hooks the whole
    # optimizer: drop it before collecting, or this strategy's memory outlives it.
    del loss, total
    strategy.teardown()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return run
