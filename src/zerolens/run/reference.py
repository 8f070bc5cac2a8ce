"""bench's reference loops: beside a strategy, the same model, batches and settings trained in the loop
its backend's users write, without zerolens's training loop and probe (each backend writes its own:
Strategy.reference_loop: DDP's, DeepSpeed's and FSDP2's), each step timed as bench
times its own (the queue drained before and after, nothing else in between). Against them the
strategies' step times give the harness's own cost (report/bench.py, `harness_overhead`).
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from zerolens.measure.timer import synchronize
from zerolens.models.data import rank_batches
from zerolens.models.model import build_model
from zerolens.strategies import make_strategy, registry

PREFIX = "reference-"


def reference_of(name: str) -> str | None:
    """The name of the reference loop bench runs beside strategy `name`, None where it has none."""
    return PREFIX + name if registry.has_reference_loop(name) else None


def run_reference(name: str, config, device: torch.device) -> dict:
    """This rank's step times of the reference loop `name` (reference-<strategy>): warm-up steps first,
    as bench runs its own; and its losses, the global batch's (the mean over its micro-batches and over
    ranks) as zerolens reports them."""
    batches = rank_batches(config.model, seed=config.seed, micro_batch=config.micro_batch, signal=config.signal,
                           rank=dist.get_rank(), world_size=dist.get_world_size())
    strategy_name = name.removeprefix(PREFIX)
    strategy = make_strategy(strategy_name, config.train_settings(strategy_name))
    step, teardown, loop = strategy.reference_loop(build_model(config.model_for(strategy.name), config.seed), device)
    torch.manual_seed(config.seed + 1 + dist.get_rank())  # dropout's draws, as zerolens's loop seeds them
    seconds, losses = [], []
    for _ in range(config.warmup_steps + config.steps):
        micro_batches = [next(batches) for _ in range(config.grad_accum)]  # made before the clock starts
        synchronize(device)
        start = time.perf_counter()
        micro_losses = step(micro_batches)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
        losses.append(sum(loss.item() for loss in micro_losses) / len(micro_losses))  # as run/train.py's
    teardown()
    total = torch.tensor(losses, dtype=torch.float32, device=device)
    dist.all_reduce(total)
    return {"name": name, "process_id": os.getpid(), "seconds": seconds,
            "losses": (total / dist.get_world_size()).tolist(), "settings": {"loop": loop}, "notes": []}
