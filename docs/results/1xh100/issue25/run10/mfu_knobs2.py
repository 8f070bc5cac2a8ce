"""gpt-1b on one GPU in a plain loop (no zerolens harness; torch's DDP wrapper at world size 1, as zerolens's
DDP and its reference loop run it): bf16 autocast over fp32 weights, fused AdamW, blocks compiled, clipping at
1.0. Knobs beyond bench's defaults of run9 (micro-batch 16), one at a time: the final LayerNorm, head and fp32
cross-entropy compiled as one function (their fp32 logits fused away), and micro-batch 24 and 32. Each variant
starts from a reset torch.compile (no shape carried over from the one before). One JSON line per variant:
median of 10 timed steps after 3 warm-up steps, MFU against 989.4 TFLOP/s (datasheet) and against the bf16
matrix-product rate measured first.

torchrun --nproc-per-node 1 mfu_knobs2.py OUT.json"""
import dataclasses
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from zerolens.models.model import PRESETS, build_model, num_params, training_flops_per_token

DATASHEET = 989.4e12


def matmul_rate(n=8192, reps=50):
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (time.perf_counter() - start)


class HeadLoss(nn.Module):
    """The GPT's final norm and head, and the fp32 cross-entropy, as one module to compile."""
    def __init__(self, gpt):
        super().__init__()
        self.norm, self.head = gpt.norm, gpt.head

    def forward(self, x, labels):
        return nn.functional.cross_entropy(self.head(self.norm(x)).flatten(0, 1).float(), labels.flatten())


def run(variant, *, micro_batch, compiled_loss):
    torch._dynamo.reset()
    config = dataclasses.replace(PRESETS["gpt-1b"], compile_blocks=True)
    model = build_model(config, seed=0).cuda()
    params = num_params(model)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, config.vocab_size, (micro_batch, config.seq_len + 1), device="cuda")
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    head_loss = HeadLoss(model)
    head_loss.compile()

    def body(inputs, labels):
        if not compiled_loss:
            return nn.functional.cross_entropy(model(inputs).flatten(0, 1).float(), labels.flatten())
        x = model.token_embedding(inputs) + model.position_embedding(torch.arange(config.seq_len, device="cuda"))
        for block in model.blocks:
            x = block(x)
        return head_loss(x, labels)

    if compiled_loss:
        model.forward = body  # DDP calls its module: with the loss inside, DDP's hooks see the same parameters

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = ddp(inputs, labels) if compiled_loss else \
                nn.functional.cross_entropy(ddp(inputs).flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    t0 = time.perf_counter()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    times = []
    for _ in range(10):
        start = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    flops = training_flops_per_token(config, params) * micro_batch * config.seq_len
    result = {"variant": variant, "micro_batch": micro_batch, "compiled_loss": compiled_loss,
              "step_ms": round(median * 1e3, 2), "step_ms_all": [round(t * 1e3, 2) for t in times],
              "warmup_s": round(warm, 1), "loss": round(loss.item(), 4), "tflops": round(flops / median / 1e12, 1),
              "mfu_datasheet": round(flops / median / DATASHEET, 4),
              "max_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
              "max_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2)}
    del model, ddp, optimizer, head_loss
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return result


if __name__ == "__main__":
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    rate = matmul_rate()
    out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "matmul_bf16_tflops": round(rate / 1e12, 1),
           "variants": []}
    print(json.dumps({k: v for k, v in out.items() if k != "variants"}), flush=True)
    variants = [("mb16 (run9's defaults)", dict(micro_batch=16, compiled_loss=False)),
                ("mb16 + compiled head and loss", dict(micro_batch=16, compiled_loss=True)),
                ("mb32", dict(micro_batch=32, compiled_loss=False)),
                ("mb32 + compiled head and loss", dict(micro_batch=32, compiled_loss=True)),
                ("mb24 + compiled head and loss", dict(micro_batch=24, compiled_loss=True))]
    for name, kw in variants:
        r = run(name, **kw)
        r["mfu_measured_rate"] = round(r["tflops"] * 1e12 / rate, 4)
        print(json.dumps(r), flush=True)
        out["variants"].append(r)
        json.dump(out, open(sys.argv[1], "w"), indent=1)
    dist.destroy_process_group()
