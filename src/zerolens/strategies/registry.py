"""The one place that knows each strategy by name: everything other modules ask about one.

A strategy is a backend (a Strategy subclass in ddp.py, deepspeed.py or fsdp2.py) with its options,
plus what the rest of zerolens needs to know without running it: whether it needs DeepSpeed, which
stage of the ZeRO paper its model states follow, whether it shards gradients, its layout prediction
(strategies/layout.py), the buffers it keeps or allocates, and how its temporaries are recognised. Adding a strategy is a backend (or new options
for one) and one `register` call; nothing outside this package branches on a name.

Importable without torch.distributed or DeepSpeed: backends are imported when a strategy is built.
Strategies from elsewhere come as plugin modules named in ZEROLENS_PLUGINS, which `load_plugins`
imports; the CLI and every worker call it first, so both know the same strategies.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Callable

from zerolens.errors import UserError
from zerolens.strategies.layout import (
    ELEMENT_BYTES,
    RETAINED_KEYS,
    STAGE3_PERSISTENCE_THRESHOLD,
    DeepSpeedLayout,
    Layout,
    deepspeed_flat_partition_layout,
    deepspeed_stage0_layout,
    deepspeed_stage3_layout,
    fsdp2_layout,
    torch_ddp_layout,
)

# (params, gradients after backward, optimizer states, buffers kept) per rank from a parameter count
# Ψ, the world size N and the bytes of a 16-bit-or-not element e, without padding.
Unpadded = Callable[[float, int, int], tuple[float, float, float, float]]
# Bytes each rank sends per step over the network, from Ψ, N and e as above, by the ring algorithms
# NCCL and gloo use: an all-reduce sends 2(N-1)/N of its buffer, an all-gather or a reduce-scatter
# (N-1)/N. Parameters below ZeRO-3's persistence threshold are counted as gathered.
Communication = Callable[[float, int, int], float]


def ring(psi_bytes: float, n: int) -> float:
    """What each of `n` ranks sends to all-gather or reduce-scatter `psi_bytes` in a ring."""
    return psi_bytes * (n - 1) / n


@dataclass(frozen=True, kw_only=True)
class StrategySpec:
    name: str
    backend: str  # "module:Class" of the Strategy subclass, imported when the strategy is built
    options: dict = field(default_factory=dict)  # passed to the backend with the TrainSettings
    description: str
    needs_deepspeed: bool
    paper_stage: int  # the ZeRO paper's stage whose model-state formula applies (DDP: 0)
    shards_gradients: bool  # after backward each rank keeps about 1/N of the gradients
    flat_partition: bool = False  # ZeRO-1/2: one flat buffer cut in N equal slices (exact element checks)
    reduce_bucket: str | None = None  # "every backward" (allocated and freed) | "whole run" (kept) | None
    keeps_small_params_whole: bool = False  # ZeRO-3's param_persistence_threshold
    # How its temporaries are recognised in the CUDA peak replay (peaks.py): path fragments of the
    # files whose allocations are the backend's own (reduce buckets, gathered parameters, ...).
    transient_code: tuple[str, ...] = ()
    # "module:Class" of what its backend allocates on one rank without a process group, for the peak
    # prediction (predict/peak.py); None where zerolens does not predict its peak yet.
    step_model: str | None = None
    layout: Callable[[Layout], dict]  # retained bytes per component (strategies/layout.py)
    unpadded: Unpadded
    communication: Communication | None = None  # None: not known (plan ranks it last)
    # Why its allocations do not repeat alike per block, where they were seen not to on every model tried
    # (predict/depths.py then traces it at the model's depth without first tracing five shallow ones)
    not_depth_scaled: str | None = None
    # "module:function" of (base.Blocks) -> why what it groups across blocks (buckets, windows of gathered
    # parameters) may part otherwise at the model's depth than at the five shallow depths traced, or None
    # where it parts alike at every depth; None: it groups nothing across blocks (predict/depths.py)
    parts_across_blocks: str | None = None
    # Why bench does not compile the GPT presets' blocks under it, where it cannot (bench's --compile)
    not_compiled: str | None = None
    # Its step checks bf16 gradients for inf and NaN as DeepSpeed's bf16.check_grad_overflow says (from
    # 0.17.1; DeepSpeedZeroOptimizer): --grad-overflow-check
    reads_grad_overflow_check: bool = False
    # It runs the weights in the run's 16-bit precision itself (DeepSpeed casts the parameters, FSDP2
    # all-gathers them cast), where DDP autocasts fp32 weights; a module's floating buffers stay as they
    # are, and a forward that combines them with the weights (BatchNorm's running statistics) fails
    # (run/validate.py, check_running_statistics)
    casts_weights: bool = False

    def backend_class(self):
        module, _, cls = self.backend.partition(":")
        return getattr(importlib.import_module(module), cls)

    def build(self, settings):
        """The backend, ready for setup."""
        strategy = self.backend_class()(settings, **self.options)
        strategy.name = self.name
        return strategy

    def parted_across_blocks(self, blocks) -> str | None:
        """parts_across_blocks of `blocks` (base.Blocks); None where it has none."""
        if self.parts_across_blocks is None:
            return None
        module, _, function = self.parts_across_blocks.partition(":")
        return getattr(importlib.import_module(module), function)(blocks)

    def step_model_class(self):
        """The class of the backend's step model (predict/peak.py); ValueError where there is none."""
        if self.step_model is None:
            raise ValueError(f"{self.name} has no step model")
        module, _, cls = self.step_model.partition(":")
        return getattr(importlib.import_module(module), cls)

    def build_step_model(self, settings, *, rank: int, cuda: bool):
        strategy = self.step_model_class()(settings, rank=rank, cuda=cuda, **self.options)
        strategy.name = self.name
        return strategy

    def not_modelled(self, settings) -> list[str]:
        """The run's settings its step model does not model (Strategy.not_modelled)."""
        return self.step_model_class().not_modelled(settings, **self.options)

    def release_not_modelled(self, settings) -> str | None:
        """Why its step model does not follow the installed backend's release (Strategy.release_not_modelled)."""
        return self.step_model_class().release_not_modelled(settings, **self.options)

    def gradient_share(self, world_size: int) -> float:
        """The fraction of the unsharded gradient bytes a rank keeps after backward, before padding."""
        return 1 / world_size if self.shards_gradients else 1.0

    def reduce_bucket_bytes(self, precision: str, reduce_bucket_size: int) -> int:
        """The reduce bucket allocated on every backward (0 where none, or where it is kept)."""
        return ELEMENT_BYTES[precision] * reduce_bucket_size if self.reduce_bucket == "every backward" else 0


