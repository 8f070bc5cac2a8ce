"""A run's settings: one frozen dataclass, RunConfig, resolved from the flags and validated once.

The CLI resolves the flags (`config_from_args`), checks the result (`check_config`: the slow checks,
made once, before any worker starts) and writes it as config.json; its workers load that file
(`load_config`). Under torchrun or deepspeed, a worker resolves its own flags the same way. Sweep
and maxsize derive their points with dataclasses.replace. User mistakes raise UserError (the CLI
prints its one line and exits 2); internal invariants are asserts.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import io
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .compat import check_supported
from .errors import UserError
from .faults import fault_from_environment
from .hf import PREFIX as HF_PREFIX
from .model import PRESETS, ModelConfig, parameter_shapes, user_model
from .strategies import TrainSettings, registry
from .theory import STAGE3_PERSISTENCE_THRESHOLD


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


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    strategies: tuple[str, ...] = registry.VERIFY_DEFAULT
    baseline: str = registry.BASELINE
    nproc: int = 2
    device: str = "cpu"
    precision: str = "bf16"
    precision_note: str = ""  # why the precision differs from the case study's fp16, if it does
    steps: int = 100
    seed: int = 0
    micro_batch: int = 8
    lr: float = 1e-4
    # DeepSpeed's reduce_bucket_size and ZeRO-3's param_persistence_threshold: a user's DeepSpeed
    # config (--ds-config, --ds-override) sets them where it has them (deepspeed_zero_setting).
    reduce_bucket_size: int = 50_000_000
    param_persistence_threshold: int = STAGE3_PERSISTENCE_THRESHOLD
    gradient_clipping: float = 1.0  # DeepSpeed's default; DDP is clipped the same way
    fused_adam: bool = False
    ds_override: dict = field(default_factory=dict)
    ds_config: dict = field(default_factory=dict)  # --ds-config FILE, as read
    ds_config_path: str | None = None
    # zerolens bench: untimed steps first (the optimizer's states are allocated in the first);
    # `steps` are then the timed ones. The peak FLOP/s that MFU divides by (None: looked up).
    warmup_steps: int = 0
    peak_tflops: float | None = None
    memory_limit_gib: float | None = None  # CUDA: the caching allocator's cap per GPU
    job: str = "verify"  # verify | bench
    signal: float = 0.8  # fraction of class tokens in each sample (data.py)
    preset: str = "case-study"
    model: ModelConfig = field(default_factory=ModelConfig)
    out: str | None = None
    verbose: bool = False
    timeout: float | None = 900.0  # the hang watchdog's, in seconds (zerolens's own launcher only)
    predict_peaks: bool = True  # rank 0 predicts the peaks before training (off for maxsize's trials)

    def __post_init__(self):
        unknown = [s for s in self.strategies if s not in registry.names()]
        if unknown:
            raise UserError(f"unknown strategy {unknown[0]!r}; choose from {', '.join(registry.names())}")
        if len(set(self.strategies)) != len(self.strategies):
            raise UserError("--strategies lists a strategy twice")
        if self.baseline not in self.strategies:
            raise UserError(f"--baseline {self.baseline} is not among --strategies {','.join(self.strategies)}")
        if self.nproc < 1:
            raise UserError(f"--nproc must be at least 1, got {self.nproc}")
        if self.warmup_steps < 0:
            raise UserError(f"--warmup must be 0 or more, got {self.warmup_steps}")
        if self.memory_limit_gib is not None and not self.memory_limit_gib > 0:
            raise UserError(f"--memory-limit-gib must be positive, got {self.memory_limit_gib}")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise UserError(f"--peak-tflops must be positive, got {self.peak_tflops}")
        if self.job == "verify" and self.steps < 4:
            raise UserError(f"--steps must be at least 4 to tell whether the loss fell, got {self.steps}")
        if self.job == "bench" and self.steps < 1:
            raise UserError(f"--steps (timed steps) must be at least 1, got {self.steps}")
        if not self.lr > 0:
            raise UserError(f"--lr must be positive, got {self.lr}")
        if self.gradient_clipping < 0:
            raise UserError(f"--gradient-clipping must be 0 (off) or positive, got {self.gradient_clipping}")
        if self.micro_batch < 1:
            raise UserError(f"--micro-batch must be at least 1, got {self.micro_batch}")
        if self.reduce_bucket_size < 1:
            raise UserError(f"--reduce-bucket-size must be at least 1 element, got {self.reduce_bucket_size}")
        if self.device not in ("cpu", "cuda"):
            raise UserError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.precision not in ("fp16", "bf16", "fp32"):
            raise UserError(f"--precision must be fp16, bf16 or fp32, got {self.precision!r}")
        if self.ds_config:
            check_user_ds_config(self.ds_config, self.ds_config_path, micro_batch=self.micro_batch,
                                 world_size=self.nproc, precision=self.precision)
        if self.device == "cpu" and self.precision == "fp16":
            raise UserError("fp16 is not supported on CPU (DeepSpeed's CPU accelerator has no fp16): "
                            "use --precision bf16 or fp32, or --device cuda")
        if self.timeout is not None and not self.timeout > 0:
            raise UserError(f"--timeout must be positive (seconds), got {self.timeout}")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "RunConfig":
        """The config `to_json` wrote (config.json); keys of other files' (the command, the
        backends' settings) are left out."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        return cls(**{**values, "strategies": tuple(values["strategies"]), "model": ModelConfig(**values["model"])})

    def train_settings(self) -> TrainSettings:
        """What every strategy trains with."""
        return TrainSettings(precision=self.precision, lr=self.lr, micro_batch=self.micro_batch,
                             world_size=self.nproc, reduce_bucket_size=self.reduce_bucket_size,
                             gradient_clipping=self.gradient_clipping, fused_adam=self.fused_adam,
                             user_ds_config=self.ds_config, ds_override=self.ds_override, verbose=self.verbose)


