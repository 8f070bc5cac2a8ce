"""`zerolens estimate`: per-rank memory predicted without training, GPUs or torch.distributed.

Pure computation (`estimate`) apart from presentation (`render_estimate`).
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch
from torch import nn

from zerolens.commands.workers import InProcess, default_jobs, pool
from zerolens.errors import UserError, one_line_error
from zerolens.models.model import (
    MIXED_WEIGHTS,
    PRESETS,
    check_weights_and_precision,
    load_user_function,
    meta_model,
    trained_elements,
    weight_bytes_of,
)
from zerolens.predict.allocator import allocator_setting, outside_allocator_bytes, outside_allocator_source
from zerolens.predict.depths import DepthScaling
from zerolens.predict.formulas import deepspeed_estimator, paper_model_states
from zerolens.predict.peak import predict_or_why_not, target_capability, trace_caveat, trace_device, traced_on
from zerolens.report.tables import say
from zerolens.run.config import bucket_elements
from zerolens.run.flags import (
    PRESET_GPU_PRECISION,
    model_from_args,
    parse_strategies,
)
from zerolens.strategies import TrainSettings, registry
from zerolens.strategies.layout import ELEMENT_BYTES, deepspeed_layout


def factory_meta_model(spec: str) -> nn.Module:
    """`module:factory` -> its model, built on the meta device (no memory)."""
    factory = load_user_function(spec)
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise ValueError(f"{spec} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def estimate(*, strategies: tuple[str, ...], world_size: int, precision: str, reduce_bucket_size: int,
             param_shapes: list[tuple[int, ...]] | None = None, params: float | None = None,
             model_config=None, micro_batch: int = 8, cuda_capability: tuple[int, int] | None = None,
             fused_adam: bool = False, gradient_clipping: float = 1.0, weight_bytes: int = 4,
             trainable: list[bool] | None = None, grad_accum: int = 1, jobs: int = 1) -> dict:
    """Per-strategy prediction. With parameter shapes: DDP's, DeepSpeed's and FSDP2's real layout per
    rank. With only a count: the ZeRO paper's per-component formulas (16-bit weights and gradients).
    With `model_config` (a model zerolens can build and feed) also each rank's peak per phase
    (predict/peak.py) for `micro_batch` samples per rank, `grad_accum` micro-batches per optimizer step,
    on CUDA (`cuda_capability`) or the CPU.
    `weight_bytes`: the element size of the weights as the model is built (models.model.weight_bytes);
    `trainable`: which parameters train (models.model.trainable_flags; None: all); `jobs`: processes
    that predict the strategies' peaks in parallel (commands/workers.py)."""
    param_numels = None if param_shapes is None else [math.prod(shape) for shape in param_shapes]
    psi = sum(param_numels) if param_numels is not None else params
    trained = psi if param_numels is None else trained_elements(param_numels, trainable)
    out = {"params": psi, "trained_params": trained, "param_tensors": len(param_numels) if param_numels else None,
           "world_size": world_size, "precision": precision, "reduce_bucket_size": reduce_bucket_size,
           "strategies": {}}
    settings = TrainSettings(precision=precision, world_size=world_size, micro_batch=micro_batch, grad_accum=grad_accum,
                             reduce_bucket_size=reduce_bucket_size, fused_adam=fused_adam,
                             gradient_clipping=gradient_clipping)
    traced = param_numels is not None and model_config is not None
    with pool(min(jobs, len(strategies))) if traced and jobs > 1 and len(strategies) > 1 else InProcess() as executor:
        # In a pool, the peaks are traced while this process works out the layouts (seconds at 4096 ranks).
        # The registry's last strategies first: the sharded ones take the longest (FSDP2's last ranks traced
        # apart, ZeRO-3 traced whole: docs/performance.md), and a pool whose longest jobs start first ends
        # sooner: with 2 workers the last to start was FSDP2 (about 27 s alone on Llama-2-70B at 512 ranks).
        peaks = {name: executor.submit(predicted_peaks, name, model_config, settings, cuda_capability)
                 for name in reversed(strategies)} if traced else {}
        for name in strategies:
            out["strategies"][name] = layout_entry(name, psi, param_numels, param_shapes, world_size, precision,
                                                   reduce_bucket_size, weight_bytes, trainable)
        for name, future in peaks.items():
            add_peaks(out["strategies"][name], name, future.result(), cuda_capability)
    if param_numels is not None and model_config is None:
        for entry in out["strategies"].values():
            entry["peak_not_predicted"] = "--model without --batch: zerolens cannot feed it (give --batch to predict peaks)"
    out |= {"micro_batch": micro_batch, "grad_accum": grad_accum,
            "device": "cpu" if cuda_capability is None else "cuda",
            "cuda_capability": None if cuda_capability is None else ".".join(map(str, cuda_capability)),
            # Where the peaks were traced: a CUDA target on fake CUDA tensors where a GPU is visible, else on the CPU.
            "traced_on": traced_on(trace_device(cuda_capability)) if model_config is not None else None}
    return out


