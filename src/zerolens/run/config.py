"""A run's settings: one frozen dataclass, RunConfig, resolved from the flags once (flags.py),
checked once before any worker starts (validate.py), saved as config.json and loaded by every worker.

Sweep and maxsize derive their points with dataclasses.replace. User mistakes raise UserError (the
CLI prints its one line and exits 2); internal invariants are asserts.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from zerolens.errors import UserError
from zerolens.models.model import ModelConfig
from zerolens.report.files import write_json
from zerolens.run.deepspeed_config import check_user_ds_config
from zerolens.strategies import TrainSettings, registry
from zerolens.strategies.layout import STAGE3_PERSISTENCE_THRESHOLD

# torch counts a tensor's bytes in 64 bits: a bucket of more elements than this, at up to 4 bytes each,
# cannot be made (DeepSpeed's config takes any integer; the trace would fail on it).
MAX_BUCKET_ELEMENTS = 2**61


def bucket_elements(value: float, flag: str = "--reduce-bucket-size") -> int:
    """A reduce bucket size in elements, or one line saying why it cannot be one."""
    if not (math.isfinite(value) and 1 <= value <= MAX_BUCKET_ELEMENTS):
        raise UserError(f"{flag} must be from 1 to 2^61 elements (bytes are 64-bit counts), got {value:g}")
    return int(value)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    strategies: tuple[str, ...] = registry.VERIFY_DEFAULT
    baseline: str = registry.BASELINE
    nproc: int = 2
    device: str = "cpu"
    device_note: str = ""  # why zerolens chose the CPU where a GPU is visible, if it did
    precision: str = "bf16"
    precision_note: str = ""  # why the precision differs from a GPU run's of the model, if it does
    steps: int = 100
    seed: int = 0
    micro_batch: int = 8
    grad_accum: int = 1  # micro-batches per optimizer step (gradient accumulation)
    lr: float = 1e-4
    # DeepSpeed's reduce_bucket_size and ZeRO-3's param_persistence_threshold: a user's DeepSpeed
    # config (--ds-config, --ds-override) sets them where it has them (deepspeed_zero_setting).
    reduce_bucket_size: int = 50_000_000
    param_persistence_threshold: int = STAGE3_PERSISTENCE_THRESHOLD
    gradient_clipping: float = 1.0  # DeepSpeed's default; DDP is clipped the same way
    fused_adam: bool = False
    grad_overflow_check: bool | None = None  # DeepSpeed's bf16.check_grad_overflow (TrainSettings says more)
    ds_override: dict = field(default_factory=dict)
    ds_config: dict = field(default_factory=dict)  # --ds-config FILE, as read
    ds_config_path: str | None = None
    # zerolens bench: untimed steps first (the optimizer's states are allocated in the first);
    # `steps` are then the timed ones. The peak FLOP/s that MFU divides by (None: looked up).
    warmup_steps: int = 0
    # zerolens bench: rounds of every strategy, interleaved (A B, A B, ...), each strategy of a round in
    # its own worker processes; the ratios to the reference are the median over rounds, with their range.
    rounds: int = 1
    # zerolens bench: beside each strategy that has one, a loop written as its users write it, timed the
    # same way in each round (run/reference.py): the harness's own cost, measured.
    reference_loops: bool = False
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
        if self.rounds < 1:
            raise UserError(f"--rounds must be at least 1, got {self.rounds}")
        if self.memory_limit_gib is not None and not self.memory_limit_gib > 0:
            raise UserError(f"--memory-limit-gib must be positive, got {self.memory_limit_gib}")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise UserError(f"--peak-tflops must be positive, got {self.peak_tflops}")
        if self.job == "verify" and self.steps < 4:
            raise UserError(f"--steps must be at least 4 for verify, got {self.steps}")
        if self.job == "bench" and self.steps < 1:
            raise UserError(f"--steps (timed steps) must be at least 1, got {self.steps}")
        if not self.lr > 0:
            raise UserError(f"--lr must be positive, got {self.lr}")
        if self.gradient_clipping < 0:
            raise UserError(f"--gradient-clipping must be 0 (off) or positive, got {self.gradient_clipping}")
        if self.micro_batch < 1:
            raise UserError(f"--micro-batch must be at least 1, got {self.micro_batch}")
        if self.grad_accum < 1:
            raise UserError(f"--grad-accum must be at least 1, got {self.grad_accum}")
        bucket_elements(self.reduce_bucket_size)
        if self.device not in ("cpu", "cuda"):
            raise UserError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.precision not in ("fp16", "bf16", "fp32"):
            raise UserError(f"--precision must be fp16, bf16 or fp32, got {self.precision!r}")
        if self.ds_config:
            check_user_ds_config(self.ds_config, self.ds_config_path, micro_batch=self.micro_batch,
                                 grad_accum=self.grad_accum, world_size=self.nproc, precision=self.precision)
        if self.device == "cpu" and self.precision == "fp16":
            raise UserError("fp16 is not supported on CPU (DeepSpeed's CPU accelerator has no fp16): "
                            "use --precision bf16 or fp32, or --device cuda")
        if self.timeout is not None and not self.timeout > 0:
            raise UserError(f"--timeout must be positive (seconds), got {self.timeout}")

    def run_items(self) -> list[tuple[int, str]]:
        """(round index, strategy) of every training the run makes, in the order they run: the strategies
        one after another, each followed by its reference loop where bench runs them, round after round."""
        from zerolens.run.reference import reference_of
        names = [n for name in self.strategies
                 for n in (name, reference_of(name) if self.reference_loops else None) if n is not None]
        return [(r, name) for r in range(self.rounds) for name in names]

    def model_for(self, strategy: str) -> ModelConfig:
        """The model `strategy` trains: the run's, but with its blocks not compiled under a strategy that
        cannot compile them (registry's not_compiled; said in its notes, compile_note)."""
        if self.model.compile_blocks and registry.spec(strategy).not_compiled:
            return dataclasses.replace(self.model, compile_blocks=False)
        return self.model

    def compile_note(self, strategy: str) -> str | None:
        """Why `strategy` trains the model without the compiled blocks the run asked for, if it does."""
        reason = registry.spec(strategy).not_compiled
        if self.model.compile_blocks and reason:
            return f"blocks not compiled under {strategy}: {reason}; measured without"
        return None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "RunConfig":
        """The config `to_json` wrote (config.json); keys of other files' (the command, the
        backends' settings) are left out."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        return cls(**{**values, "strategies": tuple(values["strategies"]), "model": ModelConfig(**values["model"])})

    def train_settings(self, strategy: str | None = None) -> TrainSettings:
        """What every strategy trains with; given `strategy`, with its loss compiled where its model is
        (model_for)."""
        return TrainSettings(precision=self.precision, lr=self.lr, micro_batch=self.micro_batch,
                             grad_accum=self.grad_accum,
                             world_size=self.nproc, reduce_bucket_size=self.reduce_bucket_size,
                             gradient_clipping=self.gradient_clipping, fused_adam=self.fused_adam,
                             grad_overflow_check=self.grad_overflow_check, user_ds_config=self.ds_config,
                             ds_override=self.ds_override, verbose=self.verbose,
                             # On the CPU bench follows a warm-up step tensor by tensor (measure/timer.py),
                             # which needs DDP's buckets in hand: only CUDA's bench leaves the hook out.
                             census=not (self.job == "bench" and self.device == "cuda"),
                             compile_loss=(self.model_for(strategy) if strategy else self.model).compile_blocks)


def save_config(config: RunConfig, path: Path, command: str) -> None:
    """config.json: the command, every setting, and each backend's own settings (DeepSpeed configs)."""
    settings = config.train_settings()
    write_json(path, {"command": command, **config.to_json(),
                      "strategy_settings": {n: registry.make_strategy(n, settings).describe() for n in config.strategies}})


def load_config(path: str) -> RunConfig:
    """A worker's config, from the config.json that zerolens wrote."""
    with open(path) as f:
        return RunConfig.from_json(json.load(f))
