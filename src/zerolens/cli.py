"""The `zerolens` command. One small function per command; user errors exit 2 in one line."""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from dataclasses import replace

from . import __version__
from .config import (PRESET_GPU_PRECISION, UserError, add_bench_arguments, add_verify_arguments, check_config,
                     config_from_args, deepspeed_zero_setting, micro_batch_of, model_from_args, parse_strategies)
from .estimate import estimate, param_shapes_from_factory, render_estimate
from .model import PRESETS, parameter_shapes
from .strategies import registry
from .tables import say
from .jobs import run_folder, run_in_new_folder


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own usage dump is long; one line, exit 2
        self.exit(2, f"zerolens: {message} (see {self.prog} --help)\n")


def verify_parser(subparsers) -> None:
    p = subparsers.add_parser("verify", help="run the case study's ZeRO-2 experiment correctly and check it",
                              description="Train the case study's model under each strategy on N ranks, "
                                          "measure per-rank memory, and check ZeRO's claims.")
    add_verify_arguments(p)
    p.set_defaults(func=verify_command)


def verify_command(args: argparse.Namespace, argv: list[str]) -> int:
    config = config_from_args(args)
    summary = run_in_new_folder(config, command=shlex.join(["zerolens", *argv]), overwrite=args.overwrite)
    return 0 if summary is not None and summary["verdict"] == "PASS" else 1


def bench_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="step time, tokens/s, MFU and peak memory of each strategy vs DDP",
                              description="Train each strategy on the same model and data; time the steps after "
                                          "a warm-up and report throughput, MFU and peak memory, with ratios to DDP.")
    add_verify_arguments(p)
    add_bench_arguments(p)
    p.set_defaults(func=bench_command, job="bench", steps=10, strategies=",".join(registry.BENCH_DEFAULT),
                   preset="gpt-100m")


def bench_command(args: argparse.Namespace, argv: list[str]) -> int:
    if args.baseline is not None:
        raise UserError(f"bench compares every strategy with {registry.BENCH_REFERENCE}; --baseline is for verify")
    config = config_from_args(args)
    return 0 if run_in_new_folder(config, shlex.join(["zerolens", *argv]), args.overwrite) is not None else 1


def maxsize_parser(subparsers) -> None:
    p = subparsers.add_parser("maxsize", help="the deepest model of a preset's width each strategy can train (GPU)",
                              description="For each strategy, search the largest --depth of the preset that trains "
                                          "without running out of GPU memory: short bench runs, one per depth tried.")
    add_verify_arguments(p)
    add_bench_arguments(p)
    p.set_defaults(func=maxsize_command, job="bench", strategies=",".join(registry.BENCH_DEFAULT), preset="gpt-1b")


def maxsize_command(args: argparse.Namespace, argv: list[str]) -> int:
    from .maxsize import run_maxsize
    if args.model:
        raise UserError("maxsize searches the depth of a preset; --model is for verify, bench and sweep")
    config = config_from_args(args)
    if config.device != "cuda":
        raise UserError("maxsize needs GPUs: on the CPU nothing runs out of memory (use --device cuda)")
    return run_maxsize(config, run_folder(config, args.overwrite), command=shlex.join(["zerolens", *argv]))


def sweep_parser(subparsers) -> None:
    p = subparsers.add_parser("sweep", help="verify over several world sizes and bucket sizes; table and plots",
                              description="Run verify for every world size in --nproc-list and every "
                                          "--reduce-bucket-sizes value, then tabulate and plot per-rank memory.")
    add_verify_arguments(p)
    p.add_argument("--nproc-list", default="1,2", help="comma-separated world sizes (default 1,2)")
    p.add_argument("--presets", default=None,
                   help=f"comma-separated models, from {','.join(PRESETS)} (default: --preset)")
    p.add_argument("--reduce-bucket-sizes", default=None,
                   help="comma-separated DeepSpeed reduce_bucket_size values (default: --reduce-bucket-size)")
    p.set_defaults(func=sweep_command)


