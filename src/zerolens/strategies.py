"""One Strategy interface, one class per backend.

A Strategy wraps a single-device model for data parallelism, runs forward, backward and the
optimizer step, and says which tensors it holds for each memory component (`holdings`). It
knows where its backend keeps gradients: under ZeRO-1/2/3 `p.grad` is None after backward and
the rank's partition lives inside the optimizer.
"""
from __future__ import annotations

import abc
import contextlib
import io
from dataclasses import dataclass, field

import torch
from torch import nn

from .census import Holdings, MeasurementError, optimizer_state_tensors, required

STRATEGIES = ("ddp", "zero0", "zero1", "zero2", "zero3", "fsdp2-grad", "fsdp2")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True, kw_only=True)
class TrainSettings:
    """What every strategy trains with; the case study's settings by default."""
    precision: str  # fp16 | bf16 | fp32
    lr: float = 1e-4
    micro_batch: int = 8
    world_size: int = 2
    reduce_bucket_size: int = 50_000_000
    # DeepSpeed clips the global gradient norm to 1.0 unless told otherwise (0.19:
    # GRADIENT_CLIPPING_DEFAULT = 1.0), and the case study's config inherits that. We write it
    # into the DeepSpeed config and clip DDP the same way, or DDP's losses part from the rest.
    gradient_clipping: float = 1.0
    # torch's fused AdamW kernel (one launch for all parameters) for every strategy; the default,
    # foreach, is what the verify results were measured with.
    fused_adam: bool = False
    # A user's DeepSpeed config (--ds-config), used instead of the generated one, its "auto" values
    # filled from the generated one; checked against these settings in config.py.
    user_ds_config: dict = field(default_factory=dict)
    # Merged into the DeepSpeed config last (e.g. {"zero_optimization": {"overlap_comm": true}}).
    ds_override: dict = field(default_factory=dict)
    verbose: bool = False


def merged(base: dict, override: dict) -> dict:
    """`base` with `override` merged in, nested dictionaries key by key."""
    out = dict(base)
    for key, value in override.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def with_autos_filled(user: dict, ours: dict) -> dict:
    """A user's DeepSpeed config with every "auto" (Hugging Face's convention) replaced by the value
    at the same place in ours; an "auto" we have no value for is left out (DeepSpeed's default).
    Sections the user's config lacks that DeepSpeed needs to train (the optimizer, the batch sizes,
    the precision) come from ours."""
    def fill(u: dict, o: dict) -> dict:
        out = {}
        for key, value in u.items():
            if value == "auto":
                if key in o:
                    out[key] = o[key]
            elif isinstance(value, dict):
                out[key] = fill(value, o.get(key, {}) if isinstance(o.get(key), dict) else {})
            else:
                out[key] = value
        return out
    filled = fill(user, ours)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
                "bf16", "fp16", "gradient_clipping", "steps_per_print"):
        if key not in filled and key in ours:
            filled[key] = ours[key]
    return filled