_REGISTRY: dict[str, StrategySpec] = {}


def register(spec: StrategySpec) -> StrategySpec:
    if spec.name in _REGISTRY:
        raise ValueError(f"strategy {spec.name!r} is registered already")
    _REGISTRY[spec.name] = spec
    return spec


def names() -> tuple[str, ...]:
    """Every registered strategy, in registration order."""
    return tuple(_REGISTRY)


def spec(name: str) -> StrategySpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(_REGISTRY)}") from None


def make_strategy(name: str, settings):
    return spec(name).build(settings)


def has_reference_loop(name: str) -> bool:
    """Whether the strategy's backend writes the loop its users write (Strategy.reference_loop)."""
    from zerolens.strategies.base import Strategy
    return spec(name).backend_class().reference_loop is not Strategy.reference_loop


def predict_retained(name: str, param_numels: list[int], world_size: int, rank: int, precision: str, *,
                     reduce_bucket_size: int = 50_000_000, param_shapes: list[tuple[int, ...]] | None = None,
                     deepspeed: DeepSpeedLayout | None = None,
                     param_persistence_threshold: int = STAGE3_PERSISTENCE_THRESHOLD, weight_bytes: int = 4,
                     trainable: list[bool] | None = None, param_groups=None,
                     deepspeed_step_bytes: int | None = None) -> dict:
    """Bytes a rank of strategy `name` holds per component (RETAINED_KEYS), from parameter sizes
    (`weight_bytes`: the weights' element size as the model is built, models.model.weight_bytes;
    `trainable`: which parameters train, models.model.trainable_flags; None: all; `param_groups`: the
    optimizer's groups, layout.Layout.param_groups; None: one; `deepspeed_step_bytes`: the bytes of each
    step count DeepSpeed's optimizer keeps, layout.deepspeed_step_bytes; None: torch's AdamW's)."""
    layout = Layout(param_numels=param_numels, world_size=world_size, rank=rank, precision=precision,
                    reduce_bucket_size=reduce_bucket_size, param_shapes=param_shapes,
                    param_persistence_threshold=param_persistence_threshold, weight_bytes=weight_bytes,
                    trainable=None if trainable is None else tuple(trainable),
                    param_groups=None if param_groups is None else tuple(tuple(g) for g in param_groups),
                    **({"deepspeed": deepspeed} if deepspeed is not None else {}),
                    **({"deepspeed_step_bytes": deepspeed_step_bytes} if deepspeed_step_bytes is not None else {}))
    predicted = spec(name).layout(layout)
    return {k: predicted[k] for k in RETAINED_KEYS}