def layout_entry(name: str, psi: float, param_numels: list[int] | None, param_shapes, world_size: int,
                 precision: str, reduce_bucket_size: int, weight_bytes: int, trainable) -> dict:
    """One strategy's entry: the paper's and DeepSpeed's figures, and per rank its real layout (with the
    parameters' sizes) or, from a count alone, the layout's formulas (`components`)."""
    spec = registry.spec(name)
    entry = {"paper_model_states_bytes": paper_model_states(psi, world_size, spec.paper_stage),
             "deepspeed_estimator_bytes": (deepspeed_estimator(psi, world_size, spec.paper_stage,
                                                               max(param_numels) if param_numels else 0)
                                           if spec.needs_deepspeed else None)}
    if param_numels is None:
        return entry | {"components": unpadded_components(spec, psi, world_size, precision), "ranks": None}
    ranks = []
    deepspeed = deepspeed_layout()  # the installed DeepSpeed's (read from its package metadata: once, not per rank)
    for rank in range(world_size):
        r = {"rank": rank, **registry.predict_retained(
            name, param_numels, world_size, rank, precision, reduce_bucket_size=reduce_bucket_size,
            param_shapes=param_shapes, deepspeed=deepspeed, weight_bytes=weight_bytes, trainable=trainable)}
        r["transient_reduce_bucket_bytes"] = spec.reduce_bucket_bytes(precision, reduce_bucket_size)
        # Between steps: what the backend keeps, its kept buffers included (DDP's bucket copy
        # of the gradients, ZeRO-3's reduce bucket).
        r["retained_total_bytes"] = (r["param_bytes"] + r["grad_bytes_after_step"]
                                     + r["optimizer_state_bytes"] + r["comm_buffer_bytes_after_backward"])
        ranks.append(r)
    return entry | {"ranks": ranks}


def predicted_peaks(name: str, model_config, settings: TrainSettings, cuda_capability) -> dict:
    """predict_or_why_not, a deep model's trace scaled from shallow ones where they allow (predict/depths.py)."""
    return predict_or_why_not(name, model_config, settings, cuda_capability=cuda_capability, trace=DepthScaling())


def add_peaks(entry: dict, name: str, predicted: dict, cuda_capability) -> None:
    """One strategy's predicted peaks (predict_or_why_not's) into its entry."""
    if "why_not" in predicted:
        entry["peak_not_predicted"] = predicted["why_not"]
        return
    # Whether the traces were scaled from shallow ones (their depths), or why not where it was tried: per
    # rank, as ranks of different layouts are traced apart; for the strategy, the first of each and, where
    # its layouts differ in this, how many ranks' traces were scaled.
    depth_keys = ("depth_scaled_from", "why_not_depth_scaled")
    for key in depth_keys:
        first = next((peaks[key] for peaks in predicted["ranks"] if key in peaks), None)
        if first is not None:
            entry[key] = first
    if all(key in entry for key in depth_keys):
        entry["depth_scaled_ranks"] = sum("depth_scaled_from" in peaks for peaks in predicted["ranks"])
    for rank, peaks in zip(entry["ranks"], predicted["ranks"]):
        rank.update({k: peaks[k] for k in ("peak_during_forward", "peak_during_backward", "peak_during_step",
                                           "peak_bytes", "cublas_workspace_bytes", *depth_keys) if k in peaks})
        if cuda_capability is not None:  # what the caching allocator and the rest of the process need
            rank.update({k: peaks[k] for k in ("reserved_peak_bytes", "min_allocator_cap_bytes",
                                               "allocated_peak_bytes", "allocated_phase_peaks",
                                               "allocator_not_replayed") if k in peaks})
            rank["outside_allocator_bytes"] = outside_allocator_bytes(registry.spec(name).needs_deepspeed)


