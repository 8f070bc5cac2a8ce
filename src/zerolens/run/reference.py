"""bench's reference loops: the same model, batches and settings trained as a user writes the loop,
without zerolens's training loop, probe or strategy classes, each step timed as bench times its own
(the queue drained before and after, nothing else in between). DDP: torch's DistributedDataParallel
and AdamW under autocast (a GradScaler for fp16), the gradients clipped as zerolens clips them; a
ZeRO strategy: DeepSpeed's own loop (engine(...), engine.backward, engine.step) with the DeepSpeed
config the strategy runs. Against them the strategies' step times give the harness's own cost
(report/bench.py, `harness_overhead`). FSDP2 has no reference loop yet.
"""
from __future__ import annotations

import contextlib
import io
import os
import time

import torch
import torch.distributed as dist

from zerolens.measure.timer import synchronize
from zerolens.models.data import rank_batches
from zerolens.models.model import build_model, loss_of
from zerolens.strategies import DTYPES, make_strategy
from zerolens.strategies.base import engine_inputs

PREFIX = "reference-"
WITH_REFERENCE = ("ddp", "zero0", "zero1", "zero2", "zero3")


def reference_of(name: str) -> str | None:
    """The name of the reference loop bench runs beside strategy `name`, None where it has none."""
    return PREFIX + name if name in WITH_REFERENCE else None


def run_reference(name: str, config, device: torch.device) -> dict:
    """This rank's step times of the reference loop `name` (reference-<strategy>): warm-up steps
    first, as bench runs its own."""
    strategy = name.removeprefix(PREFIX)
    batches = rank_batches(config.model, seed=config.seed, micro_batch=config.micro_batch, signal=config.signal,
                           rank=dist.get_rank(), world_size=dist.get_world_size())
    step, describe, teardown = (ddp_loop(config, device) if strategy == "ddp"
                                else deepspeed_loop(strategy, config, device))
    torch.manual_seed(config.seed + 1 + dist.get_rank())  # dropout's draws, as zerolens's loop seeds them
    seconds, losses = [], []
    for _ in range(config.warmup_steps + config.steps):
        micro_batches = [next(batches) for _ in range(config.grad_accum)]  # made before the clock starts
        synchronize(device)
        start = time.perf_counter()
        loss = step(micro_batches)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
    teardown()
    # The global batch's loss per step, the mean over ranks, as zerolens's loop reports it: one all-reduce.
    total = torch.tensor(losses, dtype=torch.float32, device=device)
    dist.all_reduce(total)
    return {"name": name, "process_id": os.getpid(), "seconds": seconds,
            "losses": (total / dist.get_world_size()).tolist(), "settings": describe, "notes": []}


def ddp_loop(config, device: torch.device):
    """(step, describe, teardown) of the loop DDP's users write."""
    model = build_model(config.model, config.seed).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, fused=config.fused_adam or None)
    scaler = torch.amp.GradScaler(device.type, enabled=config.precision == "fp16")
    dtype = DTYPES[config.precision]

    def step(micro_batches):
        for i, (tokens, labels) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                with torch.autocast(device.type, dtype=dtype, enabled=config.precision != "fp32"):
                    logits = ddp(tokens.to(device))
                loss = loss_of(logits, labels.to(device)) / len(micro_batches)
                scaler.scale(loss).backward()
        if config.gradient_clipping:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.gradient_clipping)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def teardown():
        nonlocal model, ddp, optimizer
        del model, ddp, optimizer

    return step, {"loop": "DistributedDataParallel, torch.optim.AdamW, autocast"}, teardown


def deepspeed_loop(strategy: str, config, device: torch.device):
    """(step, describe, teardown) of DeepSpeed's own loop, with the DeepSpeed config `strategy` runs."""
    import deepspeed
    ds_config = make_strategy(strategy, config.train_settings()).ds_config()
    linear = torch.nn.functional.linear  # ZeRO-3 puts its own in and leaves it (DeepSpeed.teardown)
    model = build_model(config.model, config.seed)
    quiet = contextlib.nullcontext() if config.verbose else contextlib.redirect_stdout(io.StringIO())
    with quiet:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    dtype = DTYPES[config.precision]

    def step(micro_batches):
        for tokens, labels in micro_batches:
            loss = loss_of(engine(engine_inputs(tokens, device, dtype)), labels.to(device))
            engine.backward(loss)
            engine.step()
        return loss.detach()

    def teardown():
        engine.destroy()
        torch.nn.functional.linear = linear

    return step, {"loop": "deepspeed.initialize, engine.backward, engine.step", "ds_config": ds_config}, teardown