def save_config(config: RunConfig, path: Path, command: str) -> None:
    """config.json: the command, every setting, and each backend's own settings (DeepSpeed configs)."""
    from .report import write_json
    settings = config.train_settings()
    write_json(path, {"command": command, **config.to_json(),
                      "strategy_settings": {n: registry.make_strategy(n, settings).describe() for n in config.strategies}})


def load_config(path: str) -> RunConfig:
    """A worker's config, from the config.json that zerolens wrote."""
    with open(path) as f:
        return RunConfig.from_json(json.load(f))


def check_deepspeed_configs(config: RunConfig) -> None:
    """Each zero strategy's DeepSpeed config, as it will be passed to deepspeed.initialize, through
    DeepSpeed's own config model: a bad value (a bucket of 0 elements, a misspelt key in --ds-config
    or --ds-override) ends here in one line rather than in the workers after other strategies trained."""
    os.environ.setdefault("DS_ACCELERATOR", config.device)  # saves DeepSpeed a probe and a warning
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        from deepspeed.runtime.config import DeepSpeedConfig
    # DeepSpeed logs its config at INFO, to a handler bound to stdout when it was imported: quiet
    # here, and as it was afterwards (--verbose brings DeepSpeed's logging back in the workers).
    logger = logging.getLogger("DeepSpeed")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        validate_deepspeed_configs(config, DeepSpeedConfig)
    finally:
        logger.setLevel(level)


def validate_deepspeed_configs(config: RunConfig, DeepSpeedConfig) -> None:
    settings = config.train_settings()
    for name in config.strategies:
        if not registry.spec(name).needs_deepspeed:
            continue
        ds_config = registry.make_strategy(name, settings).ds_config()
        # DeepSpeed checks train_batch_size against the world size it finds, which is 1 here (no process
        # group); the batch arithmetic over the ranks is checked by check_user_ds_config.
        ds_config = {**ds_config, "train_batch_size": ds_config.get("train_micro_batch_size_per_gpu", 1)
                     * ds_config.get("gradient_accumulation_steps", 1)}
        try:
            DeepSpeedConfig(ds_config)
        except Exception as e:  # pydantic's ValidationError, DeepSpeed's own asserts and ValueErrors
            raise UserError(f"{name}: DeepSpeed rejects its config: {one_line_error(e)}") from None


