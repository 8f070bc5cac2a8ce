"""Where gpt-1b's step time goes on one GPU, knob by knob, in a plain loop (no zerolens harness): the GPT
preset's model, bf16 autocast over fp32 weights (as zerolens's DDP runs it at N=1, without the DDP
wrapper), AdamW; then the knobs of issue 25 one at a time: fused AdamW, torch.compile of each block, a
chunked linear + cross-entropy (fp32 logits never whole), micro-batch 16. Prints one JSON line per variant:
median step time over 10 timed steps after 3 warm-up steps, and MFU against 989.4 TFLOP/s (datasheet) and
against the bf16 matmul rate measured here first.

python3 mfu_knobs.py OUT.json"""
import json
import statistics
import sys
import time

import torch
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


def chunked_loss(hidden, weight, labels, chunk=2048):
    """Linear head + cross-entropy over row chunks, each chunk's logits recomputed in backward (checkpoint):
    no (tokens, vocab) fp32 tensor is ever whole."""
    hidden = hidden.flatten(0, -2)
    labels = labels.flatten()
    total = hidden.new_zeros((), dtype=torch.float32)
    for h, y in zip(hidden.split(chunk), labels.split(chunk)):
        total = total + torch.utils.checkpoint.checkpoint(
            lambda h, y: nn.functional.cross_entropy((h @ weight.t()).float(), y, reduction="sum"), h, y,
            use_reentrant=False)
    return total / labels.numel()


def run(variant, *, fused, compile_blocks, chunked, micro_batch, weights_bf16=False):
    import dataclasses
    config = dataclasses.replace(PRESETS["gpt-1b"], compile_blocks=compile_blocks)
    model = build_model(config, seed=0).cuda()
    if weights_bf16:
        model = model.to(torch.bfloat16)
    params = num_params(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None)
    tokens = torch.randint(0, config.vocab_size, (micro_batch, config.seq_len + 1), device="cuda")
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=not weights_bf16):
            if chunked:
                x = model.token_embedding(inputs) + model.position_embedding(torch.arange(config.seq_len, device="cuda"))
                for block in model.blocks:
                    x = block(x)
                loss = chunked_loss(model.norm(x), model.head.weight, labels)
            else:
                loss = nn.functional.cross_entropy(model(inputs).flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    times = []
    for _ in range(10):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    flops = training_flops_per_token(config, params) * micro_batch * config.seq_len
    result = {"variant": variant, "micro_batch": micro_batch, "fused_adam": fused, "compile_blocks": compile_blocks,
              "chunked_loss": chunked, "weights_bf16": weights_bf16, "step_ms": round(median * 1e3, 2),
              "step_ms_all": [round(t * 1e3, 2) for t in times], "warmup_s": round(warm, 1),
              "tflops": round(flops / median / 1e12, 1), "mfu_datasheet": round(flops / median / DATASHEET, 4),
              "max_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
    del model, optimizer
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return result


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = True
    rate = matmul_rate()
    out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "matmul_bf16_tflops": round(rate / 1e12, 1),
           "variants": []}
    print(json.dumps({k: v for k, v in out.items() if k != "variants"}), flush=True)
    variants = [("baseline", dict(fused=False, compile_blocks=False, chunked=False, micro_batch=8)),
                ("fused", dict(fused=True, compile_blocks=False, chunked=False, micro_batch=8)),
                ("fused+chunked", dict(fused=True, compile_blocks=False, chunked=True, micro_batch=8)),
                ("fused+compile", dict(fused=True, compile_blocks=True, chunked=False, micro_batch=8)),
                ("fused+compile+chunked", dict(fused=True, compile_blocks=True, chunked=True, micro_batch=8)),
                ("fused+compile+chunked mb16", dict(fused=True, compile_blocks=True, chunked=True, micro_batch=16)),
                ("fused+compile mb16", dict(fused=True, compile_blocks=True, chunked=False, micro_batch=16)),
                ("bf16 weights fused+compile", dict(fused=True, compile_blocks=True, chunked=False, micro_batch=8,
                                                    weights_bf16=True))]
    for name, kw in variants:
        r = run(name, **kw)
        r["mfu_measured_rate"] = round(r["tflops"] * 1e12 / rate, 4)
        print(json.dumps(r), flush=True)
        out["variants"].append(r)
        json.dump(out, open(sys.argv[1], "w"), indent=1)