def unpadded_components(spec: registry.StrategySpec, psi: float, world_size: int, precision: str) -> dict:
    """Per-rank bytes by component from a parameter count alone: the strategy's layout (the
    registry's `unpadded`: DDP's fp32 weights and gradients under autocast and its bucket copy;
    DeepSpeed's 16-bit weights with fp32 masters; FSDP2's fp32 shards) without the padding and
    partition-boundary terms, which need the parameters' sizes."""
    params, grads, states, buffers = spec.unpadded(psi, world_size, ELEMENT_BYTES[precision])
    return {"param_bytes": params, "grad_bytes_after_backward": grads, "optimizer_state_bytes": states,
            "comm_buffer_bytes_after_backward": buffers, "retained_total_bytes": params + states + buffers}


def paper_unit(entries: dict) -> tuple[float, str, str]:
    """The ZeRO paper's model states in its kind of unit (it quotes GB, 10^9 bytes): a decimal unit for
    the table (MB, GB, TB, PB, ...), its label, and what it is in words."""
    from zerolens.report.tables import unit_for
    from zerolens.units import DECIMAL_UNITS
    unit, label = unit_for([e["paper_model_states_bytes"] for e in entries.values()], DECIMAL_UNITS)
    if label == "GB":
        return unit, label, "GB (10^9 bytes), the paper's unit"
    return unit, label, f"{label} (10^{len(str(int(unit))) - 1} bytes; the paper quotes GB)"