def one_line_error(error: Exception) -> str:
    """A pydantic ValidationError's first error as "where: what (input ...)", anything else's first line."""
    errors = getattr(error, "errors", None)
    if callable(errors):
        with contextlib.suppress(Exception):
            first = errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            return f"{where}: {first['msg']} (got {first.get('input')!r})"
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def parse_strategies(text: str) -> tuple[str, ...]:
    """`--strategies` as a tuple of known names."""
    strategies = tuple(s.strip() for s in text.split(",") if s.strip())
    if not strategies:
        raise UserError("--strategies is empty")
    unknown = [s for s in strategies if s not in registry.names()]
    if unknown:
        raise UserError(f"unknown strategy {unknown[0]!r}; choose from {', '.join(registry.names())}")
    return strategies


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
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
                        help="the model (default: %(default)s; case-study is the demo's 0.53M-parameter Transformer)")
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
    parser.add_argument("--compile", action="store_true",
                        help="GPT presets: torch.compile each block (faster steps after a compile of about a minute)")
    parser.add_argument("--lr", type=float, default=None,
                        help="AdamW learning rate (default: the preset's, 1e-4 for case-study)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--micro-batch", type=int, default=8, help="samples per rank per step (default 8)")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="samples per step over all ranks; must be divisible by --nproc "
                             "(default: micro-batch x nproc)")
    parser.add_argument("--reduce-bucket-size", type=float, default=5e7,
                        help="DeepSpeed reduce_bucket_size in elements (default 5e7, the case study's)")
    parser.add_argument("--gradient-clipping", type=float, default=1.0,
                        help="global gradient-norm clipping for every strategy; 0 turns it off "
                             "(default 1.0, DeepSpeed's own default)")
    parser.add_argument("--fused-adam", action="store_true",
                        help="torch's fused AdamW kernel for every strategy (default: torch's foreach AdamW)")
    parser.add_argument("--ds-config", default=None, metavar="FILE",
                        help="your DeepSpeed JSON config for the zero strategies; \"auto\" values are filled from "
                             "zerolens's settings, the stage comes from the strategy")
    parser.add_argument("--ds-override", default=None, metavar="JSON",
                        help="JSON merged into the DeepSpeed config zerolens writes, e.g. "
                             "'{\"zero_optimization\": {\"overlap_comm\": true}}'")
    parser.add_argument("--out", default=None, help="run folder (default: runs/<timestamp>)")
    parser.add_argument("--overwrite", action="store_true", help="replace the --out run folder if it exists")
    parser.add_argument("--timeout", type=float, default=900,
                        help="end the run when no rank makes progress for this many seconds (default 900; "
                             "a rank that stopped answering is named)")
    parser.add_argument("--verbose", action="store_true", help="show DeepSpeed's own logging")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps before the timed ones (default 3)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the GPU's peak dense TFLOP/s at the run's precision, for MFU "
                             "(default: the datasheet figure for H100/H200/A100; none elsewhere)")
    parser.add_argument("--memory-limit-gib", type=float, default=None,
                        help="CUDA: cap the memory each rank's allocator may use, as on a smaller GPU")


