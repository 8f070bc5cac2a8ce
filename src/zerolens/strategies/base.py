"""The Strategy interface and what every backend shares: the settings they train with, the loss,
and the optimizer step of the torch-native ones.

A Strategy wraps a single-device model for data parallelism, runs forward, backward and the
optimizer step, and says which tensors it holds for each memory component (`holdings`). It
knows where its backend keeps gradients: under ZeRO-1/2/3 `p.grad` is None after backward and
the rank's partition lives inside the optimizer.
"""
from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from zerolens.measure.census import Holdings
from zerolens.models.model import compiled_loss_of, loss_of

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
PHASES = ("forward", "backward", "step")  # a training step, as a Strategy runs it


@dataclass(frozen=True, kw_only=True)
class TrainSettings:
    """What every strategy trains with; the case study's settings by default."""
    precision: str  # fp16 | bf16 | fp32
    lr: float = 1e-4
    micro_batch: int = 8
    # Micro-batches per optimizer step on each rank (gradient accumulation): forward and backward run
    # this many times before the step, the loss of each divided by it (as DeepSpeed divides it).
    grad_accum: int = 1
    world_size: int = 2
    reduce_bucket_size: int = 50_000_000
    # DeepSpeed clips the global gradient norm to 1.0 unless told otherwise (0.19:
    # GRADIENT_CLIPPING_DEFAULT = 1.0), and the case study's config inherits that. We write it
    # into the DeepSpeed config and clip DDP the same way, or DDP's losses part from the rest.
    gradient_clipping: float = 1.0
    # torch's fused AdamW kernel (one launch for all parameters) for every strategy; the default,
    # foreach, is what the verify results were measured with.
    fused_adam: bool = False
    # DeepSpeed's ZeRO-1/2 in bf16: each gradient checked for inf and NaN before the step, which is
    # skipped where one is found (bf16.check_grad_overflow). None: DeepSpeed's own default (0.17.1 to
    # 0.19.2: off; 0.19.3 on: on; before 0.17.1 bf16 is never checked). bench on GPUs turns it off
    # (run/flags.py says why).
    grad_overflow_check: bool | None = None
    # A user's DeepSpeed config (--ds-config), used instead of the generated one, its "auto" values
    # filled from the generated one; checked against these settings in run/deepspeed_config.py.
    user_ds_config: dict = field(default_factory=dict)
    # Merged into the DeepSpeed config last (e.g. {"zero_optimization": {"overlap_comm": true}}).
    ds_override: dict = field(default_factory=dict)
    verbose: bool = False
    # verify takes its census of every storage; bench on CUDA only times the steps, and a strategy then
    # adds nothing a user's loop does not have (DDP no communication hook to see its buckets).
    census: bool = True
    # The loss compiled (models.model.compiled_loss_of): with a compiled model (--compile), in every
    # strategy's loop and reference loop alike.
    compile_loss: bool = False


@dataclass(frozen=True)
class Blocks:
    """A model of repeated blocks as depth scaling (predict/depths.py) asks a strategy about it: whether
    what the strategy groups across blocks (buckets, prefetch windows) parts alike at every depth."""
    block: tuple[tuple[int, bool], ...]  # one block's parameters: (elements, whether it trains)
    params: tuple[tuple[int, bool], ...]  # the model's at its depth, the same
    weight_bytes: int  # bytes of each element as the model is built, and of its gradient
    settings: TrainSettings


