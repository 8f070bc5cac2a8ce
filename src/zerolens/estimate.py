"""`zerolens estimate`: per-rank memory predicted without training, GPUs or torch.distributed.

Pure computation (`estimate`) apart from presentation (`render_estimate`).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .model import load_user_function
from .predict_peak import predict_or_why_not
from .strategies import TrainSettings, registry
from .theory import ELEMENT_BYTES, deepspeed_estimator, deepspeed_layout, paper_model_states


def param_shapes_from_factory(spec: str) -> list[tuple[int, ...]]:
    """`module:factory` -> the shapes of the model's parameters, built on the meta device (no memory)."""
    factory = load_user_function(spec)
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise ValueError(f"{spec} returned {type(model).__name__}, not a torch.nn.Module")
    return [tuple(p.shape) for p in model.parameters()]  # parameters() yields a tied weight once


def estimate(*, strategies: tuple[str, ...], world_size: int, precision: str, reduce_bucket_size: int,
             param_shapes: list[tuple[int, ...]] | None = None, params: float | None = None,
             model_config=None, micro_batch: int = 8, cuda_capability: tuple[int, int] | None = None,
             fused_adam: bool = False, gradient_clipping: float = 1.0) -> dict:
    """Per-strategy prediction. With parameter shapes: DDP's, DeepSpeed's and FSDP2's real layout per
    rank. With only a count: the ZeRO paper's per-component formulas (16-bit weights and gradients).
    With `model_config` (a model zerolens can build and feed) also each rank's peak per phase
    (predict_peak.py) for `micro_batch` samples per rank, on CUDA (`cuda_capability`) or the CPU."""
    param_numels = None if param_shapes is None else [math.prod(shape) for shape in param_shapes]
    psi = sum(param_numels) if param_numels is not None else params
    out = {"params": psi, "param_tensors": len(param_numels) if param_numels else None,
           "world_size": world_size, "precision": precision, "reduce_bucket_size": reduce_bucket_size,
           "strategies": {}}
    for name in strategies:
        spec = registry.spec(name)
        entry = {"paper_model_states_bytes": paper_model_states(psi, world_size, spec.paper_stage),
                 "deepspeed_estimator_bytes": (deepspeed_estimator(psi, world_size, spec.paper_stage,
                                                                   max(param_numels) if param_numels else 0)
                                               if spec.needs_deepspeed else None)}
        if param_numels is None:
            entry["components"] = unpadded_components(spec, psi, world_size, precision)
            entry["ranks"] = None
        else:
            ranks = []
            for rank in range(world_size):
                r = {"rank": rank, **registry.predict_retained(
                    name, param_numels, world_size, rank, precision, reduce_bucket_size=reduce_bucket_size,
                    param_shapes=param_shapes, deepspeed=deepspeed_layout())}  # the installed DeepSpeed's
                r["transient_reduce_bucket_bytes"] = spec.reduce_bucket_bytes(precision, reduce_bucket_size)
                # Between steps: what the backend keeps, its kept buffers included (DDP's bucket copy
                # of the gradients, ZeRO-3's reduce bucket).
                r["retained_total_bytes"] = (r["param_bytes"] + r["grad_bytes_after_step"]
                                             + r["optimizer_state_bytes"] + r["comm_buffer_bytes_after_backward"])
                ranks.append(r)
            entry["ranks"] = ranks
            add_peaks(entry, name, model_config, TrainSettings(
                precision=precision, world_size=world_size, micro_batch=micro_batch,
                reduce_bucket_size=reduce_bucket_size, fused_adam=fused_adam, gradient_clipping=gradient_clipping),
                cuda_capability)
        out["strategies"][name] = entry
    out |= {"micro_batch": micro_batch, "device": "cpu" if cuda_capability is None else "cuda",
            "cuda_capability": None if cuda_capability is None else ".".join(map(str, cuda_capability))}
    return out


def add_peaks(entry: dict, name: str, model_config, settings: TrainSettings, cuda_capability) -> None:
    """Each rank's predicted peaks into `entry`, or why there are none (`peak_not_predicted`)."""
    if model_config is None:
        entry["peak_not_predicted"] = "--model without --batch: zerolens cannot feed it (give --batch to predict peaks)"
        return
    predicted = predict_or_why_not(name, model_config, settings, cuda_capability=cuda_capability)
    if "why_not" in predicted:
        entry["peak_not_predicted"] = predicted["why_not"]
        return
    for rank, peaks in zip(entry["ranks"], predicted["ranks"]):
        rank.update({k: peaks[k] for k in ("peak_during_forward", "peak_during_backward", "peak_during_step",
                                           "peak_bytes", "cublas_workspace_bytes")})