def ds_config_from_file(path: str | None) -> dict:
    """--ds-config FILE: a JSON object, or one line saying why not."""
    if path is None:
        return {}
    try:
        text = open(path).read()
    except OSError as e:
        raise UserError(f"--ds-config {path}: cannot read it ({e.strerror})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"--ds-config {path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    if not isinstance(value, dict):
        raise UserError(f"--ds-config {path} must hold a JSON object")
    return value


def check_user_ds_config(user: dict, path: str | None, *, micro_batch: int, world_size: int, precision: str) -> None:
    """The batch arithmetic and precision of a user's DeepSpeed config must agree with the run's:
    zerolens feeds every rank `micro_batch` samples per step, without gradient accumulation."""
    def explicit(key, section=None):
        value = (user.get(section) or {}).get(key) if section else user.get(key)
        return None if value in (None, "auto") else value

    accumulation = explicit("gradient_accumulation_steps") or 1
    micro = explicit("train_micro_batch_size_per_gpu") or micro_batch
    total = explicit("train_batch_size")
    if accumulation != 1:
        raise UserError(f"--ds-config {path}: gradient_accumulation_steps {accumulation}, but zerolens steps without "
                        "accumulation: set it to 1 or \"auto\"")
    if micro != micro_batch:
        raise UserError(f"--ds-config {path}: train_micro_batch_size_per_gpu {micro}, but the run feeds {micro_batch} "
                        f"samples per rank: pass --micro-batch {micro} or set it to \"auto\"")
    if total is not None and total != micro * world_size * accumulation:
        raise UserError(f"--ds-config {path}: train_batch_size {total} != train_micro_batch_size_per_gpu {micro} x "
                        f"{world_size} ranks x gradient_accumulation_steps {accumulation} = "
                        f"{micro * world_size * accumulation}; fix it or set it to \"auto\"")
    for dtype in ("fp16", "bf16"):
        enabled = explicit("enabled", dtype)
        if enabled is True and precision != dtype:
            raise UserError(f"--ds-config {path} enables {dtype} but the run's precision is {precision}: "
                            f"pass --precision {dtype} or set \"enabled\" to \"auto\"")


def deepspeed_zero_setting(ds_config: dict, ds_override: dict, key: str, default) -> int:
    """zero_optimization.`key` (or its name without "stage3_") as the run's DeepSpeed config sets
    it, --ds-override over --ds-config, in elements; `default` where neither sets it or it is "auto".
    What DeepSpeed will use, so that what zerolens predicts of it agrees (theory.py, predict_peak.py)."""
    for source, where in ((ds_override, "--ds-override"), (ds_config, "--ds-config")):
        section = source.get("zero_optimization") or {}
        for name in (key, key.removeprefix("stage3_")):
            value = section.get(name)
            if value in (None, "auto"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise UserError(f"{where}: zero_optimization.{name} must be a number of elements, got {value!r}")
            return int(value)
    if not math.isfinite(default):
        raise UserError(f"--reduce-bucket-size must be a number of elements, got {default}")
    return int(default)


def ds_override_from_json(text: str | None) -> dict:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"--ds-override is not valid JSON ({e.msg} at character {e.pos}): {text}") from None
    if not isinstance(value, dict):
        raise UserError(f"--ds-override must be a JSON object, got {text}")
    return value


def hf_model_from_args(args: argparse.Namespace) -> ModelConfig:
    """--model hf:<model type or config.json>, with --depth, --seq-len and --activation-checkpointing."""
    from .hf import model_config_fields
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
    """--model module:factory with --batch module:function (check_config runs them)."""
    if not args.batch:
        raise UserError("--model needs --batch module:function: how zerolens makes inputs and targets (README)")
    if any(v is not None for v in (args.width, args.depth, args.heads, args.seq_len)) or args.activation_checkpointing \
            or args.compile:
        raise UserError("--width/--depth/--heads/--seq-len/--activation-checkpointing/--compile change a preset, "
                        "not a --model")
    return ModelConfig(kind="user", factory=args.model, batch=args.batch)


def check_model_contract(model: ModelConfig, global_batch: int, seed: int) -> None:
    """What zerolens needs of a user's model and batch function (README, "Your own model"): a batch
    of `global_batch` rows (inputs, integer targets), and logits as one tensor that cross-entropy
    can compare with the targets. Run on the meta device; a model whose forward needs real values
    there (data-dependent shapes, .item()) is left to the workers."""
    from .data import make_batch
    from .strategies import loss_of
    if not parameter_shapes(model):
        raise UserError(f"--model {model.factory}: the model has no parameters")
    inputs, targets = make_batch(model, 0, seed=seed, batch_size=global_batch, signal=0.0)
    with torch.device("meta"):
        module = user_model(model)
    try:
        output = module(inputs.to("meta"))
    except (NotImplementedError, RuntimeError) as e:
        if "meta" in str(e) or isinstance(e, NotImplementedError):
            return  # cannot run on the meta device: the workers will run it for real
        raise
    if not isinstance(output, torch.Tensor):
        raise UserError(f"--model {model.factory}: the model returned a {type(output).__name__}; zerolens needs "
                        "its logits as one tensor (..., classes): return them alone (e.g. `.logits` or `[0]` of "
                        "a Hugging Face output, in a small wrapper module)")
    try:
        loss_of(output, targets.to("meta"))
    except Exception as e:
        raise UserError(f"--model/--batch: the model's output {tuple(output.shape)} and the batch's targets "
                        f"{tuple(targets.shape)} do not fit cross-entropy ({one_line_error(e)}); zerolens compares "
                        "logits (..., classes) with integer targets (...) of the same leading shape, for a global "
                        f"batch of {global_batch} rows") from None


def model_from_args(args: argparse.Namespace) -> ModelConfig:
    """The preset, with any of --width/--depth/--heads/--seq-len applied (a GPT's MLP stays 4x wide),
    or the user's model, or a Hugging Face one (--model hf:...)."""
    if getattr(args, "model", None) and args.model.startswith(HF_PREFIX):
        return hf_model_from_args(args)
    if getattr(args, "model", None):
        return user_model_from_args(args)
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
    if args.compile:
        changes["compile_blocks"] = True
    if "d_model" in changes and model.kind == "gpt":
        changes["ffn_dim"] = 4 * changes["d_model"]
    try:
        return dataclasses.replace(model, **changes)
    except ValueError as e:
        raise UserError(f"--preset {args.preset}: {e}") from None


def config_from_args(args: argparse.Namespace, *, world_size: int | None = None,
                     gpus_visible: int | None = None, checked: bool = False) -> RunConfig:
    """The flags resolved against the machine into a RunConfig, checked (check_config) unless
    `checked`. `world_size` is given when a launcher started us."""
    gpus = torch.cuda.device_count() if gpus_visible is None else gpus_visible
    device = args.device or ("cuda" if gpus >= 2 else "cpu")
    if world_size is not None:
        if args.nproc is not None and args.nproc != world_size:
            raise UserError(f"--nproc {args.nproc} disagrees with the launcher's world size {world_size}")
        nproc = world_size
    else:
        nproc = args.nproc if args.nproc is not None else (gpus if device == "cuda" and gpus >= 2 else 2)
    if nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {nproc}")
    strategies = parse_strategies(args.strategies)
    baseline = args.baseline or registry.default_baseline(strategies)
    precision, note = args.precision, ""
    if precision is None:
        # A user's model: bf16 on GPU, which needs no loss scaling.
        precision = (PRESET_GPU_PRECISION.get(None if args.model else args.preset, "bf16") if device == "cuda"
                     else "bf16")
        if device == "cpu":
            note = "CPU run: DeepSpeed has no fp16 on CPU, so bf16 is used instead of the case study's fp16"
    job = getattr(args, "job", "verify")
    # verify has no warm-up; bench's default is 3 untimed steps.
    warmup = 0 if job == "verify" else (args.warmup if args.warmup is not None else 3)
    micro_batch = micro_batch_of(args, nproc)
    ds_config, ds_override = ds_config_from_file(args.ds_config), ds_override_from_json(args.ds_override)
    reduce_bucket_size = deepspeed_zero_setting(ds_config, ds_override, "reduce_bucket_size", args.reduce_bucket_size)
    persistence = deepspeed_zero_setting(ds_config, ds_override, "stage3_param_persistence_threshold",
                                         STAGE3_PERSISTENCE_THRESHOLD)
    config = RunConfig(strategies=strategies, baseline=baseline, nproc=nproc, device=device,
                       precision=precision, precision_note=note, steps=args.steps, seed=args.seed,
                       micro_batch=micro_batch, reduce_bucket_size=reduce_bucket_size,
                       param_persistence_threshold=persistence,
                       gradient_clipping=args.gradient_clipping, fused_adam=args.fused_adam,
                       ds_override=ds_override, ds_config=ds_config, ds_config_path=args.ds_config,
                       job=job, warmup_steps=warmup, peak_tflops=getattr(args, "peak_tflops", None),
                       memory_limit_gib=getattr(args, "memory_limit_gib", None),
                       preset=args.model or args.preset, model=model_from_args(args), out=args.out,
                       verbose=args.verbose, timeout=getattr(args, "timeout", None),
                       lr=args.lr if args.lr is not None else PRESET_LR.get(None if args.model else args.preset, 1e-4))
    if not checked:
        check_config(config, gpus_visible=gpus if world_size is None else None)
    return config


def micro_batch_of(args: argparse.Namespace, nproc: int) -> int:
    """Samples per rank per step: --global-batch over the ranks, else --micro-batch."""
    if args.global_batch is None:
        return args.micro_batch
    if args.global_batch < 1:
        raise UserError(f"--global-batch must be at least 1, got {args.global_batch}")
    if args.global_batch % nproc:
        raise UserError(f"--global-batch {args.global_batch} is not divisible by {nproc} processes")
    return args.global_batch // nproc


def check_config(config: RunConfig, gpus_visible: int | None = None, *, running: bool = True) -> None:
    """The checks that cost something, made once, before any worker starts: the GPUs are there
    (`gpus_visible`: none when a launcher placed the ranks), the releases zerolens knows, each
    DeepSpeed config through DeepSpeed's own config model, a user's model and batch run on the meta
    device, and a layout every strategy can predict. Not `running` (a plan without --check): only
    predicted, so DeepSpeed need not be installed."""
    if config.device == "cuda" and gpus_visible is not None and gpus_visible < config.nproc:
        fix = f"use --nproc {gpus_visible} or --device cpu" if gpus_visible else "use --device cpu"
        raise UserError(f"--device cuda with {config.nproc} processes needs {config.nproc} GPUs, but "
                        f"{gpus_visible} are visible; {fix}")
    try:
        fault_from_environment()  # ZEROLENS_FAULT, for tests of failures
    except ValueError as e:
        raise UserError(str(e)) from None
    check_supported("torch", torch.__version__)
    if running and registry.needing_deepspeed(config.strategies):
        if importlib.util.find_spec("deepspeed") is None:
            raise UserError("DeepSpeed is not installed: pip install deepspeed (or use --strategies "
                            f"{','.join(registry.without_deepspeed())})")
        check_supported("deepspeed")
        check_deepspeed_configs(config)
    if config.model.kind == "user":
        try:
            check_model_contract(config.model, config.micro_batch * config.nproc, config.seed)
        except UserError:
            raise
        except Exception as e:  # the user's code: whatever it raises is theirs to fix, said in one line
            raise UserError(f"--model/--batch: {type(e).__name__}: {one_line_error(e)}") from None
    # A model a strategy's layout cannot describe (FSDP2 cannot shard a 0-dimensional parameter) is
    # refused here, not after the others trained.
    shapes = [tuple(shape) for shape in parameter_shapes(config.model)]
    for name in config.strategies:
        try:
            registry.predict_retained(name, [math.prod(s) for s in shapes], config.nproc, 0, config.precision,
                                      reduce_bucket_size=config.reduce_bucket_size, param_shapes=shapes,
                                      param_persistence_threshold=config.param_persistence_threshold)
        except ValueError as e:
            raise UserError(f"--strategies {name}: {e}") from None