def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in fp32 for a classifier ((B, C) logits, (B,) labels) and a language model
    ((B, T, V) logits, (B, T) labels) alike."""
    return nn.functional.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())


def scaled_step(scaler, optimizer: torch.optim.Optimizer, module: nn.Module, clipping: float) -> bool:
    """The optimizer step of the torch-native strategies: unscale, clip the global gradient norm as
    DeepSpeed does, step, zero. False when the (fp16) scaler skipped the step for inf/nan
    gradients, which is exactly when it lowers its scale."""
    scale_before = scaler.get_scale() if scaler.is_enabled() else None
    if clipping > 0:
        scaler.unscale_(optimizer)  # clip the true gradients
        nn.utils.clip_grad_norm_(module.parameters(), clipping)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return scale_before is None or scaler.get_scale() >= scale_before


def undo_wrapper_init_step(engine) -> str | None:
    """DeepSpeed's 16-bit optimizers without ZeRO (FP16_UnfusedOptimizer, FP16_Optimizer) run one
    step of the wrapped optimizer on zero gradients in their constructor (initialize_optimizer_states).
    For AdamW that sets its step counter to 1 before any training, so the first updates get the bias
    correction of later steps (about 0.74x, 0.86x, 0.91x of the update for a steady gradient), and
    weight decay shrinks the fp32 master weights once. ZeRO-1/2/3 take no such step. Where the
    wrapped optimizer holds state right after initialize (the behaviour, whatever the release), the
    state is cleared and the masters are copied again from the 16-bit weights they were made from.
    Returns the wrapper's name where this was done, else None."""
    wrapper, inner = engine.optimizer, engine.basic_optimizer
    if wrapper is inner or inner is None or not any(inner.state.values()):
        return None
    kind = type(wrapper).__name__
    with torch.no_grad():
        if kind == "FP16_UnfusedOptimizer":  # a fp32 master per parameter
            for low, high in zip(required(wrapper, "fp16_groups"), required(wrapper, "fp32_groups")):
                for p, master in zip(low, high):
                    master.copy_(p)
        elif kind == "FP16_Optimizer":  # one flat fp32 master per group
            for low, high in zip(required(wrapper, "fp16_groups_flat"), required(wrapper, "fp32_groups_flat")):
                high.copy_(low)
        else:
            raise MeasurementError(f"DeepSpeed's {kind} stepped its optimizer before training; zerolens does not "
                                   "know how to undo that for this wrapper")
    inner.state.clear()
    return kind


def loss_scale(optimizer) -> float:
    """The current fp16 loss scale of a DeepSpeed 16-bit optimizer (its attribute moved in 0.19)."""
    config = getattr(optimizer, "loss_scale_config", None)
    return float(required(config, "cur_scale") if config is not None else required(optimizer, "cur_scale"))


def loss_factor_of_backward(engine, params: list[torch.Tensor]) -> float:
    """By what factor engine.backward() multiplies the loss it is given: the gradient that reaches a
    zero-valued probe loss, built from every parameter. The probe's zero gradients are dropped."""
    probe = torch.stack([p.reshape(-1)[0].float() for p in params]).sum() * 0.0
    seen = []
    probe.register_hook(lambda grad: seen.append(float(grad)))
    engine.backward(probe)
    engine.optimizer.zero_grad(set_to_none=True)
    for p in params:
        p.grad = None
    if not seen:
        raise MeasurementError("engine.backward() of a probe loss did not reach the loss; cannot tell how "
                               "this DeepSpeed scales it")
    return seen[0]


class Strategy(abc.ABC):
    name: str

    @abc.abstractmethod
    def setup(self, model: nn.Module, device: torch.device) -> None:
        """Wrap the model (fp32, on the CPU) and build the optimizer."""

    @abc.abstractmethod
    def forward_loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def step(self) -> bool:
        """Optimizer step and zeroing of gradients; False if the step was skipped (fp16 overflow)."""

    @abc.abstractmethod
    def holdings(self) -> Holdings:
        """The tensors held now, per component."""

    @abc.abstractmethod
    def teardown(self) -> None: ...

    def describe(self) -> dict:
        """The backend settings, for config.json."""
        return {}

    def notes(self) -> list[str]:
        """What the user should know about how this backend was run (after setup)."""
        return []