def render_estimate(result: dict) -> list:
    """The estimate for the terminal (rich renderables), one unit per table; --json has every figure."""
    from zerolens.report.tables import in_unit, terminal_table, unit_for
    n, psi = result["world_size"], result["params"]
    lines = [f"zerolens estimate: {psi:,.0f} parameters, {n} ranks, {result['precision']}"]
    entries = result["strategies"]
    paper, paper_label, paper_words = paper_unit(entries)
    if next(iter(entries.values()))["ranks"] is None:
        keys = ("param_bytes", "grad_bytes_after_backward", "optimizer_state_bytes", "comm_buffer_bytes_after_backward",
                "retained_total_bytes")
        unit, label = unit_for([e["components"][k] for e in entries.values() for k in keys]
                               + [e["paper_model_states_bytes"] for e in entries.values()])
        rows = [[name, *(in_unit(e["components"][k], unit, 2) for k in keys),
                 in_unit(e["paper_model_states_bytes"], unit, 2), in_unit(e["paper_model_states_bytes"], paper, 2),
                 in_unit(e["deepspeed_estimator_bytes"], unit, 2)] for name, e in entries.items()]
        return lines + [
            f"Per rank, {label} (1024-based), from the parameter count alone: each strategy's layout without the "
            "padding and partition-boundary terms, which need the parameters' sizes (--preset or --model). "
            f"The ZeRO paper's model states (16-bit, K = 12) also in {paper_words}. "
            "Activations are not included.",
            terminal_table(["strategy", "params", "grads", "optimizer", "buffers", "kept total", "paper",
                            f"paper {paper_label}", "DeepSpeed"], rows, right=set(range(1, 9))),
            *filter(None, [bucket_note(result)])]
    keys = ("param_bytes", "grad_bytes_after_backward", "optimizer_state_bytes", "comm_buffer_bytes_after_backward",
            "transient_reduce_bucket_bytes", "retained_total_bytes")
    cuda = result["device"] == "cuda"
    setting, unmodelled = allocator_setting()
    shown = []
    for name, e in entries.items():
        ranks = e["ranks"]
        largest = max(ranks, key=lambda r: (r["grad_bytes_after_backward"], -r["rank"]))
        # On CUDA, whether the job fits is the neediest rank's question
        needy = [r for r in ranks if needs(r, setting) is not None] if cuda else []
        neediest = max(needy, key=lambda r: (needs(r, setting), -r["rank"])) if needy else ranks[0]
        picked = [ranks[0]]
        for r in (largest, neediest):
            if all(r is not p for p in picked):
                picked.append(r)
        shown += [(name, e, r) for r in picked]
    unit, label = unit_for([r[k] for _, _, r in shown for k in keys] + [r.get("peak_bytes") for _, _, r in shown]
                           + [e["paper_model_states_bytes"] for e in entries.values()])
    rows = [[name, r["rank"], *(in_unit(r[k], unit, 2) for k in keys), in_unit(r.get("peak_bytes"), unit, 2),
             *([in_unit(needs(r, setting), unit, 2)] if cuda else []),
             in_unit(e["paper_model_states_bytes"], unit, 2), in_unit(e["paper_model_states_bytes"], paper, 2),
             in_unit(e["deepspeed_estimator_bytes"], unit, 2)] for name, e, r in shown]
    where = ("on the CPU" if not cuda else
             f"on CUDA (compute capability {result['cuda_capability']}'s cuBLAS workspaces included)"
             + trace_caveat(result["traced_on"]))
    needs_text = ("; \"needs\": the GPU memory the rank needs to run, the smallest cap the caching allocator "
                  f"runs the trace's allocations under ({setting.replace('_', ' ')}{unmodelled}) plus what the "
                  f"process holds outside it ({outside_allocator_source()})" if cuda else "")
    not_predicted = [f"{name}: {e['peak_not_predicted']}" for name, e in entries.items() if "peak_not_predicted" in e]
    scaled = [name + (f" ({e['depth_scaled_ranks']} of {n} ranks)" if "depth_scaled_ranks" in e else "")
              for name, e in entries.items() if "depth_scaled_from" in e]
    depth_scale = next((e["depth_scaled_from"] for e in entries.values() if "depth_scaled_from" in e), [])
    return lines + [
        f"Per rank, {label} (1024-based), from the real layout (padding, partition boundaries, buckets): rank 0, "
        f"the rank holding the most gradients{' and the rank that needs the most' if cuda else ''}; gradients "
        "right after backward; \"bucket\": the reduce bucket "
        "allocated in backward; \"kept\": everything held between steps; \"peak\": the highest allocated in a "
        f"training step, activations and temporaries included, for {result['micro_batch']} samples per rank "
        f"{accumulation_words(result.get('grad_accum', 1))} "
        f"{where}{needs_text}. The ZeRO paper's model states also in {paper_words} (--json: every rank "
        "and figure).",
        terminal_table(["strategy", "rank", "params", "grads", "optim", "buffers", "bucket", "kept", "peak",
                        *(["needs"] if cuda else []), "paper", f"paper {paper_label}", "DS est."], rows,
                       right=set(range(1, 13 if cuda else 12))),
        *(f"No peak for {line}." for line in not_predicted),
        *([f"{', '.join(scaled)}: traced at {', '.join(map(str, depth_scale))} blocks and scaled to the model's "
           "depth, every allocation checked on the deepest of them (docs/method.md)."] if scaled else []),
        *(f"{name}: traced at the model's depth{' for the other ranks' if 'depth_scaled_ranks' in e else ''}, not "
          f"scaled from shallow traces ({e['why_not_depth_scaled']})." for name, e in entries.items()
          if "why_not_depth_scaled" in e),
        *(f"No \"needs\" for {name} rank {r['rank']}: {r['allocator_not_replayed']}." for name, _, r in shown
          if "allocator_not_replayed" in r),
        *filter(None, [bucket_note(result)])]


def bucket_note(result: dict) -> str | None:
    """The case study's pitfall, as verify says it (report.summary.bucket_notes): a reduce bucket larger
    than all the gradients, which makes the strategies that allocate one need more than those that
    do not; their highest peaks beside the baseline's where the peaks were predicted."""
    from zerolens.report.summary import advised_bucket
    from zerolens.units import size
    advised = advised_bucket(result["reduce_bucket_size"], result["trained_params"], result["world_size"])
    entries = result["strategies"]
    with_bucket = [name for name in entries if registry.spec(name).reduce_bucket is not None]
    if advised is None or not with_bucket:
        return None
    element = ELEMENT_BYTES[result["precision"]]
    bucket, grads = result["reduce_bucket_size"] * element, result["trained_params"] * element

    def peak(name: str) -> int | None:
        peaks = [r.get("peak_bytes") for r in entries[name]["ranks"] or []]
        return max(peaks) if peaks and None not in peaks else None
    base = next((name for name in entries if registry.spec(name).reduce_bucket is None and peak(name)), None)
    peaks = "" if base is None or None in map(peak, with_bucket) else (
        f"; peak {', '.join(f'{size(peak(name))} under {name}' for name in with_bucket)}, against "
        f"{size(peak(base))} under {base}")
    return (f"{', '.join(with_bucket)}: the reduce bucket, {result['reduce_bucket_size']:.3g} elements "
            f"({size(bucket)} in {result['precision']}), outweighs all {size(grads)} of this model's gradients"
            f"{peaks}. Try --reduce-bucket-size {advised:.0e}: at most one rank's share of the gradients.")


