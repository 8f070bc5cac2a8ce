"""Flags to a RunConfig: the command line's arguments, resolved once against the machine (how
many GPUs, which precision, which model) and checked (validate.check_config) unless a launcher
already did. Under torchrun or deepspeed, a worker resolves its own flags the same way."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch

from zerolens.errors import UserError, users_code
from zerolens.models.hf import PREFIX as HF_PREFIX
from zerolens.models.hf import model_config_fields
from zerolens.models.model import PRESETS, ModelConfig, load_user_function, returns_causal_lm
from zerolens.run.config import RunConfig
from zerolens.run.deepspeed_config import deepspeed_zero_setting, ds_config_from_file, ds_override_from_json
from zerolens.run.validate import check_config
from zerolens.strategies import registry
from zerolens.strategies.layout import STAGE3_PERSISTENCE_THRESHOLD

# AdamW's learning rate per preset. 1e-4 is the case study's. At width 1024 without warm-up it
# pushed the loss from 2.8 to 6 within ten steps on 2xH200 (fp16), and the strategies' losses
# then diverged; 1e-5 keeps the 130m preset stable.
# The GPT presets use GPT-2-like rates, lower for the larger ones (no warm-up here).
PRESET_LR = {"case-study": 1e-4, "case-study-130m": 1e-5, "gpt-tiny": 1e-3, "gpt-100m": 3e-4, "gpt-350m": 2e-4,
             "gpt-1b": 2e-4}

# Precision on GPU per preset: the case study's fp16, and bf16 for the larger model, where fp16's
# dynamic loss scaling skipped different early steps under DDP, DeepSpeed without ZeRO and ZeRO,
# so their losses parted by up to 0.7 (2xH200).
PRESET_GPU_PRECISION = {"case-study": "fp16", "case-study-130m": "bf16", "gpt-tiny": "bf16", "gpt-100m": "bf16",
                        "gpt-350m": "bf16", "gpt-1b": "bf16"}


DEFAULT_REDUCE_BUCKET = 5e7  # elements: the case study's


def parse_strategies(text: str) -> tuple[str, ...]:
    """`--strategies` as a tuple of known names."""
    strategies = tuple(s.strip() for s in text.split(","))
    if not any(strategies):
        raise UserError("--strategies is empty")
    if "" in strategies:
        raise UserError(f"--strategies {text!r} has an empty name between its commas")
    unknown = [s for s in strategies if s not in registry.names()]
    if unknown:
        raise UserError(f"unknown strategy {unknown[0]!r}; choose from {', '.join(registry.names())}")
    return strategies


# Samples per rank per micro-batch; bench's on GPUs for a GPT preset: gpt-1b's matrix products run
# nearer the GPU's rate as it grows (plain loops, fused AdamW, compiled blocks: MFU 49.0% at 8 and 52.9%
# at 16 on one H200, docs/results/1xh200/issue25/run4; with the loss compiled too, 48.3% at 16, 50.3% at
# 24 and 50.9% at 32 on one H100, docs/results/1xh100/issue25/run10). At 32 gpt-1b's DDP peaks at
# 61.0 GiB allocated (61.7 GiB reserved) on one GPU: a GPU of 80 GB or more; --micro-batch 16 (38.5 GiB)
# for smaller ones.
MICRO_BATCH = 8
BENCH_GPU_MICRO_BATCH = 32

# The flags of a training run only, which a command that trains nothing takes from their defaults.
TRAINING_ONLY = {"lr": None, "steps": 100, "seed": 0, "timeout": 900, "grad_accum": 1}


def add_verify_arguments(parser: argparse.ArgumentParser, *, trains: bool = True,
                         preset_default: str = "%(default)s") -> None:
    """verify's flags, which every command shares; `trains=False` (plan) leaves out those of a training
    run alone (TRAINING_ONLY), so that its --help does not offer them. `preset_default`: the default
    model as --help says it (bench's depends on the device)."""
    parser.add_argument("--strategies", default=",".join(registry.VERIFY_DEFAULT),
                        help=f"comma-separated, from {','.join(registry.names())} (default: %(default)s)")
    parser.add_argument("--baseline", default=None,
                        help=f"the strategy the others are compared with (default: {registry.BASELINE} if listed, "
                             "else the first)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="number of ranks (default: the number of GPUs when there are at least 2, else 2)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda when at least 2 GPUs are visible, else cpu")
    parser.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default=None,
                        help="default: bf16 on cpu; on cuda fp16 for case-study (the case study's), else bf16")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="case-study",
                        help=f"the model (default: {preset_default}; case-study is the demo's 0.53M-parameter "
                             "Transformer)")
    parser.add_argument("--model", default=None, metavar="MODULE:FACTORY",
                        help="your nn.Module instead of a preset: a function returning it (built on the CPU, fp32); "
                             "needs --batch")
    parser.add_argument("--batch", default=None, metavar="MODULE:FUNCTION",
                        help="with --model: function(step, batch_size, seed) -> (inputs, integer targets), the "
                             "global batch of a step; the model's output are logits compared with the targets")
    parser.add_argument("--width", type=int, default=None, help="override the preset's model width (d_model)")
    parser.add_argument("--depth", type=int, default=None, help="override the preset's number of layers")
    parser.add_argument("--heads", type=int, default=None, help="override the preset's attention heads")
    parser.add_argument("--seq-len", type=int, default=None, help="override the preset's sequence length")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="GPT presets: recompute each block in backward instead of keeping its activations")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="GPT presets: torch.compile each block (faster steps after a compile of about a minute; "
                             "default: on in bench on GPUs, else off)")
    if trains:
        parser.add_argument("--lr", type=float, default=None,
                            help="AdamW learning rate (default: the preset's, 1e-4 for case-study)")
        parser.add_argument("--steps", type=int, default=100)
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--grad-accum", type=int, default=1, metavar="K",
                            help="gradient accumulation: K micro-batches per rank before each optimizer step "
                                 "(DDP under no_sync, DeepSpeed's gradient_accumulation_steps, FSDP2 reduce-scattering "
                                 "each; default 1)")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help=f"samples per rank per step (default {MICRO_BATCH}; bench on GPUs with a GPT preset: "
                             f"{BENCH_GPU_MICRO_BATCH})")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="samples per optimizer step over all ranks; must be divisible by --nproc x "
                             "--grad-accum (default: micro-batch x nproc x grad-accum)")
    parser.add_argument("--reduce-bucket-size", type=float, default=DEFAULT_REDUCE_BUCKET,
                        help="DeepSpeed reduce_bucket_size in elements (default 5e7, the case study's)")
    parser.add_argument("--gradient-clipping", type=float, default=1.0,
                        help="global gradient-norm clipping for every strategy; 0 turns it off "
                             "(default 1.0, DeepSpeed's own default)")
    parser.add_argument("--fused-adam", action=argparse.BooleanOptionalAction, default=None,
                        help="torch's fused AdamW kernel for every strategy (default: on in bench on GPUs, else "
                             "torch's foreach AdamW)")
    parser.add_argument("--grad-overflow-check", action=argparse.BooleanOptionalAction, default=None,
                        help="DeepSpeed ZeRO-1/2 in bf16: check every gradient for inf and NaN before the optimizer "
                             "step, skipping the step where one is found (bf16.check_grad_overflow; default: off in "
                             "bench on GPUs, as DeepSpeed 0.17.1-0.19.2 have it, else DeepSpeed's own default)")
    parser.add_argument("--ds-config", default=None, metavar="FILE",
                        help="your DeepSpeed JSON config for the zero strategies; \"auto\" values are filled from "
                             "zerolens's settings, the stage comes from the strategy")
    parser.add_argument("--ds-override", default=None, metavar="JSON",
                        help="JSON merged into the DeepSpeed config zerolens writes, e.g. "
                             "'{\"zero_optimization\": {\"overlap_comm\": true}}'")
    parser.add_argument("--out", default=None, help="run folder (default: runs/<timestamp>)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the --out run folder if it exists: only one zerolens made, holding nothing else")
    if trains:
        parser.add_argument("--timeout", type=float, default=900,
                            help="end the run when no rank makes progress for this many seconds (default 900; "
                                 "a rank that stopped answering is named)")
    else:
        parser.set_defaults(**TRAINING_ONLY)
    parser.add_argument("--verbose", action="store_true", help="show DeepSpeed's own logging")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps before the timed ones (default 3)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the GPU's peak dense TFLOP/s at the run's precision, for MFU "
                             "(default: the datasheet figure for H100/H200/A100; none elsewhere)")
    parser.add_argument("--memory-limit-gib", type=float, default=None,
                        help="CUDA: cap the memory each rank's allocator may use, as on a smaller GPU")