def adopt(trained, optimizer):
    """The strategy a user's loop trains with (zerolens.track): the registered strategy whose backend
    recognises `trained` (a DDP model, a DeepSpeed engine, an FSDP2 model) with its options, named as
    registered; else a plain module's (strategies.ddp.UnwrappedModule, registered as none); else None."""
    from zerolens.strategies.ddp import UnwrappedModule
    for registered in _REGISTRY.values():
        module, _, cls = registered.backend.partition(":")
        if registered.needs_deepspeed and not any(c.__module__.startswith("deepspeed") for c in type(trained).__mro__):
            continue  # a DeepSpeed backend would import DeepSpeed to say no
        strategy = getattr(importlib.import_module(module), cls).adopt(trained, optimizer, **registered.options)
        if strategy is not None:
            strategy.name = registered.name
            return strategy
    return UnwrappedModule.adopt(trained, optimizer)


def needing_deepspeed(strategies) -> list[str]:
    return [s for s in strategies if spec(s).needs_deepspeed]


def reading_grad_overflow_check(strategies) -> list[str]:
    return [s for s in strategies if spec(s).reads_grad_overflow_check]


def without_deepspeed() -> list[str]:
    return [s for s in _REGISTRY if not spec(s).needs_deepspeed]


def default_baseline(strategies: tuple[str, ...]) -> str:
    """The case study's baseline, DeepSpeed without ZeRO, when it runs; else the first strategy."""
    return BASELINE if BASELINE in strategies else strategies[0]


# --- The strategies zerolens knows -----------------------------------------------------------------
DDP = "zerolens.strategies.ddp:TorchDDP"
DEEPSPEED = "zerolens.strategies.deepspeed:DeepSpeedZero"
FSDP2 = "zerolens.strategies.fsdp2:TorchFSDP2"
DEEPSPEED_STEP_MODEL = "zerolens.strategies.deepspeed:DeepSpeedStepModel"
DDP_CODE = ("/torch/nn/parallel/",)  # its reducer is C++: its buckets are made at set-up and held (census)
DEEPSPEED_CODE = ("/deepspeed/",)
FSDP2_CODE = ("/torch/distributed/fsdp/",)

register(StrategySpec(
    name="ddp", backend=DDP, needs_deepspeed=False, paper_stage=0, shards_gradients=False, transient_code=DDP_CODE,
    step_model="zerolens.strategies.ddp:TorchDDPStepModel",
    parts_across_blocks="zerolens.strategies.ddp:buckets_across_blocks",
    description="torch DistributedDataParallel: fp32 weights, autocast, gradient buckets beside the gradients",
    layout=torch_ddp_layout, unpadded=lambda psi, n, e: (4 * psi, 4 * psi, 8 * psi, 4 * psi),
    communication=lambda psi, n, e: 2 * ring(4 * psi, n)))  # all-reduce of the fp32 gradients
register(StrategySpec(
    name="zero0", backend=DEEPSPEED, options={"stage": 0}, needs_deepspeed=True, paper_stage=0,
    shards_gradients=False, transient_code=DEEPSPEED_CODE, step_model=DEEPSPEED_STEP_MODEL, casts_weights=True,
    description="DeepSpeed without ZeRO (the case study's baseline)",
    not_depth_scaled="DeepSpeed without ZeRO cuts its flat buffers in pieces that do not repeat per block",
    layout=deepspeed_stage0_layout,
    unpadded=lambda psi, n, e: (e * psi, e * psi, ((4 if e == 2 else 0) + 8) * psi, 0),
    communication=lambda psi, n, e: 2 * ring(e * psi, n)))  # all-reduce of the 16-bit gradients