def needs(rank: dict, setting: str) -> int | None:
    """The GPU memory a rank needs under an allocator setting: its smallest cap plus what is outside it."""
    if "min_allocator_cap_bytes" not in rank:
        return None
    return rank["min_allocator_cap_bytes"][setting] + rank["outside_allocator_bytes"]


# --- The command line ------------------------------------------------------------------------------

def add_parser(subparsers) -> None:
    p = subparsers.add_parser("estimate", help="predict per-rank memory without training or GPUs",
                              description="Per-rank memory by component for each strategy, from the parameter "
                                          "sizes alone: a built-in preset, your model, or a raw count.")
    source = p.add_mutually_exclusive_group()
    # A metavar: argparse prints a mutually exclusive group on one usage line, which the choices made too long.
    source.add_argument("--preset", choices=sorted(PRESETS), default="case-study", metavar="PRESET",
                        help=f"a built-in model: {', '.join(sorted(PRESETS))} (default case-study)")
    source.add_argument("--model", metavar="MODULE:FACTORY",
                        help="a function returning your nn.Module; it is built on the meta device")
    source.add_argument("--params", type=float, help="a raw parameter count, e.g. 7.5e9 (the paper's formulas)")
    p.add_argument("--strategies", default=",".join(registry.names()))
    p.add_argument("--nproc", type=int, default=2, help="data-parallel ranks (default 2)")
    p.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default=None,
                   help="default: what verify runs on GPUs (fp16 for case-study, bf16 for the other presets and "
                        "your model; fp16 with --params, the ZeRO paper's)")
    p.add_argument("--reduce-bucket-size", type=float, default=5e7)
    p.add_argument("--batch", metavar="MODULE:FUNCTION",
                   help="with --model: how zerolens makes a batch (as for verify); needed to predict the peaks")
    p.add_argument("--micro-batch", type=int, default=8, help="samples per rank per step (default 8)")
    p.add_argument("--grad-accum", type=int, default=1, metavar="K",
                   help="gradient accumulation: K micro-batches per optimizer step (default 1)")
    p.add_argument("--width", type=int, default=None, help="override the preset's model width (d_model)")
    p.add_argument("--depth", type=int, default=None,
                   help="override the preset's (or a Hugging Face model's) number of layers")
    p.add_argument("--heads", type=int, default=None, help="override the preset's attention heads")
    p.add_argument("--seq-len", type=int, default=None, help="a preset's (or a Hugging Face model's) sequence length")
    p.add_argument("--activation-checkpointing", action="store_true", help="GPT presets: checkpoint each block")
    p.add_argument("--fused-adam", action="store_true",
                   help="torch's fused AdamW kernel for every strategy, as verify's --fused-adam (the step's peak "
                        "differs: foreach AdamW's temporaries)")
    p.add_argument("--gradient-clipping", type=float, default=1.0,
                   help="as verify's: 0 turns clipping off, and with it the step's norm temporaries")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="what the peaks are predicted for (default cuda: the visible GPU's cuBLAS workspaces, "
                        "else compute capability 9.0's)")
    p.add_argument("--jobs", type=int, default=None,
                   help="processes predicting the strategies' peaks in parallel (default: cores, at most 4, for a "
                        "model of 1e9 parameters or more; 1 below, where starting them costs more than they save)")
    p.add_argument("--json", action="store_true", help="print JSON (bytes) instead of a table")
    p.set_defaults(func=command, compile=False)


def estimate_model(args: argparse.Namespace):
    """The model whose step estimate traces for the peaks: a preset (with --seq-len or
    --activation-checkpointing), a Hugging Face model (--model hf:...), or --model with --batch;
    None for --params or --model alone."""
    if args.params is not None or (args.model and not args.batch and not args.model.startswith("hf:")):
        return None
    return model_from_args(args)