def model_from_args(args: argparse.Namespace, compile_blocks: bool | None = None) -> ModelConfig:
    """The preset, with any of --width/--depth/--heads/--seq-len applied (a GPT's MLP stays 4x wide),
    or the user's model, or a Hugging Face one (--model hf:...). `compile_blocks`: --compile as resolved
    (config_from_args), where not the flag itself."""
    if getattr(args, "model", None) and args.model.startswith(HF_PREFIX):
        return hf_model_from_args(args)
    if getattr(args, "model", None):
        return user_model_from_args(args)
    if getattr(args, "batch", None):  # without --model it would feed nothing, and the preset would run instead
        raise UserError("--batch goes with --model module:factory (your own model); a preset makes its own batches")
    model = PRESETS[args.preset]
    changes = {}
    for flag, name, value in (("--width", "d_model", args.width), ("--depth", "num_layers", args.depth),
                              ("--heads", "num_heads", args.heads), ("--seq-len", "seq_len", args.seq_len)):
        if value is not None:
            if value < 1:
                raise UserError(f"{flag} must be at least 1, got {value}")
            changes[name] = value
    if args.activation_checkpointing:
        changes["activation_checkpointing"] = True
    if args.compile if compile_blocks is None else compile_blocks:
        changes["compile_blocks"] = True
    if "d_model" in changes and model.kind == "gpt":
        changes["ffn_dim"] = 4 * changes["d_model"]
    try:
        return dataclasses.replace(model, **changes)
    except ValueError as e:
        raise UserError(f"--preset {args.preset}: {e}") from None