def engine_inputs(inputs: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A batch's inputs as DeepSpeed's users hand them to its engine: on the device, and floating
    ones in the dtype the engine runs the model in, which DeepSpeed does not cast them to (Hugging
    Face's Trainer does, in _prepare_input). Token ids stay as they are."""
    return inputs.to(device, dtype=dtype) if inputs.is_floating_point() else inputs.to(device)


def on_device(model: nn.Module, device: torch.device) -> nn.Module:
    """The model on `device`; left as it is when it is there already (the peak prediction's fake
    parameters cannot be moved, not even to where they are)."""
    if all(t.device == device for t in [*model.parameters(), *model.buffers()]):
        return model
    return model.to(device)


def optimizer_step(scaler, optimizer: torch.optim.Optimizer, module: nn.Module, clipping: float) -> None:
    """The end of a training step as torch's users write it: unscale, clip the global gradient norm
    as DeepSpeed does, step, update the (fp16) scale, zero."""
    if clipping > 0:
        scaler.unscale_(optimizer)  # clip the true gradients
        nn.utils.clip_grad_norm_(module.parameters(), clipping)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def scaled_step(scaler, optimizer: torch.optim.Optimizer, module: nn.Module, clipping: float) -> bool:
    """The optimizer step of the torch-native strategies (optimizer_step). False when the (fp16)
    scaler skipped the step for inf/nan gradients, which is exactly when it lowers its scale."""
    scale_before = scaler.get_scale() if scaler.is_enabled() else None
    optimizer_step(scaler, optimizer, module, clipping)
    return scale_before is None or scaler.get_scale() >= scale_before


def share_of_step(loss: torch.Tensor, micro_batches: int) -> torch.Tensor:
    """A micro-batch's loss as its share of the step's, whose gradient is the mean over its micro-batches (as
    DeepSpeed's under gradient_accumulation_steps); of one micro-batch, the loss itself, with no division
    that a plain loop would not make."""
    return loss / micro_batches if micro_batches > 1 else loss


def scaled_step_without_reading_values(scaler, optimizer: torch.optim.Optimizer, module: nn.Module,
                                       clipping: float, step=None) -> bool:
    """scaled_step's work for the peak prediction's step models, whose fake tensors have no values:
    fp16's unscale and scale update, the clip, the optimizer's step, the zeroing, without the
    scaler's reads (its scale, and whether a gradient was inf or nan: the step is taken). `step`: what
    steps in the optimizer's place, where another does (FSDP2's step model's AdamW on local tensors)."""
    if scaler.is_enabled():
        scaler.unscale_(optimizer)
    if clipping > 0:
        nn.utils.clip_grad_norm_(module.parameters(), clipping)
    (step or optimizer.step)()
    if scaler.is_enabled():
        # The new scale given, not computed: FSDP2's ShardedGradScaler computes it on the CPU by
        # reading "found inf". Given or computed, it is written in place, allocating nothing.
        scaler.update(new_scale=1.0)
    optimizer.zero_grad(set_to_none=True)
    return True


class Strategy(abc.ABC):
    name: str

    @classmethod
    def not_modelled(cls, settings: TrainSettings, **options) -> list[str]:
        """A step model's (predict/peak.py): the run's settings it does not model, as "key: value"
        (none by default); where there are any, the run's peak is not predicted and they are said."""
        return []

    @classmethod
    def release_not_modelled(cls, settings: TrainSettings, **options) -> str | None:
        """A step model's: why the installed release of its backend steps otherwise than it models,
        or None (the default: it follows every supported release)."""
        return None

    @classmethod
    def adopt(cls, trained, optimizer, **options) -> Strategy | None:
        """This backend around what a user's own loop built and trains (zerolens.track): `trained`, the
        wrapped model or engine, and its optimizer, left as `setup` would leave them, for `holdings`
        and `describe`; None where `trained` is not this backend's with these `options` (the
        registry's). Nothing of the user's training changes."""
        return None

    @abc.abstractmethod
    def setup(self, model: nn.Module, device: torch.device) -> None:
        """Wrap the model (fp32, on the CPU) and build the optimizer."""

    def before_forward(self) -> None:
        """Called before every forward (forward_loss's, and a tracked loop's): what the backend must
        let go of before it (none by default)."""

    @abc.abstractmethod
    def forward_loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def step(self) -> bool:
        """Optimizer step and zeroing of gradients; False if the step was skipped (fp16 overflow)."""

    def accumulating(self, sync: bool) -> contextlib.AbstractContextManager:
        """Around one micro-batch's forward and backward under gradient accumulation
        (settings.grad_accum > 1); `sync` is False for all but the step's last micro-batch. By default
        the backend accumulates into the gradients it already holds and needs nothing more."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def holdings(self) -> Holdings:
        """The tensors held now, per component."""

    @abc.abstractmethod
    def teardown(self) -> None: ...

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The training loss (models.model.loss_of), compiled where the settings say so."""
        return (compiled_loss_of() if self.settings.compile_loss else loss_of)(logits, labels)

    def reference_loop(self, model: nn.Module, device: torch.device):
        """The loop this backend's users write, without zerolens, with this strategy's settings (bench's
        reference, run/reference.py): (step(micro_batches) -> each micro-batch's loss, undivided, teardown(),
        what it is in a few words); None where zerolens has none."""
        return None

    def describe(self) -> dict:
        """The backend settings, for config.json."""
        return {}

    def notes(self) -> list[str]:
        """What the user should know about how this backend was run (after setup)."""
        return []


class ScaledStrategy(Strategy):
    """The torch-native strategies' backward and step: their GradScaler scales the loss (fp16 only;
    disabled it passes the loss through), then `scaled_step`. Subclasses set `scaler`,
    `optimizer`, `module` and `settings` in setup."""

    def backward(self, loss):
        self.scaler.scale(share_of_step(loss, self.settings.grad_accum)).backward()

    def step(self):
        return scaled_step(self.scaler, self.optimizer, self.module, self.settings.gradient_clipping)
