"""The training loop: the same data and seed for every strategy, measured at phase boundaries."""
from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from .data import make_batch, rank_slice
from .faults import Fault, inject
from .measure import MemoryProbe
from .model import ModelConfig, build_model
from .strategies import Strategy


@dataclass
class Phase:
    """Which phase a rank is in, so a failure can say where it happened."""
    strategy: str = "-"
    step: int = -1
    name: str = "start"
    rank: int = 0
    fault: Fault | None = None  # ZEROLENS_FAULT, for tests of failures
    device: torch.device | None = None  # where a `leak` fault allocates
    # Where the rank says how far it got, for the launcher's hang watchdog (launch.py): rewritten
    # whenever the strategy, step or phase changes.
    heartbeat: Path | None = None

    def __setattr__(self, key, value):
        super().__setattr__(key, value)
        if key in ("strategy", "step", "name") and getattr(self, "heartbeat", None) is not None:
            write_heartbeat(self.heartbeat, str(self))

    def enter(self, name: str) -> None:
        """Now in training phase `name`; where ZEROLENS_FAULT says so, fail here (faults.py)."""
        self.name = name
        inject(self.fault, self.rank, self.step, name, self.device)

    def __str__(self):
        where = self.name if self.strategy == "-" else f"{self.name} of {self.strategy}"
        return where if self.step < 0 else f"{where} at step {self.step}"


def write_heartbeat(path: Path, where: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"where": where, "time": time.time(), "pid": os.getpid()}))
    tmp.replace(path)  # the watchdog never reads half a file


def progress_bar(total: int, description: str = ""):
    """A progress bar on stderr, drawn only on a terminal (left out of logs and pipes)."""
    try:
        from tqdm import tqdm
    except ImportError:  # a progress bar is a nicety, never a reason to fail
        return contextlib.nullcontext()
    # Redrawn at every step (a step takes milliseconds at least): the bar shows each one.
    return tqdm(total=total, desc=description, unit="step", file=sys.stderr, dynamic_ncols=True, leave=False,
                disable=None, mininterval=0)


@dataclass
class StrategyRun:
    name: str
    records: list[dict] = field(default_factory=list)  # one per step, this rank
    losses: list[float] = field(default_factory=list)  # global-batch loss per step (mean over ranks)
    allocated_at_start: int | None = None
    leftover_sources: dict[str, int] = field(default_factory=dict)  # CUDA: who allocated what was left
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def still_referenced_wrappers() -> list[str]:
    """Diagnosis for memory an earlier strategy left allocated: the data-parallel wrappers still
    alive after their strategy's teardown, and the types of what refers to them."""
    alive = [o for o in gc.get_objects() if isinstance(o, torch.nn.parallel.DistributedDataParallel)]
    return ["DistributedDataParallel by " + ", ".join(sorted({type(r).__name__ for r in gc.get_referrers(o)
                                                               if r is not alive}))
            for o in alive]


def train_strategy(strategy: Strategy, *, model_config: ModelConfig, steps: int, seed: int, signal: float,
                   micro_batch: int, device: torch.device, phase: Phase, earlier_left: int = 0) -> StrategyRun:
    """Trains one strategy, measured. `earlier_left`: bytes the strategies before it in this process
    left allocated (only under a launcher other than zerolens's: see worker.run_strategies)."""
    rank = dist.get_rank()
    probe = MemoryProbe(device)
    run = StrategyRun(strategy.name)
    phase.strategy, phase.step, phase.name = strategy.name, -1, "setup"
    # CUDA: what is allocated before setup, as in a fresh process (512 bytes on 2xH200 with NCCL),
    # plus anything earlier strategies left, which is then traced to the code that allocated it.
    run.allocated_at_start = probe.allocated()
    leftover_blocks = {}
    if earlier_left:
        run.leftover_sources = probe.live_block_sources()
        run.leftover_sources |= {f"still referenced: {k}": 0 for k in still_referenced_wrappers()}
        leftover_blocks = probe.live_block_sizes()
    model = build_model(model_config, seed)
    strategy.setup(model, device)
    # Dropout draws from the RNG: the same stream for every strategy, a different one per rank.
    torch.manual_seed(seed + 1 + rank)
    start = time.perf_counter()
    with progress_bar(steps, strategy.name) if rank == 0 else contextlib.nullcontext() as bar:
        run_steps(strategy, run, probe, phase, model_config=model_config, steps=steps, seed=seed, signal=signal,
                  micro_batch=micro_batch, device=device, leftover_blocks=leftover_blocks, bar=bar)
    run.seconds = time.perf_counter() - start
    run.notes = strategy.notes()  # after the steps: some notes are about what a step did
    phase.step, phase.name = -1, "teardown"
    del model
    strategy.teardown()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return run