def unpadded_components(spec: registry.StrategySpec, psi: float, world_size: int, precision: str) -> dict:
    """Per-rank bytes by component from a parameter count alone: the strategy's layout (the
    registry's `unpadded`: DDP's fp32 weights and gradients under autocast and its bucket copy;
    DeepSpeed's 16-bit weights with fp32 masters; FSDP2's fp32 shards) without the padding and
    partition-boundary terms, which need the parameters' sizes."""
    params, grads, states, buffers = spec.unpadded(psi, world_size, ELEMENT_BYTES[precision])
    return {"param_bytes": params, "grad_bytes_after_backward": grads, "optimizer_state_bytes": states,
            "comm_buffer_bytes_after_backward": buffers, "retained_total_bytes": params + states + buffers}


def paper_gb(n: float) -> str:
    """The ZeRO paper's unit: GB, 10^9 bytes."""
    gb = n / 1e9
    return f"{gb:,.1f}" if gb >= 10 else f"{gb:.3f}"


def render_estimate(result: dict) -> list:
    """The estimate for the terminal (rich renderables), one unit per table; --json has every figure."""
    from .tables import in_unit, terminal_table, unit_for
    n, psi = result["world_size"], result["params"]
    lines = [f"zerolens estimate: {psi:,.0f} parameters, {n} ranks, {result['precision']}"]
    entries = result["strategies"]
    if next(iter(entries.values()))["ranks"] is None:
        keys = ("param_bytes", "grad_bytes_after_backward", "optimizer_state_bytes", "comm_buffer_bytes_after_backward",
                "retained_total_bytes")
        unit, label = unit_for([e["components"][k] for e in entries.values() for k in keys]
                               + [e["paper_model_states_bytes"] for e in entries.values()])
        rows = [[name, *(in_unit(e["components"][k], unit, 2) for k in keys),
                 in_unit(e["paper_model_states_bytes"], unit, 2), paper_gb(e["paper_model_states_bytes"]),
                 in_unit(e["deepspeed_estimator_bytes"], unit, 2)] for name, e in entries.items()]
        return lines + [
            f"Per rank, {label} (1024-based), from the parameter count alone: each strategy's layout without the "
            "padding and partition-boundary terms, which need the parameters' sizes (--preset or --model). "
            "The ZeRO paper's model states (16-bit, K = 12) also in GB (10^9 bytes), the paper's unit. "
            "Activations are not included.",
            terminal_table(["strategy", "params", "grads", "optimizer", "buffers", "kept total", "paper",
                            "paper GB", "DeepSpeed"], rows, right=set(range(1, 9)))]
    shown = []
    for name, e in entries.items():
        ranks = e["ranks"]
        largest = max(ranks, key=lambda r: (r["grad_bytes_after_backward"], -r["rank"]))
        shown += [(name, e, r) for r in [ranks[0]] + ([largest] if largest is not ranks[0] else [])]
    keys = ("param_bytes", "grad_bytes_after_backward", "optimizer_state_bytes", "comm_buffer_bytes_after_backward",
            "transient_reduce_bucket_bytes", "retained_total_bytes")
    unit, label = unit_for([r[k] for _, _, r in shown for k in keys] + [r.get("peak_bytes") for _, _, r in shown]
                           + [e["paper_model_states_bytes"] for e in entries.values()])
    rows = [[name, r["rank"], *(in_unit(r[k], unit, 2) for k in keys), in_unit(r.get("peak_bytes"), unit, 2),
             in_unit(e["paper_model_states_bytes"], unit, 2), paper_gb(e["paper_model_states_bytes"]),
             in_unit(e["deepspeed_estimator_bytes"], unit, 2)] for name, e, r in shown]
    where = ("on the CPU" if result["device"] == "cpu" else
             f"on CUDA (compute capability {result['cuda_capability']}'s cuBLAS workspaces included)")
    not_predicted = [f"{name}: {e['peak_not_predicted']}" for name, e in entries.items() if "peak_not_predicted" in e]
    return lines + [
        f"Per rank, {label} (1024-based), from the real layout (padding, partition boundaries, buckets): rank 0 and "
        "the rank holding the most gradients; gradients right after backward; \"bucket\": the reduce bucket "
        "allocated in backward; \"kept\": everything held between steps; \"peak\": the highest of a training "
        f"step, activations and temporaries included, for {result['micro_batch']} samples per rank {where}. "
        "The ZeRO paper's model states also in GB (10^9 bytes), its unit (--json: every rank and figure).",
        terminal_table(["strategy", "rank", "params", "grads", "optim", "buffers", "bucket", "kept", "peak", "paper",
                        "paper GB", "DS est."], rows, right=set(range(1, 12))),
        *(f"No peak for {line}." for line in not_predicted)]