def accumulation_words(grad_accum: int) -> str:
    if grad_accum == 1:
        return "in one micro-batch per optimizer step (--grad-accum for gradient accumulation)"
    return (f"in each of {grad_accum} micro-batches per optimizer step (gradient accumulation: the peak is the "
            "highest over them)")


def command(args: argparse.Namespace, argv: list[str]) -> int:
    strategies = parse_strategies(args.strategies)
    if args.nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {args.nproc}")
    if args.params is not None and not (math.isfinite(args.params) and args.params >= 1):
        raise UserError(f"--params must be a positive, finite parameter count, got {args.params}")
    bucket_elements(args.reduce_bucket_size)
    if args.micro_batch < 1:
        raise UserError(f"--micro-batch must be at least 1, got {args.micro_batch}")
    if args.grad_accum < 1:
        raise UserError(f"--grad-accum must be at least 1, got {args.grad_accum}")
    if args.jobs is not None and args.jobs < 1:
        raise UserError(f"--jobs must be at least 1, got {args.jobs}")
    if args.params is not None and (args.batch or args.seq_len or args.activation_checkpointing or
                                    any(v is not None for v in (args.width, args.depth, args.heads))):
        raise UserError("--batch/--width/--depth/--heads/--seq-len/--activation-checkpointing need a model "
                        "(--preset or --model), not --params")
    if not (math.isfinite(args.gradient_clipping) and args.gradient_clipping >= 0):
        raise UserError(f"--gradient-clipping must be 0 (off) or a positive norm, got {args.gradient_clipping}")
    if args.batch and not args.model:
        raise UserError("--batch goes with --model")
    model_config = estimate_model(args)
    try:  # the model once, on the meta device: its shapes, its weights' dtype, what trains
        model = (None if args.params is not None else
                 meta_model(model_config) if model_config is not None else factory_meta_model(args.model))
    except ValueError as e:
        raise UserError(str(e)) from None
    except Exception as e:  # the user's factory: whatever it raises is theirs to fix, said in one line (as verify)
        if model_config is not None and model_config.kind != "user":
            raise
        raise UserError(f"--model: {type(e).__name__}: {one_line_error(e)}") from None
    # parameters() yields a tied weight once
    shapes = None if model is None else [tuple(p.shape) for p in model.parameters()]
    weights = 4 if model is None else weight_bytes_of(model)
    trainable = None if model is None else [p.requires_grad for p in model.parameters()]
    if weights is None:
        raise UserError(MIXED_WEIGHTS.format(model=args.model))
    if model_config is not None and model_config.kind == "user":  # a model and batch that break it: as verify
        from zerolens.run.validate import check_user_model
        check_user_model(model_config, args.micro_batch, seed=0)
    if args.device == "cpu" and args.precision == "fp16":
        raise UserError("fp16 is not supported on CPU (DeepSpeed's CPU accelerator has no fp16): use --precision bf16 "
                        "or fp32, or --device cuda")
    try:
        # As verify: the paper's fp16 for a count, a preset's GPU precision on CUDA, bf16 on CPU.
        precision = args.precision or ("fp16" if args.params is not None else "bf16" if args.device == "cpu" else
                                       PRESET_GPU_PRECISION.get(None if args.model else args.preset, "bf16"))
        check_weights_and_precision(weights, precision, args.model)
        if model_config is not None:  # a model that cannot run under some of them: as verify
            from zerolens.run.validate import check_running_statistics
            check_running_statistics(model_config, strategies, precision)
        started = time.perf_counter()
        result = estimate(strategies=strategies, world_size=args.nproc, precision=precision,
                          reduce_bucket_size=int(args.reduce_bucket_size), param_shapes=shapes, params=args.params,
                          model_config=model_config, micro_batch=args.micro_batch, grad_accum=args.grad_accum,
                          cuda_capability=target_capability(args.device), fused_adam=args.fused_adam,
                          gradient_clipping=args.gradient_clipping, weight_bytes=weights, trainable=trainable,
                          jobs=args.jobs or (default_jobs() if shapes and sum(map(math.prod, shapes)) >= 1e9 else 1))
    except ValueError as e:  # e.g. a model FSDP2 cannot shard
        raise UserError(str(e)) from None
    result["seconds"] = round(time.perf_counter() - started, 1)  # how long the prediction took
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        say(*render_estimate(result), f"Predicted in {result['seconds']:.1f} s.")
    return 0
