"""Where ZeRO-2's and DDP's extra step time goes at N=1 on gpt-1b (bf16, micro-batch 8, fused AdamW), in
plain loops without zerolens's harness: DeepSpeed's own loop (deepspeed.initialize, engine.backward,
engine.step) with zerolens's DeepSpeed config and variants of it, and torch's DDP wrapper around the model
with bf16 autocast. Each variant: 3 warm-up steps, 10 timed (median), then 2 steps under torch.profiler,
whose 12 costliest CUDA kernels and the time of each marked region are printed. One JSON line per variant.

python3 step_profile.py OUT.json"""
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from zerolens.models.model import PRESETS, build_model

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("LOCAL_RANK", "0")
CONFIG = PRESETS["gpt-1b"]
MB = 8


def ds_config(bf16=None, **zero):
    config = {"train_batch_size": MB, "train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 2e-4, "torch_adam": True, "fused": True}},
              "gradient_clipping": zero.pop("gradient_clipping", 1.0), "steps_per_print": 1 << 30,
              "bf16": {"enabled": True, **(bf16 or {})},
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7, "reduce_scatter": True, **zero}}
    return config


def timed(step, name, extra):
    tokens = torch.randint(0, CONFIG.vocab_size, (MB, CONFIG.seq_len + 1), device="cuda")
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    for _ in range(3):
        step(inputs, labels)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start = time.perf_counter()
        step(inputs, labels)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step(inputs, labels)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sorted((e for e in events if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0),
                     key=lambda e: -e.self_device_time_total)
    regions = {e.key: round(e.device_time_total / 2e3, 2) for e in events if e.key.startswith("zl:")}
    regions_cpu = {e.key: round(e.cpu_time_total / 2e3, 2) for e in events if e.key.startswith("zl:")}
    result = {"variant": name, **extra, "step_ms": round(statistics.median(times) * 1e3, 2),
              "step_ms_all": [round(t * 1e3, 1) for t in times],
              "region_gpu_ms_per_step": regions, "region_cpu_ms_per_step": regions_cpu,
              "top_kernels_ms_per_step": [(k.key[:90], round(k.self_device_time_total / 2e3, 2), k.count // 2)
                                          for k in kernels[:25]],
              "top_cpu_ops_ms_per_step": [(e.key[:90], round(e.self_cpu_time_total / 2e3, 2), e.count // 2)
                                          for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:20]]}
    print(json.dumps(result), flush=True)
    return result


def region(name):
    return torch.profiler.record_function("zl:" + name)


def deepspeed_variant(name, bf16=None, **zero):
    import deepspeed
    model = build_model(CONFIG, seed=0)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(bf16, **zero))

    def step(inputs, labels):
        with region("forward"):
            loss = nn.functional.cross_entropy(engine(inputs).flatten(0, 1).float(), labels.flatten())
        with region("backward"):
            engine.backward(loss)
        with region("step"):
            engine.step()
    try:
        return timed(step, name, {"zero_optimization": zero, "bf16": bf16 or {}})
    finally:
        engine.destroy()
        del engine, model
        torch.cuda.empty_cache()


def ddp_variant(name, *, wrap, **ddp_kwargs):
    model = build_model(CONFIG, seed=0).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-4, fused=True)
    trained = nn.parallel.DistributedDataParallel(model, **ddp_kwargs) if wrap else model

    def step(inputs, labels):
        with region("forward"), torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(trained(inputs).flatten(0, 1).float(), labels.flatten())
        with region("backward"):
            loss.backward()
        with region("step"):
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    try:
        return timed(step, name, {"ddp_wrapper": wrap, **ddp_kwargs})
    finally:
        del trained, model, optimizer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    import deepspeed
    torch.cuda.set_device(0)
    deepspeed.init_distributed("nccl")
    out = {"torch": torch.__version__, "deepspeed": deepspeed.__version__, "variants": []}
    runs = [lambda: ddp_variant("DDP wrapper", wrap=True),
            lambda: deepspeed_variant("zero2 as zerolens configures it"),
            lambda: deepspeed_variant("zero2, no bf16 overflow check", bf16={"check_grad_overflow": False}),
            lambda: deepspeed_variant("zero2, overlap_comm", overlap_comm=True)]
    for run in runs:
        try:
            out["variants"].append(run())
        except Exception as e:
            print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        json.dump(out, open(sys.argv[1], "w"), indent=1)