def run_steps(strategy: Strategy, run: StrategyRun, probe: MemoryProbe, phase: Phase, *, model_config: ModelConfig,
              steps: int, seed: int, signal: float, micro_batch: int, device: torch.device,
              leftover_blocks: dict[int, int], bar) -> None:
    """The training steps of one strategy, each measured; the last in detail."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for step in range(steps):
        phase.step = step
        tokens, labels = make_batch(model_config, step, seed=seed, batch_size=micro_batch * world_size,
                                    signal=signal)
        tokens, labels = rank_slice(tokens, labels, rank, world_size)
        record = {"strategy": strategy.name, "rank": rank, "step": step}

        # The last step is measured in detail: per-phase CPU peaks (slow: a tensor tracker) and,
        # on CUDA, the allocator's events for the anatomy of each peak.
        last = step == steps - 1
        with probe.detailed_step(strategy) if last else contextlib.nullcontext():
            phase.enter("forward")
            with probe.phase("forward", record, detailed=last):
                with probe.saved_activations(strategy, into=record):
                    loss = strategy.forward_loss(tokens, labels)
            probe.note_held(strategy)

            phase.enter("backward")
            with probe.phase("backward", record, detailed=last):
                if last:  # what the strategy holds once backward has begun (e.g. reduce buckets)
                    loss.register_hook(lambda grad: probe.note_held(strategy))
                strategy.backward(loss)
            probe.note_held(strategy)
            phase.name = "census after backward"
            record |= probe.census(strategy, "backward")

            phase.enter("step")
            with probe.phase("step", record, detailed=last):
                record["step_applied"] = strategy.step()
            probe.note_held(strategy)
            phase.name = "census after step"
            record |= probe.census(strategy, "step")
        if last:
            record["census_block_rounding_after_step"] = probe.census_block_rounding(strategy)
            # Clearing the cuBLAS workspaces costs a re-allocation: only once, at the end.
            record["cublas_workspace_bytes"] = probe.cublas_workspace_bytes()
            if device.type == "cuda":
                # What is still allocated of the earlier strategies' leftovers (same block, same
                # size): released at some point during this run, not at its start.
                now = probe.live_block_sizes() if leftover_blocks else {}
                record["leftover_bytes_at_end"] = sum(size for addr, size in leftover_blocks.items()
                                                      if now.get(addr) == size)
                phase.name = "peak anatomy"
                record["peak_anatomy"] = probe.peak_anatomy(
                    known_preexisting_bytes=(record["cublas_workspace_bytes"] or 0) + (run.allocated_at_start or 0))

        phase.name = "loss all-reduce"
        local_loss = loss.detach().float().reshape(1)
        dist.all_reduce(local_loss)
        record["loss"] = local_loss.item() / world_size  # equal micro-batches: the global-batch loss
        record["local_loss"] = loss.item()
        run.losses.append(record["loss"])
        run.records.append(record)
        if bar is not None:
            bar.update(1)
    # The last loss's graph reaches the parameters, and through DeepSpeed's hooks the whole
    # optimizer: it goes with this function's frame, before the strategy is torn down.