def int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(float(v)) for v in text.split(",") if v.strip()]
    except (ValueError, OverflowError):  # OverflowError: "inf"
        raise UserError(f"{flag} takes finite numbers (comma-separated for several), got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise UserError(f"{flag} needs positive values, got {text!r}")
    return values


def sweep_command(args: argparse.Namespace, argv: list[str]) -> int:
    from .sweep import run_sweep
    if args.nproc is not None:
        raise UserError("sweep takes its world sizes from --nproc-list, not --nproc")
    ns = int_list(args.nproc_list, "--nproc-list")
    buckets = int_list(args.reduce_bucket_sizes or str(args.reduce_bucket_size), "--reduce-bucket-sizes"
                       if args.reduce_bucket_sizes else "--reduce-bucket-size")
    if args.model and args.presets:
        raise UserError("--presets and --model: a sweep runs presets or your model, not both")
    presets = [p.strip() for p in args.presets.split(",") if p.strip()] if args.presets else [args.preset]
    unknown = [p for p in presets if p not in PRESETS]
    if unknown or not presets:
        raise UserError(f"--presets: unknown model {unknown[0] if unknown else '(none)'}; choose from {', '.join(PRESETS)}")
    # One config per model (a preset brings its own defaults), its points derived from it; every point
    # is checked before the first one runs, and before anything is written.
    points = []
    for preset in presets:
        base = config_from_args(argparse.Namespace(**{**vars(args), "preset": preset, "nproc": ns[0]}), checked=True)
        for n in ns:
            for bucket in buckets:
                points.append(replace(base, nproc=n, micro_batch=micro_batch_of(args, n), reduce_bucket_size=bucket))
    for point in points:
        check_config(point, gpus_visible=torch_gpus())
    out = run_folder(points[0], args.overwrite)
    points = [replace(p, out=str(out / (f"n{p.nproc}-bucket{p.reduce_bucket_size}"
                                        + (f"-{p.preset}" if len(presets) > 1 else "")))) for p in points]
    return run_sweep(points, out, command=shlex.join(["zerolens", *argv]))


def torch_gpus() -> int:
    import torch
    return torch.cuda.device_count()


def estimate_parser(subparsers) -> None:
    p = subparsers.add_parser("estimate", help="predict per-rank memory without training or GPUs",
                              description="Per-rank memory by component for each strategy, from the parameter "
                                          "sizes alone: a built-in preset, your model, or a raw count.")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=sorted(PRESETS), default="case-study")
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
    p.add_argument("--json", action="store_true", help="print JSON (bytes) instead of a table")
    p.set_defaults(func=estimate_command, compile=False)


def estimate_model(args: argparse.Namespace):
    """The model whose step estimate traces for the peaks: a preset (with --seq-len or
    --activation-checkpointing), a Hugging Face model (--model hf:...), or --model with --batch;
    None for --params or --model alone."""
    if args.params is not None or (args.model and not args.batch and not args.model.startswith("hf:")):
        return None
    return model_from_args(args)


def target_capability(device: str) -> tuple[int, int] | None:
    """The CUDA compute capability the peaks are predicted for: the visible GPU's, else 9.0."""
    if device == "cpu":
        return None
    import torch
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)


def estimate_command(args: argparse.Namespace, argv: list[str]) -> int:
    strategies = parse_strategies(args.strategies)
    if args.nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {args.nproc}")
    if args.params is not None and not (math.isfinite(args.params) and args.params >= 1):
        raise UserError(f"--params must be a positive, finite parameter count, got {args.params}")
    if not (math.isfinite(args.reduce_bucket_size) and args.reduce_bucket_size >= 1):
        raise UserError(f"--reduce-bucket-size must be at least 1 element, got {args.reduce_bucket_size}")
    if args.micro_batch < 1:
        raise UserError(f"--micro-batch must be at least 1, got {args.micro_batch}")
    if args.params is not None and (args.batch or args.seq_len or args.activation_checkpointing or
                                    any(v is not None for v in (args.width, args.depth, args.heads))):
        raise UserError("--batch/--width/--depth/--heads/--seq-len/--activation-checkpointing need a model "
                        "(--preset or --model), not --params")
    if not (math.isfinite(args.gradient_clipping) and args.gradient_clipping >= 0):
        raise UserError(f"--gradient-clipping must be 0 (off) or a positive norm, got {args.gradient_clipping}")
    if args.batch and not args.model:
        raise UserError("--batch goes with --model")
    model_config = estimate_model(args)
    try:
        shapes = (None if args.params is not None else
                  [tuple(s) for s in parameter_shapes(model_config)] if model_config is not None else
                  param_shapes_from_factory(args.model))
    except ValueError as e:
        raise UserError(str(e)) from None
    if args.device == "cpu" and args.precision == "fp16":
        raise UserError("fp16 is not supported on CPU (DeepSpeed's CPU accelerator has no fp16): use --precision bf16 "
                        "or fp32, or --device cuda")
    try:
        # As verify: the paper's fp16 for a count, a preset's GPU precision on CUDA, bf16 on CPU.
        precision = args.precision or ("fp16" if args.params is not None else "bf16" if args.device == "cpu" else
                                       PRESET_GPU_PRECISION.get(None if args.model else args.preset, "bf16"))
        result = estimate(strategies=strategies, world_size=args.nproc, precision=precision,
                          reduce_bucket_size=int(args.reduce_bucket_size), param_shapes=shapes, params=args.params,
                          model_config=model_config, micro_batch=args.micro_batch,
                          cuda_capability=target_capability(args.device), fused_adam=args.fused_adam,
                          gradient_clipping=args.gradient_clipping)
    except ValueError as e:  # e.g. a model FSDP2 cannot shard
        raise UserError(str(e)) from None
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        say(*render_estimate(result))
    return 0