def hf_model_from_args(args: argparse.Namespace) -> ModelConfig:
    """--model hf:<model type or config.json>, with --depth, --seq-len and --activation-checkpointing."""
    if args.batch:
        raise UserError("--batch is for --model module:factory; a Hugging Face model learns zerolens's own "
                        "next-token task")
    if getattr(args, "width", None) is not None or getattr(args, "heads", None) is not None or \
            getattr(args, "compile", False):
        raise UserError("--width/--heads/--compile change a preset; for a Hugging Face model write them into its "
                        "config.json")
    for flag, value in (("--depth", getattr(args, "depth", None)), ("--seq-len", args.seq_len)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}")
    fields = model_config_fields(args.model[len(HF_PREFIX):], depth=getattr(args, "depth", None), seq_len=args.seq_len)
    try:
        return ModelConfig(**fields, activation_checkpointing=args.activation_checkpointing)
    except ValueError as e:
        raise UserError(f"--model {args.model}: {e}") from None


def user_model_from_args(args: argparse.Namespace) -> ModelConfig:
    """--model module:factory with --batch module:function, the factory built on the meta device to tell
    whether it returns a transformers causal LM, whose labels are shifted (check_config runs both)."""
    if not args.batch:
        raise UserError("--model needs --batch module:function: how zerolens makes inputs and targets (README)")
    if any(v is not None for v in (args.width, args.depth, args.heads, args.seq_len)) or args.activation_checkpointing \
            or args.compile:
        raise UserError("--width/--depth/--heads/--seq-len/--activation-checkpointing/--compile change a preset, "
                        "not a --model")
    try:
        load_user_function(args.model)
    except ValueError as e:
        raise UserError(str(e)) from None
    with users_code("--model/--batch"):
        causal_lm = returns_causal_lm(args.model)
    return ModelConfig(kind="user", factory=args.model, batch=args.batch, shift_labels=causal_lm)