for stage in (1, 2):
    register(StrategySpec(
        name=f"zero{stage}", backend=DEEPSPEED, options={"stage": stage}, needs_deepspeed=True, paper_stage=stage,
        shards_gradients=True, flat_partition=True, reduce_bucket="every backward", transient_code=DEEPSPEED_CODE,
        step_model=DEEPSPEED_STEP_MODEL, reads_grad_overflow_check=True, casts_weights=True,
        description=f"DeepSpeed ZeRO-{stage}: " + ("optimizer states" if stage == 1 else "optimizer states and "
                                                   "gradients") + " partitioned",
        layout=deepspeed_flat_partition_layout,
        unpadded=lambda psi, n, e: (e * psi, e * psi / n, 12 * psi / n, 0),
        # Each reduce bucket all-reduced whole (stage_1_and_2.py: use_multi_rank_bucket_allreduce,
        # True by default), then the updated 16-bit weights all-gathered.
        communication=lambda psi, n, e: 3 * ring(e * psi, n)))
register(StrategySpec(
    name="zero3", backend=DEEPSPEED, options={"stage": 3}, needs_deepspeed=True, paper_stage=3,
    shards_gradients=True, reduce_bucket="whole run", keeps_small_params_whole=True, transient_code=DEEPSPEED_CODE,
    casts_weights=True,
    step_model="zerolens.strategies.deepspeed_stage3:DeepSpeedStage3StepModel",
    description="DeepSpeed ZeRO-3: parameters too", layout=deepspeed_stage3_layout,
    parts_across_blocks="zerolens.strategies.deepspeed_stage3:windows_across_blocks",
    not_compiled="not tried: DeepSpeed ZeRO-3 gathers each block's parameters in hooks around its forward, which "
                 "torch.compile of the block would have to trace; DeepSpeed compiles ZeRO-3 through its own "
                 "engine.compile(), which zerolens does not run",
    unpadded=lambda psi, n, e: (e * psi / n, e * psi / n, 12 * psi / n, 0),
    # 16-bit weights all-gathered in forward and again in backward; gradients reduce-scattered.
    communication=lambda psi, n, e: 3 * ring(e * psi, n)))
for name, reshard in (("fsdp2-grad", False), ("fsdp2", True)):
    register(StrategySpec(
        name=name, backend=FSDP2, options={"reshard_after_forward": reshard}, needs_deepspeed=False, paper_stage=3,
        shards_gradients=True, transient_code=FSDP2_CODE, step_model="zerolens.strategies.fsdp2:TorchFSDP2StepModel",
        casts_weights=True,
        description="PyTorch FSDP2, " + ("full sharding" if reshard else "parameters kept gathered from forward to "
                                         "backward (reshard_after_forward=False, like ZeRO-2)"),
        layout=fsdp2_layout, unpadded=lambda psi, n, e: (4 * psi / n, 4 * psi / n, 8 * psi / n, 0),
        # Weights all-gathered in the run's precision (again in backward when resharded), the
        # gradients reduce-scattered in fp32 (fsdp2.py's MixedPrecisionPolicy).
        communication=lambda psi, n, e, gathers=2 if reshard else 1: ring((gathers * e + 4) * psi, n)))

BASELINE = "zero0"  # verify's default baseline
VERIFY_DEFAULT = ("zero0", "zero2")  # the case study's comparison
BENCH_REFERENCE = "ddp"  # what bench compares every strategy with
BENCH_DEFAULT = ("ddp", "zero2")


def load_plugins() -> None:
    """Imports the modules named in ZEROLENS_PLUGINS (comma-separated), whose `register` calls add
    strategies; a module already imported is not imported again."""
    for module in filter(None, (m.strip() for m in os.environ.get("ZEROLENS_PLUGINS", "").split(","))):
        try:
            importlib.import_module(module)
        except Exception as e:  # the plugin's own error, whatever it is, in one line
            raise UserError(f"ZEROLENS_PLUGINS: cannot load {module}: {type(e).__name__}: {e}") from None
