"""`zerolens estimate`: per-rank memory predicted without training, GPUs or torch.distributed.

Pure computation (`estimate`) apart from presentation (`render_estimate`).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .model import PRESETS, load_user_function, parameter_shapes
from .strategies import STRATEGIES
from .theory import (RETAINED_KEYS, deepspeed_estimator, paper_model_states, predict_retained,
                     transient_reduce_bucket_bytes)

# The ZeRO paper's stage whose formula applies. Both FSDP2 modes keep parameters, gradients and
# optimizer states sharded between steps, as stage 3 does.
STAGE = {"ddp": 0, "zero0": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp2-grad": 3, "fsdp2": 3}


def param_shapes_from_factory(spec: str) -> list[tuple[int, ...]]:
    """`module:factory` -> the shapes of the model's parameters, built on the meta device (no memory)."""
    factory = load_user_function(spec)
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise ValueError(f"{spec} returned {type(model).__name__}, not a torch.nn.Module")
    return [tuple(p.shape) for p in model.parameters()]  # parameters() yields a tied weight once


def preset_shapes(name: str) -> list[tuple[int, ...]]:
    return [tuple(shape) for shape in parameter_shapes(PRESETS[name])]


def estimate(*, strategies: tuple[str, ...], world_size: int, precision: str, reduce_bucket_size: int,
             param_shapes: list[tuple[int, ...]] | None = None, params: float | None = None) -> dict:
    """Per-strategy prediction. With parameter shapes: DDP's, DeepSpeed's and FSDP2's real layout per
    rank. With only a count: the ZeRO paper's per-component formulas (16-bit weights and gradients)."""
    param_numels = None if param_shapes is None else [math.prod(shape) for shape in param_shapes]
    psi = sum(param_numels) if param_numels is not None else params
    out = {"params": psi, "param_tensors": len(param_numels) if param_numels else None,
           "world_size": world_size, "precision": precision, "reduce_bucket_size": reduce_bucket_size,
           "strategies": {}}
    for name in strategies:
        stage = STAGE[name]
        entry = {"paper_model_states_bytes": paper_model_states(psi, world_size, stage),
                 "deepspeed_estimator_bytes": (deepspeed_estimator(psi, world_size, stage,
                                                                   max(param_numels) if param_numels else 0)
                                               if name.startswith("zero") else None)}
        if param_numels is None:
            shard = world_size if stage == 3 else 1
            entry["paper_components"] = {
                "param_bytes": 2 * psi / shard, "grad_bytes": 2 * psi / (world_size if stage >= 2 else 1),
                "optimizer_state_bytes": 12 * psi / (world_size if stage >= 1 else 1)}
            entry["ranks"] = None
        else:
            ranks = []
            for rank in range(world_size):
                r = predict_retained(name, param_numels, world_size, rank, precision,
                                     reduce_bucket_size=reduce_bucket_size, param_shapes=param_shapes)
                r = {"rank": rank, **{k: r[k] for k in RETAINED_KEYS}}
                r["transient_reduce_bucket_bytes"] = transient_reduce_bucket_bytes(name, precision,
                                                                                   reduce_bucket_size)
                r["retained_total_bytes"] = (r["param_bytes"] + r["grad_bytes_after_step"]
                                             + r["optimizer_state_bytes"])
                ranks.append(r)
            entry["ranks"] = ranks
        out["strategies"][name] = entry
    return out


def human(n: float | None) -> str:
    """MiB below 1 GiB, GiB above; both 1024-based."""
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.3f} MiB"


def render_estimate(result: dict) -> str:
    from .report import markdown_table
    n, psi = result["world_size"], result["params"]
    lines = [f"zerolens estimate: {psi:,.0f} parameters, {n} ranks, {result['precision']}"]
    if next(iter(result["strategies"].values()))["ranks"] is None:
        rows = [[name, human(e["paper_components"]["param_bytes"]), human(e["paper_components"]["grad_bytes"]),
                 human(e["paper_components"]["optimizer_state_bytes"]), human(e["paper_model_states_bytes"]),
                 human(e["deepspeed_estimator_bytes"])] for name, e in result["strategies"].items()]
        lines += ["ZeRO paper's formulas per rank (16-bit weights and gradients, K = 12): parameter sizes unknown, "
                  "so no padding, partition-boundary or bucket terms.", "",
                  markdown_table(["strategy", "params", "gradients", "optimizer states", "model states (paper)",
                                  "DeepSpeed estimator"], rows)]
        return "\n".join(lines)
    rows = []
    for name, e in result["strategies"].items():
        ranks = e["ranks"]
        largest = max(ranks, key=lambda r: (r["grad_bytes_after_backward"], -r["rank"]))
        for r in [ranks[0]] + ([largest] if largest is not ranks[0] else []):
            rows.append([name, r["rank"], human(r["param_bytes"]), human(r["grad_bytes_after_backward"]),
                         human(r["grad_bytes_after_step"]), human(r["optimizer_state_bytes"]),
                         human(r["comm_buffer_bytes_after_backward"]), human(r["transient_reduce_bucket_bytes"]),
                         human(e["paper_model_states_bytes"]), human(e["deepspeed_estimator_bytes"])])
    lines += ["Per rank, from the real layout (padding, partition boundaries, buckets); rank 0 and the rank "
              "holding the most gradients. Activations are not included.", "",
              markdown_table(["strategy", "rank", "params", "grads after backward", "grads after step",
                              "optimizer states", "comm buffers kept", "reduce bucket in backward",
                              "model states (paper)", "DeepSpeed estimator"], rows)]
    return "\n".join(lines)