def micro_batch_of(args: argparse.Namespace, nproc: int, default: int = MICRO_BATCH) -> int:
    """Samples per rank per micro-batch: --global-batch over the ranks and the micro-batches each
    accumulates (--grad-accum), else --micro-batch, else `default`."""
    if args.global_batch is None:
        return default if args.micro_batch is None else args.micro_batch
    if args.global_batch < 1:
        raise UserError(f"--global-batch must be at least 1, got {args.global_batch}")
    accumulated = max(1, args.grad_accum)  # a --grad-accum below 1 is said by RunConfig
    if args.global_batch % (nproc * accumulated):
        raise UserError(f"--global-batch {args.global_batch} is not divisible by {nproc} processes"
                        + (f" x {accumulated} accumulated micro-batches" if accumulated > 1 else ""))
    return args.global_batch // (nproc * accumulated)


# bench without --preset or --model: a model worth timing on GPUs, and on the CPU one whose steps take a
# fraction of a second (gpt-100m's took 2 minutes for 4 steps of DDP on 2 cores, in 10-15 GB of RAM).
BENCH_PRESET = {"cuda": "gpt-100m", "cpu": "gpt-tiny"}


def config_from_args(args: argparse.Namespace, *, world_size: int | None = None,
                     gpus_visible: int | None = None, checked: bool = False) -> RunConfig:
    """The flags resolved against the machine into a RunConfig, checked (check_config) unless
    `checked`. `world_size` is given when a launcher started us."""
    gpus = visible_gpus() if gpus_visible is None else gpus_visible
    device = args.device or ("cuda" if gpus >= 2 else "cpu")
    if world_size is not None:
        if args.nproc is not None and args.nproc != world_size:
            raise UserError(f"--nproc {args.nproc} disagrees with the launcher's world size {world_size}")
        nproc = world_size
    else:
        nproc = args.nproc if args.nproc is not None else (gpus if device == "cuda" and gpus >= 2 else 2)
    if nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {nproc}")
    device_note = ""
    if args.preset is None:  # bench's default, which depends on the device
        args.preset = BENCH_PRESET[device]
        if device == "cpu" and not args.model:
            device_note = (f"bench's model on the CPU: {args.preset} (on GPUs {BENCH_PRESET['cuda']}); "
                           "--preset for another")
    if args.device is None and gpus == 1:
        # Said without a rank count: sweep's points share it, each with its own.
        device_note = ("1 GPU visible: running on CPU processes (gloo), because without --device zerolens takes "
                       "GPUs only when there are 2 or more (ZeRO shards over at least 2 ranks, and NCCL needs a GPU "
                       "for each); for a single-rank measurement on the GPU, add --nproc 1 --device cuda")
    elif device == "cpu" and world_size is None and nproc > (os.cpu_count() or nproc):
        # Not an error: the figures are the same, only slower; but a user waiting should know why.
        device_note = (f"{nproc} CPU processes on {os.cpu_count()} cores: they take turns, so steps are slower than "
                       "on as many cores; the memory figures are the same")
    # bench's defaults on GPUs are what fast training runs (issue 25): fused AdamW, and a GPT preset's
    # blocks and loss compiled at micro-batch 32 (BENCH_GPU_MICRO_BATCH); --no-fused-adam / --no-compile
    # for torch's defaults. Elsewhere (and in maxsize, whose trials are two steps) they are off: verify's
    # figures are measured with foreach AdamW, and a compiled model's peak is not predicted.
    fast = getattr(args, "speed_defaults", job_of(args) == "bench") and device == "cuda"
    gpt_preset = not args.model and PRESETS[args.preset].kind == "gpt"
    fused_adam = fast if args.fused_adam is None else args.fused_adam
    compile_blocks = fast and gpt_preset and gpu_compiler() if args.compile is None else args.compile
    strategies = parse_strategies(args.strategies)
    baseline = args.baseline or registry.default_baseline(strategies)
    precision, note = args.precision, ""
    if precision is None:
        # A user's model: bf16 on GPU, which needs no loss scaling. On CPU bf16 (DeepSpeed has no fp16 there).
        gpu_precision = PRESET_GPU_PRECISION.get(None if args.model else args.preset, "bf16")
        precision = gpu_precision if device == "cuda" else "bf16"
        if precision != gpu_precision:  # said only where a GPU run would differ
            model = "the case study" if args.preset == "case-study" else args.preset
            note = (f"CPU run: DeepSpeed has no {gpu_precision} on CPU, so bf16 is used instead of {model}'s "
                    f"{gpu_precision}" if registry.needing_deepspeed(strategies) else
                    f"CPU run: bf16 is used, where a GPU run of {model} trains in {gpu_precision}")
    job = job_of(args)
    # verify has no warm-up; bench's default is 3 untimed steps.
    warmup = 0 if job == "verify" else (args.warmup if args.warmup is not None else 3)
    micro_batch = micro_batch_of(args, nproc,
                                 default=BENCH_GPU_MICRO_BATCH if fast and gpt_preset else MICRO_BATCH)
    ds_config, ds_override = ds_config_from_file(args.ds_config), ds_override_from_json(args.ds_override)
    grad_overflow_check = resolved_grad_overflow_check(args.grad_overflow_check, fast, precision, ds_config,
                                                       ds_override, strategies)
    reduce_bucket_size = deepspeed_zero_setting(ds_config, ds_override, "reduce_bucket_size", args.reduce_bucket_size)
    if ds_config and args.reduce_bucket_size != DEFAULT_REDUCE_BUCKET and reduce_bucket_size != args.reduce_bucket_size:
        raise UserError(f"--reduce-bucket-size {args.reduce_bucket_size:.0e}: with --ds-config, DeepSpeed takes "
                        f"zero_optimization.reduce_bucket_size from the file ({reduce_bucket_size:.0e} here); set it "
                        "there, or with --ds-override")
    persistence = deepspeed_zero_setting(ds_config, ds_override, "stage3_param_persistence_threshold",
                                         STAGE3_PERSISTENCE_THRESHOLD)
    config = RunConfig(strategies=strategies, baseline=baseline, nproc=nproc, device=device,
                       precision=precision, precision_note=note, device_note=device_note, steps=args.steps, seed=args.seed,
                       micro_batch=micro_batch, grad_accum=args.grad_accum, reduce_bucket_size=reduce_bucket_size,
                       param_persistence_threshold=persistence,
                       gradient_clipping=args.gradient_clipping, fused_adam=fused_adam,
                       grad_overflow_check=grad_overflow_check,
                       ds_override=ds_override, ds_config=ds_config, ds_config_path=args.ds_config,
                       job=job, warmup_steps=warmup, rounds=getattr(args, "rounds", 1),
                       reference_loops=job == "bench" and not getattr(args, "no_reference", True),
                       peak_tflops=getattr(args, "peak_tflops", None),
                       memory_limit_gib=getattr(args, "memory_limit_gib", None),
                       preset=args.model or args.preset, model=model_from_args(args, compile_blocks=compile_blocks),
                       out=args.out,
                       verbose=args.verbose, timeout=getattr(args, "timeout", None),
                       lr=args.lr if args.lr is not None else PRESET_LR.get(None if args.model else args.preset, 1e-4))
    if not checked:
        check_config(config, gpus_visible=gpus if world_size is None else None)
    return config