def plan_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help="which configurations fit a GPU's memory, predicted before training",
                              description="Predict each rank's peak for every strategy, micro-batch, activation "
                                          "checkpointing and bucket size; list what fits --gpu-memory, cheapest "
                                          "first, and the deepest model of the preset's width each strategy can "
                                          "train there. No GPU is used, except by --check.")
    add_verify_arguments(p)
    p.add_argument("--gpu-memory", required=True, metavar="SIZE",
                   help="what the caching allocator may hold per GPU: 80GiB, 81920MiB, 80GB (10^9 bytes); "
                        "a plain number is GiB")
    p.add_argument("--micro-batches", default="1,2,4,8,16,32,64",
                   help="micro-batches per rank to try (default 1,2,4,8,16,32,64; each from the smallest until "
                        "one does not fit)")
    p.add_argument("--reduce-bucket-sizes", default=None,
                   help="comma-separated bucket sizes for the strategies that have one (default: --reduce-bucket-size)")
    p.add_argument("--top", type=int, default=15, help="configurations shown (default 15; --json has all)")
    p.add_argument("--no-depth", action="store_true", help="skip the search for the deepest model")
    p.add_argument("--jobs", type=int, default=None, help="processes tracing in parallel (default: cores, at most 4)")
    p.add_argument("--check", type=int, nargs="?", const=3, default=0, metavar="K",
                   help="run short benches of the K cheapest fitting configurations (default 3) on this "
                        "machine's GPUs, capped at --gpu-memory, to confirm they fit and time them")
    p.add_argument("--json", action="store_true", help="print JSON (bytes) instead of tables")
    p.set_defaults(func=plan_command, device="cuda", strategies=",".join(registry.names()), preset="gpt-1b")


def plan_command(args: argparse.Namespace, argv: list[str]) -> int:
    from . import plan
    from .report import write_json
    if args.device != "cuda":
        raise UserError("plan predicts what fits on GPUs (--device cuda); on the CPU nothing runs out of memory")
    memory = plan.parse_memory(args.gpu_memory)
    micro_batches = plan.check_micro_batches(args.micro_batches)
    if args.top < 1 or (args.jobs is not None and args.jobs < 1) or args.check < 0:
        raise UserError("--top and --jobs must be at least 1, --check at least 0")
    gpus = torch_gpus() if args.check else None
    config = config_from_args(args, gpus_visible=gpus if args.check else 0, checked=True)
    # A DeepSpeed config of the user's own that sets reduce_bucket_size decides it (config.py,
    # deepspeed_zero_setting): the grid has that one size.
    ds_bucket = deepspeed_zero_setting(config.ds_config, config.ds_override, "reduce_bucket_size", 0) or None
    if ds_bucket and args.reduce_bucket_sizes:
        raise UserError("--reduce-bucket-sizes: the DeepSpeed config (--ds-config/--ds-override) sets "
                        f"reduce_bucket_size {ds_bucket}, which DeepSpeed would use; plan with that one size")
    buckets = plan.finite_bucket_sizes(args.reduce_bucket_sizes or str(ds_bucket or args.reduce_bucket_size))
    if args.check and gpus < config.nproc:
        raise UserError(f"--check runs the candidates on {config.nproc} GPUs, but {gpus} are visible; plan without "
                        "--check, or on the machine that will train")
    check_config(config, gpus_visible=gpus, running=bool(args.check))
    out = run_folder(config, args.overwrite) if args.check else None
    command = shlex.join(["zerolens", *argv])

    def progress(line: str) -> None:
        if not args.json:
            say(f"zerolens plan: {line}", stderr=True)
    result = plan.plan(config, memory=memory, micro_batches=micro_batches, reduce_bucket_sizes=buckets,
                       cuda_capability=target_capability("cuda"), jobs=args.jobs or plan.default_jobs(),
                       depth_search=not args.no_depth and config.model.kind != "user", progress=progress)
    result["command"] = command
    if args.check:
        result["checked"] = plan.check_candidates(config, result, args.check, out, command, progress)
        write_json(out / "plan.json", result)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    say(*plan.render_plan(result, args.top), *(plan.render_checks(result["checked"]) if args.check else []),
        *([f"plan.json: {out / 'plan.json'}"] if out else []))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        registry.load_plugins()  # before the parser: its defaults and help name the strategies
    except UserError as e:
        print(f"zerolens: {e}", file=sys.stderr)
        return 2
    parser = ArgumentParser(prog="zerolens", description="What data-parallel sharding does to training memory.")
    parser.add_argument("--version", action="version", version=f"zerolens {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    verify_parser(subparsers)
    bench_parser(subparsers)
    maxsize_parser(subparsers)
    sweep_parser(subparsers)
    estimate_parser(subparsers)
    plan_parser(subparsers)
    args = parser.parse_args(argv)
    try:
        return args.func(args, argv)
    except UserError as e:
        print(f"zerolens: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("zerolens: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `zerolens estimate | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