class TorchDDP(Strategy):
    """torch DistributedDataParallel: fp32 weights, autocast to the run's precision, torch AdamW.

    DDP also keeps a second copy of the gradients in its buckets (gradient_as_bucket_view=False,
    the default); those live in C++ and are not counted here as gradients.
    """
    name = "ddp"

    def __init__(self, settings: TrainSettings):
        self.settings = settings

    def setup(self, model, device):
        self.device = device
        self.module = model.to(device)
        self.model = nn.parallel.DistributedDataParallel(
            self.module, device_ids=[device.index] if device.type == "cuda" else None)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=self.settings.lr,
                                           fused=self.settings.fused_adam or None)
        # DDP's gradient buckets live in C++; a communication hook is the public way to see them.
        # It does what the built-in hook does (average by all-reduce) and keeps a reference to
        # each bucket's flat buffer, which the reducer keeps for the life of the model anyway.
        self.bucket_buffers: dict[int, torch.Tensor] = {}
        self.model.register_comm_hook(None, self._allreduce_and_remember_bucket)
        self.autocast_dtype = DTYPES[self.settings.precision]
        # fp16 needs loss scaling to keep small gradients; bf16 and fp32 do not.
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.settings.precision == "fp16")

    def _allreduce_and_remember_bucket(self, state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        self.bucket_buffers[bucket.index()] = bucket.buffer()
        return allreduce_hook(None, bucket)

    def forward_loss(self, tokens, labels):
        with torch.autocast(self.device.type, dtype=self.autocast_dtype,
                            enabled=self.settings.precision != "fp32"):
            logits = self.model(tokens.to(self.device))
        return loss_of(logits, labels.to(self.device))

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def step(self):
        return scaled_step(self.scaler, self.optimizer, self.module, self.settings.gradient_clipping)

    def holdings(self):
        params = list(self.module.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        return Holdings(param=params, grad=grads,
                        optimizer_state=optimizer_state_tensors(self.optimizer),
                        comm_buffer=list(self.bucket_buffers.values()),
                        grad_partition_elements=sum(g.numel() for g in grads))

    def teardown(self):
        del self.model, self.module, self.optimizer, self.bucket_buffers

    def describe(self):
        return {"backend": "torch.nn.parallel.DistributedDataParallel",
                "optimizer": "torch.optim.AdamW" + (" (fused)" if self.settings.fused_adam else ""),
                "lr": self.settings.lr, "autocast": self.settings.precision,
                "gradient_clipping": self.settings.gradient_clipping,
                "gradient_as_bucket_view": False}


class DeepSpeedZero(Strategy):
    """DeepSpeed at ZeRO stage 0 (no ZeRO: the case study's baseline), 1, 2 or 3."""

    def __init__(self, stage: int, settings: TrainSettings):
        self.stage = stage
        self.name = f"zero{stage}"
        self.settings = settings

    def ds_config(self) -> dict:
        s = self.settings
        config = {
            "train_batch_size": s.micro_batch * s.world_size,
            "train_micro_batch_size_per_gpu": s.micro_batch,
            "gradient_accumulation_steps": 1,
            # torch_adam: the same AdamW update without FusedAdam's JIT build, which takes ~40 s
            # and crashes on TORCH_CUDA_ARCH_LIST values such as "9.0a" (DeepSpeed 0.19.8).
            "optimizer": {"type": "AdamW", "params": {"lr": s.lr, "torch_adam": True,
                                                      **({"fused": True} if s.fused_adam else {})}},
            "gradient_clipping": s.gradient_clipping,
            "steps_per_print": 1 << 30,
        }
        if s.precision != "fp32":
            config[s.precision] = {"enabled": True}
        if self.stage > 0:
            config["zero_optimization"] = {"stage": self.stage, "reduce_bucket_size": s.reduce_bucket_size,
                                           "reduce_scatter": True}
        if s.user_ds_config:
            config = with_autos_filled(s.user_ds_config, config)
            # The strategy decides the stage; the DeepSpeed config's own, if any, is replaced.
            config["zero_optimization"] = {**config.get("zero_optimization", {}), "stage": self.stage}
        return merged(config, s.ds_override)

    def setup(self, model, device):
        import deepspeed
        self.device = device
        self.module = model
        quiet = contextlib.nullcontext() if self.settings.verbose else contextlib.redirect_stdout(io.StringIO())
        with quiet:
            self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                        config=self.ds_config())
        self.undid_init_step = undo_wrapper_init_step(self.engine)
        self.scale_loss_ourselves = self._engine_forgets_fp16_loss_scale()

    def _engine_forgets_fp16_loss_scale(self) -> bool:
        """DeepSpeed 0.19's engine.backward() scales the loss only for ZeRO optimizers, yet with fp16
        and no ZeRO its FP16_(Unfused)Optimizer.step() divides the gradients by the loss scale
        (65536), so Adam sees gradients 65536x too small and the baseline trains slower (measured on
        2xH200: final loss 2.04 against 1.87 for DDP and ZeRO-1/2/3). DeepSpeed PR #8393 fixes it by
        scaling the loss in engine.backward(). Rather than trust a version number, we watch what
        engine.backward() does: a backward of a zero-valued probe loss, whose own gradient is the
        factor the engine multiplied it by. 1 where the scale is not 1: the engine forgets it, and
        we scale the loss ourselves (never twice: a release that scales it is seen to)."""
        from deepspeed.runtime.base_optimizer import ZeROOptimizer
        optimizer = self.engine.optimizer
        if not self.engine.fp16_enabled() or isinstance(optimizer, ZeROOptimizer):
            return False  # bf16 and fp32 need no scaling; ZeRO optimizers scale the loss themselves
        scale = loss_scale(optimizer)
        if scale == 1:
            return False  # nothing to tell apart, and nothing lost
        return loss_factor_of_backward(self.engine, [p for p in self.module.parameters() if p.requires_grad]) == 1

    def notes(self):
        notes = []
        user_stage = (self.settings.user_ds_config.get("zero_optimization") or {}).get("stage")
        if user_stage not in (None, "auto", self.stage):
            notes.append(f"{self.name}: --ds-config says stage {user_stage}; {self.name} runs stage {self.stage}")
        if getattr(self, "undid_init_step", None):  # known after setup
            notes.append(f"{self.name}: DeepSpeed's {self.undid_init_step} ran one optimizer step on zero gradients "
                         "when it was built (initialize_optimizer_states), so AdamW's first real update would use "
                         "the bias correction of its second; zerolens cleared that state and restored the fp32 master "
                         "weights, so that this baseline trains the same AdamW as the other strategies")
        if getattr(self, "cleared_kept_grads", False):
            notes.append(f"{self.name}: this DeepSpeed kept the 16-bit gradients after the step without ZeRO, so the "
                         "next backward would add to them (fixed by DeepSpeed PR #7839); zerolens cleared them after "
                         "each step, as later releases do")
        if getattr(self, "scale_loss_ourselves", False):
            notes.append(f"{self.name}: this DeepSpeed does not scale the fp16 loss in engine.backward() without ZeRO "
                         "but divides the gradients by the loss scale at step (DeepSpeed PR #8393); zerolens saw it "
                         "do so and scales the loss itself so that this baseline trains correctly")
        return notes

    def forward_loss(self, tokens, labels):
        logits = self.engine(tokens.to(self.device))
        return loss_of(logits, labels.to(self.device))

    def backward(self, loss):
        if self.scale_loss_ourselves:
            loss = loss * loss_scale(self.engine.optimizer)
        self.engine.backward(loss)

    def step(self):
        # Without autograd: DeepSpeed 0.18 builds ZeRO-1/2's flat parameter buffer from the parameters
        # without detaching it (stage_1_and_2.py, flatten_on_gpu; 0.19 adds .detach()), so the step's
        # all-gather into it fails on gloo ("Output 0 of Split is a view and is being modified
        # inplace"). Nothing in a step needs autograd; under 0.19 the bytes held, the losses and the
        # weights are bitwise the same with it and without.
        with torch.no_grad():
            self.engine.step()
        if self.engine.optimizer.__class__.__name__ == "FP16_UnfusedOptimizer" and any(
                p.grad is not None for p in self.module.parameters()):
            # DeepSpeed 0.17 zeroes 16-bit gradients after the step only under ZeRO (engine.py,
            # _take_model_step; fixed by DeepSpeed PR #7839), so without ZeRO the next backward adds to
            # the last step's gradients. Seen, not assumed from a version: cleared, as 0.18 does.
            for p in self.module.parameters():
                p.grad = None
            self.cleared_kept_grads = True
        return bool(self.engine.was_step_applied())

    def holdings(self):
        optimizer = self.engine.optimizer
        kind = type(optimizer).__name__
        params = list(self.module.parameters())
        model_grads = [p.grad for p in params if p.grad is not None]
        basic_state = optimizer_state_tensors(self.engine.basic_optimizer)

        def fp32_grads(tensors):
            return [t.grad for t in tensors if t.grad is not None]

        if kind == "DeepSpeedZeroOptimizer":  # stages 1 and 2
            masters = required(optimizer, "single_partition_of_fp32_groups")
            partitions = [g for g in required(optimizer, "averaged_gradients").values() if g is not None]
            partition_grads = [t for group in partitions for t in group]
            return Holdings(param=params, grad=model_grads + partition_grads + fp32_grads(masters),
                            optimizer_state=masters + basic_state, comm_buffer=reduce_buckets(optimizer),
                            grad_partition_elements=sum(t.numel() for t in partition_grads))
        if kind == "DeepSpeedZeroOptimizer_Stage3":
            # Partitioned parameters keep a 0-element p.data and their shard in p.ds_tensor.
            shards = [required(p, "ds_tensor") for p in params]
            masters = required(optimizer, "fp32_partitioned_groups_flat")
            grad_buffer = required(optimizer, "grad_partitions_flat_buffer")  # persistent, 1/N of the grads
            return Holdings(param=params + shards, grad=model_grads + [grad_buffer] + fp32_grads(masters),
                            optimizer_state=masters + basic_state, comm_buffer=reduce_buckets(optimizer),
                            grad_partition_elements=grad_buffer.numel())
        if kind == "FP16_UnfusedOptimizer":  # stage 0, fp16/bf16 with a torch optimizer
            masters = [t for group in required(optimizer, "fp32_groups") for t in group]
        elif kind == "FP16_Optimizer":  # stage 0, fp16 with FusedAdam
            masters = list(required(optimizer, "fp32_groups_flat"))
        elif kind == "BF16_Optimizer":  # stage 0 in bf16 under DeepSpeed 0.16 (theory.DeepSpeedLayout)
            masters = list(required(optimizer, "fp32_groups_flat_partition"))
            model_grads += list(required(optimizer, "fp32_groups_gradients_flat"))
        elif optimizer is self.engine.basic_optimizer:  # stage 0 in fp32: no wrapper
            masters = []
        else:
            raise MeasurementError(f"zerolens does not know where DeepSpeed's {kind} keeps gradients")
        grads = model_grads + fp32_grads(masters)
        return Holdings(param=params, grad=grads, optimizer_state=masters + basic_state, comm_buffer=[],
                        grad_partition_elements=sum(p.grad.numel() for p in params if p.grad is not None))

    def teardown(self):
        self.engine.destroy()
        del self.engine, self.module

    def describe(self):
        return {"backend": "deepspeed", "ds_config": self.ds_config()}


def reduce_buckets(optimizer) -> list[torch.Tensor]:
    """The flat reduce buckets of a ZeRO-1/2/3 optimizer (contiguous_gradients). DeepSpeed 0.17 and
    later: one bucket per communication dtype in `ipg_buckets`, whose `buffer` is a list under stage
    1/2 (emptied at the end of backward) and one tensor under stage 3 (kept). 0.16: stage 1/2 keep
    a list `ipg_buffer` (None outside backward), stage 3 one `__ipg_bucket_flat_buffer` (name-mangled);
    neither exists without contiguous_gradients, and then there is no flat bucket."""
    stage3 = type(optimizer).__name__ == "DeepSpeedZeroOptimizer_Stage3"
    if hasattr(optimizer, "ipg_buckets"):
        buckets = optimizer.ipg_buckets.values()
        if stage3:
            return [required(b, "buffer") for b in buckets]
        return [t for b in buckets for t in required(b, "buffer")]
    if not required(optimizer, "contiguous_gradients"):
        return []
    if stage3:
        return [required(optimizer, "_DeepSpeedZeroOptimizer_Stage3__ipg_bucket_flat_buffer")]
    return list(required(optimizer, "ipg_buffer") or [])


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks a model repeats: the children of every nn.ModuleList in it (the `encoder.layers`
    of an nn.TransformerEncoder, the `blocks` of a GPT), in order. Only the outermost lists count:
    a list inside a block (of experts, say) is sharded with its block. Blocks without parameters
    have nothing to shard and are left out."""
    blocks, inside_a_block = [], set()
    for module in model.modules():  # parents before children
        if isinstance(module, nn.ModuleList) and module not in inside_a_block:
            for block in module:
                if next(block.parameters(), None) is not None:
                    blocks.append(block)
                    inside_a_block.update(block.modules())
    return blocks


def fsdp_param_groups(state) -> list:
    """The parameter groups of one fully_shard call: a list in torch 2.13, one group or None in
    torch 2.11 (FSDPState in torch/distributed/fsdp/_fully_shard/_fsdp_state.py)."""
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = required(state, "_fsdp_param_group")
    return [] if group is None else [group]


class TorchFSDP2(Strategy):
    """PyTorch FSDP2 (torch.distributed.fsdp.fully_shard): every parameter sharded on dim 0 over the
    ranks, one FSDP group per repeated block (repeated_blocks) and one for the rest, the root.
    fp32 weights; in bf16/fp16 FSDP's MixedPrecisionPolicy gathers them in the run's precision and
    reduce-scatters the gradients in fp32. torch AdamW on the shards.

    reshard_after_forward=False ("fsdp2-grad") keeps a group's gathered parameters from its forward
    to its backward, like ZeRO-2's whole parameters; True ("fsdp2") frees them after forward and
    gathers them again in backward, like ZeRO-3. Between steps both hold the same: the shards.
    """

    def __init__(self, reshard_after_forward: bool, settings: TrainSettings):
        self.reshard_after_forward = reshard_after_forward
        self.name = "fsdp2" if reshard_after_forward else "fsdp2-grad"
        self.settings = settings

    def mixed_precision(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy
        if self.settings.precision == "fp32":
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=DTYPES[self.settings.precision], reduce_dtype=torch.float32)

    def setup(self, model, device):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        self.device = device
        self.module = model.to(device)
        # On CPU the mesh's collectives go through gloo, which has the all-gather and the
        # reduce-scatter FSDP2 calls (torch 2.13); a one-dimensional mesh over all ranks reuses
        # the default process group (device_mesh.py), so nothing is created per strategy.
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        options = dict(mesh=mesh, reshard_after_forward=self.reshard_after_forward,
                       mp_policy=self.mixed_precision())
        blocks = repeated_blocks(self.module)
        for block in blocks:  # bottom-up: a group takes the parameters no inner group has taken
            fully_shard(block, **options)
        fully_shard(self.module, **options)
        # FSDP's per-parameter records: the padded shard, and the gathered copy during forward/backward.
        self.root_state = fully_shard.state(self.module)
        self.fsdp_params = [fsdp_param for module in [*blocks, self.module]
                            for group in fsdp_param_groups(fully_shard.state(module))
                            for fsdp_param in required(group, "fsdp_params")]
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=self.settings.lr,
                                           fused=self.settings.fused_adam or None)
        # fp16 needs loss scaling; ShardedGradScaler all-reduces "found inf" over the ranks, since
        # each rank sees only its shard of the gradients. Disabled, it does nothing.
        self.scaler = ShardedGradScaler(device.type, enabled=self.settings.precision == "fp16")
        self.block_count = len(blocks)

    def forward_loss(self, tokens, labels):
        logits = self.module(tokens.to(self.device))
        return loss_of(logits, labels.to(self.device))

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def step(self):
        # The norm of DTensor gradients is reduced over the ranks: the global norm, as under DDP.
        return scaled_step(self.scaler, self.optimizer, self.module, self.settings.gradient_clipping)

    def holdings(self):
        from torch.distributed.tensor import DTensor

        def local(t):
            return t.to_local() if isinstance(t, DTensor) else t

        with torch.no_grad():
            # A shard is a view into its parameter's own buffer, padded to ceil(dim 0 / N) rows
            # (FSDPParam._init_sharded_param); the gradients of a group are views into one flat
            # buffer of the same padded sizes (foreach_reduce). Storages are counted whole.
            shards = [required(p, "sharded_param") for p in self.fsdp_params]
            params = [local(p) for p in shards]
            grads = [local(p.grad) for p in shards if p.grad is not None]
            state = [local(t) for t in optimizer_state_tensors(self.optimizer)]
        # Gathered parameters live in all_gather_outputs; FSDP resizes their storage to 0 when it
        # reshards, so they count only while gathered (after forward under fsdp2-grad).
        gathered = [t for p in self.fsdp_params for t in required(p, "all_gather_outputs")]
        return Holdings(param=params + gathered, grad=grads, optimizer_state=state,
                        comm_buffer=self._comm_buffers(), grad_partition_elements=sum(g.numel() for g in grads))

    def _comm_buffers(self) -> list[torch.Tensor]:
        """What FSDP2 keeps for its collectives from one op to the next (_fsdp_param_group.py): the
        last all-gather's flat output, until the next group's copy-in or the root's post-forward;
        reduce-scatter inputs, until the end of backward (_root_post_backward_final_callback).
        Between phases both are gone."""
        context = required(self.root_state, "_comm_ctx")
        if hasattr(context, "reduce_scatter_states"):  # torch 2.13: a list
            reduce_scatters = context.reduce_scatter_states
        else:  # torch 2.11: the last one, or None
            reduce_scatters = [s for s in [required(context, "reduce_scatter_state")] if s is not None]
        buffers = [required(s, "reduce_scatter_input") for s in reduce_scatters]
        gather = required(context, "all_gather_state")
        if gather is not None:
            buffers.append(gather.all_gather_result.all_gather_output)
        return buffers

    def teardown(self):
        del self.module, self.optimizer, self.scaler, self.fsdp_params, self.root_state

    def describe(self):
        return {"backend": "torch.distributed.fsdp.fully_shard (FSDP2)",
                "reshard_after_forward": self.reshard_after_forward,
                "groups": "one per repeated block (children of each nn.ModuleList), then the root",
                "mixed_precision": ("none: fp32" if self.settings.precision == "fp32" else
                                    f"param_dtype {self.settings.precision}, reduce_dtype fp32"),
                "optimizer": "torch.optim.AdamW" + (" (fused)" if self.settings.fused_adam else ""),
                "lr": self.settings.lr, "gradient_clipping": self.settings.gradient_clipping}

    def notes(self):
        if not self.block_count:
            return [f"{self.name}: the model has no nn.ModuleList of blocks, so FSDP2 shards it as one group "
                    "and gathers all its parameters at once"]
        return [f"{self.name}: FSDP2 shards each of the {self.block_count} blocks in the model's nn.ModuleLists as a "
                "group of its own, and the remaining parameters with the root"]


def make_strategy(name: str, settings: TrainSettings) -> Strategy:
    if name == "ddp":
        return TorchDDP(settings)
    if name in ("fsdp2", "fsdp2-grad"):
        return TorchFSDP2(reshard_after_forward=name == "fsdp2", settings=settings)
    if name in STRATEGIES:
        return DeepSpeedZero(int(name[-1]), settings)
    raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