def resolved_grad_overflow_check(flag: bool | None, fast: bool, precision: str, ds_config: dict,
                                 ds_override: dict, strategies: tuple[str, ...]) -> bool | None:
    """DeepSpeed's bf16.check_grad_overflow for the run: --[no-]grad-overflow-check, else the DeepSpeed
    config's own where it sets it (in its "bf16" section or the older "bfloat16"; "auto" sets nothing),
    else off for bench's speed defaults, else None (DeepSpeed's default). ZeRO-1 and 2 read it
    (DeepSpeedZeroOptimizer) from 0.17.1 on; before, they never check bf16 gradients, so asking them to is
    a user error. ZeRO-3 and DeepSpeed without ZeRO check bf16 gradients never or always.

    Off in bench on GPUs: its host synchronisation before every step left the GPU idle while the
    step's kernels were launched, 24 ms of ZeRO-2's 142 ms step on gpt-1b at N=1 on one H100, the whole
    of its difference from DDP, which checks nothing (docs/results/1xh100/issue25/). DeepSpeed 0.17.1 to
    0.19.2 leave it off in bf16, which needs no loss scaling; 0.19.3 turned it on (DeepSpeed PR 8035)."""
    from zerolens.compat import installed_version, patch_release
    from zerolens.strategies.deepspeed import BF16_CHECK_READ
    named = f"--{'' if flag else 'no-'}grad-overflow-check"
    deepspeed = installed_version("deepspeed")
    if flag and deepspeed and patch_release(deepspeed) < BF16_CHECK_READ:
        raise UserError(f"{named}: DeepSpeed {deepspeed} never checks bf16 gradients (only fp16 ones, for its loss "
                        "scaling); bf16.check_grad_overflow is read from DeepSpeed 0.17.1 on")
    if flag is not None and precision != "bf16":
        raise UserError(f"{named} is DeepSpeed's bf16 setting; the run's precision is {precision} (DeepSpeed "
                        "always checks in fp16, for its loss scaling, and never in fp32)")
    if flag is not None and not registry.reading_grad_overflow_check(strategies):
        raise UserError(f"{named} sets what {', '.join(registry.reading_grad_overflow_check(registry.names()))} "
                        "do; the run has none of them")
    theirs = next((source[section]["check_grad_overflow"] for source in (ds_override, ds_config)
                   for section in ("bf16", "bfloat16") if isinstance(source.get(section), dict)
                   and source[section].get("check_grad_overflow", "auto") != "auto"), None)
    if theirs is not None and not isinstance(theirs, bool):
        raise UserError("the DeepSpeed config's bf16.check_grad_overflow must be true or false, got "
                        + json.dumps(theirs))
    if flag is not None and theirs is not None and theirs != flag:
        raise UserError(f"{named} disagrees with the DeepSpeed config's bf16.check_grad_overflow "
                        f"{json.dumps(theirs)}; keep one of them")
    chosen = flag if flag is not None else theirs
    if chosen is not None:
        return chosen
    return False if fast and precision == "bf16" else None


def gpu_compiler() -> bool:
    """Whether torch.compile's GPU backend is installed (Triton): bench compiles by default only then, so
    that a torch without it trains uncompiled (its header then names no compiled blocks) instead of
    failing in the first step. Looked up without importing it and without asking the GPU, which would
    give this launching process a CUDA context on GPU 0 beside rank 0's."""
    import importlib.util
    return importlib.util.find_spec("triton") is not None


def job_of(args: argparse.Namespace) -> str:
    return getattr(args, "job", "verify")


def visible_gpus() -> int:
    return torch.cuda.device_count()
