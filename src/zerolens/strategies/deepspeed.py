"""DeepSpeed at ZeRO stage 0 (no ZeRO), 1, 2 or 3, with what zerolens corrects in it."""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import json

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from zerolens.measure.census import Holdings, MeasurementError, optimizer_state_tensors, required
from zerolens.strategies.base import DTYPES, Strategy, TrainSettings, engine_inputs

# runtime/engine.py's MEMORY_OPT_ALLREDUCE_SIZE: stage 0's all-reduce buckets after backward close
# once they hold more than this many elements (allreduce_no_retain).
DEEPSPEED_ALLREDUCE_ELEMENTS = 500_000_000


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


class DeepSpeedZero(Strategy):
    """DeepSpeed at ZeRO stage 0 (no ZeRO: the case study's baseline), 1, 2 or 3."""

    def __init__(self, settings: TrainSettings, *, stage: int):
        self.stage = stage
        self.name = f"deepspeed-stage{stage}"  # the registry names it
        self.settings = settings

    @classmethod
    def adopt(cls, trained, optimizer, *, stage: int):
        """A user's DeepSpeed engine (its own optimizer; `optimizer` is not needed) at this ZeRO stage."""
        if not any(c.__name__ == "DeepSpeedEngine" for c in type(trained).__mro__):
            return None
        if trained.zero_optimization_stage() != stage:
            return None
        precision = "bf16" if trained.bfloat16_enabled() else "fp16" if trained.fp16_enabled() else "fp32"
        strategy = cls(TrainSettings(precision=precision, world_size=trained.world_size,
                                     grad_accum=trained.gradient_accumulation_steps(),
                                     reduce_bucket_size=int(trained.zero_reduce_bucket_size())), stage=stage)
        strategy.device, strategy.engine, strategy.module = trained.device, trained, trained.module
        return strategy

    def ds_config(self) -> dict:
        s = self.settings
        config = {
            "train_batch_size": s.micro_batch * s.world_size * s.grad_accum,
            "train_micro_batch_size_per_gpu": s.micro_batch,
            "gradient_accumulation_steps": s.grad_accum,
            # torch_adam: the same AdamW update without FusedAdam's JIT build, which takes ~40 s
            # and crashes on TORCH_CUDA_ARCH_LIST values such as "9.0a" (DeepSpeed 0.19.8).
            "optimizer": {"type": "AdamW", "params": {"lr": s.lr, "torch_adam": True,
                                                      **({"fused": True} if s.fused_adam else {})}},
            "gradient_clipping": s.gradient_clipping,
            "steps_per_print": 1 << 30,
        }
        if s.precision != "fp32":
            config[s.precision] = {"enabled": True, **(FP16_LOSS_SCALING if s.precision == "fp16" else {})}
        if self.stage > 0:
            config["zero_optimization"] = {"stage": self.stage, "reduce_bucket_size": s.reduce_bucket_size,
                                           "reduce_scatter": True}
        if s.user_ds_config:
            config = with_autos_filled(s.user_ds_config, config)
            # The strategy decides the stage; the DeepSpeed config's own, if any, is replaced.
            config["zero_optimization"] = {**config.get("zero_optimization", {}), "stage": self.stage}
        if s.precision == "bf16" and s.grad_overflow_check is not None:
            # Where the user's config sets it, flags.py made the run's setting agree with it
            config["bf16"] = {**config.get("bf16", {}), "check_grad_overflow": s.grad_overflow_check}
        return merged(config, s.ds_override)

    def setup(self, model, device):
        import deepspeed
        self.device = device
        self.module = model
        self.torch_linear = torch.nn.functional.linear  # ZeRO-3 replaces it (teardown)
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
        if getattr(self, "cast_inputs", False):
            notes.append(f"{self.name}: the batch's floating inputs were cast to {self.settings.precision}, the dtype "
                         "DeepSpeed runs the model in, as its users do (Hugging Face's Trainer among them)")
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
        dtype = DTYPES[self.settings.precision]
        self.cast_inputs = tokens.is_floating_point() and tokens.dtype != dtype
        logits = self.engine(engine_inputs(tokens, self.device, dtype))
        return self.loss(logits, labels.to(self.device))

    def backward(self, loss):
        if self.scale_loss_ourselves:
            loss = loss * loss_scale(self.engine.optimizer)
        self.engine.backward(loss)

    @contextlib.contextmanager
    def accumulating(self, sync):
        """DeepSpeed counts micro-batches itself (gradient_accumulation_steps), in engine.step(), which
        its users call after every backward: before the boundary it only counts."""
        yield
        if not sync:
            with torch.no_grad():
                self.engine.step()

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
            # Under gradient accumulation, the rank's reduced gradients summed so far, kept between the
            # micro-batches before the boundary (independent_gradient_partition_epilogue: views of ZeRO-2's
            # contiguous buffer, which it no longer names), where averaged_gradients is not set yet.
            accumulated = [t for group in getattr(optimizer, "all_grad_tensors", {}).values() if group
                           for t in group if t is not None]
            return Holdings(param=params, grad=model_grads + partition_grads + accumulated + fp32_grads(masters),
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
        elif kind == "BF16_Optimizer":  # stage 0 in bf16 under DeepSpeed 0.16 (layout.DeepSpeedLayout)
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
        # ZeRO-3 puts DeepSpeed's own torch.nn.functional.linear in place and leaves it there ("This will
        # persist unless manually reset", partition_parameters.py, 0.19), which saves other tensors for
        # backward: torch's goes back, so that a strategy after this one runs torch's in the same processes.
        torch.nn.functional.linear = self.torch_linear

    def reference_loop(self, model, device):
        """DeepSpeed's own loop: deepspeed.initialize with this strategy's config, then engine(...),
        engine.backward and engine.step for every micro-batch."""
        import deepspeed
        linear = torch.nn.functional.linear  # ZeRO-3 puts its own in and leaves it (teardown)
        quiet = contextlib.nullcontext() if self.settings.verbose else contextlib.redirect_stdout(io.StringIO())
        with quiet:
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=self.ds_config())
        dtype = DTYPES[self.settings.precision]

        def step(micro_batches):
            losses = []
            for tokens, labels in micro_batches:
                loss = self.loss(engine(engine_inputs(tokens, device, dtype)), labels.to(device))
                losses.append(loss.detach())
                engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself
                engine.step()
            return losses

        def teardown():
            engine.destroy()
            torch.nn.functional.linear = linear
        return step, teardown, "deepspeed.initialize, engine.backward, engine.step"

    def describe(self):
        return {"backend": "deepspeed", "ds_config": self.ds_config()}


# DeepSpeed's fp16 loss-scaling defaults (runtime/constants.py, FP16_*_DEFAULT), written out in zerolens's own
# config so that every release scales alike: 0.17.1 and later apply them whatever the section says, earlier
# releases only where the section names one of them. Without, 0.16.9's ZeRO-1/2 start at a loss scale of
# 2**32 (its DynamicLossScaler's own default), where stage 0 starts at 2**16: on the case study in fp16 their
# first 15 steps overflowed and were skipped (docs/results/1xh100/issue22/fp16-releases/).
FP16_LOSS_SCALING = {"initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                     "consecutive_hysteresis": False, "min_loss_scale": 1}
# From 0.17.1 every optimizer is given them (precision_config.py), and an overflowed step empties ZeRO-1/2's
# averaged_gradients in place; before, it put a new dict there, and each parameter's _hp_mapping kept the old
# one with that step's gradients.
LOSS_SCALING_ALWAYS_GIVEN = (0, 17, 1)


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


# A DeepSpeed config of the user's own (--ds-config, --ds-override) and the step models: what in it
# they read, what allocates nothing on the GPU during a step, and, for everything else, the value they
# assume (zerolens's own config's). Any other key or value leaves the run unpredicted, said by name.
ALLOCATES_NOTHING = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                     "scheduler", "gradient_clipping", "steps_per_print", "wall_clock_breakdown", "tensorboard",
                     "wandb", "csv_monitor", "comet", "zero_allow_untested_optimizer", "dump_state"}
# The precision sections' keys that allocate nothing the step models miss: loss scaling, and bf16's
# overflow check, which ZeRO-1/2's step model follows per release (zero12_overflow_check).
LOSS_SCALING = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                "consecutive_hysteresis", "min_loss_scale", "check_grad_overflow"}
# zero_optimization fields (DeepSpeedZeroConfig's names) the step models read, or that change
# nothing they allocate (checkpoint saving and loading, logging, a stage's settings at other stages).
ZERO_FIELDS_READ = {
    0: None,  # without ZeRO the section is not read
    1: {"stage", "reduce_bucket_size"},
    2: {"stage", "reduce_bucket_size"},
    3: {"stage", "reduce_bucket_size", "sub_group_size", "prefetch_bucket_size", "max_live_parameters",
        "max_reuse_distance", "param_persistence_threshold"},
}
ZERO_FIELDS_INERT = {"elastic_checkpoint", "load_from_fp32_weights", "gather_16bit_weights_on_model_save",
                     "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters",
                     "log_trace_cache_warnings", "pipeline_loading_checkpoint", "enable_sanity_checks"}
ZERO_FIELDS_OF_STAGE3 = {"sub_group_size", "prefetch_bucket_size", "max_live_parameters", "max_reuse_distance",
                         "param_persistence_threshold", "model_persistence_threshold", "allgather_sequential",
                         "module_granularity_threshold", "use_all_reduce_for_fetch_params", "leaf_module",
                         "override_module_apply", "memory_efficient_linear", "zero_quantized_nontrainable_weights"}


def brief(value):
    """An offload section by its device alone (the rest is DeepSpeed's defaults, filled in)."""
    return {"device": value["device"]} if isinstance(value, dict) and "device" in value else value


def without_offload_to_none(section: dict) -> dict:
    """A parsed zero_optimization section with each offload to device "none" as no offload."""
    return {k: None if isinstance(v, dict) and str(v.get("device")).rsplit(".", 1)[-1] == "none" else v
            for k, v in section.items()}


def zero_config(config: dict):
    """The zero_optimization section as DeepSpeed reads it (DeepSpeedZeroConfig: its defaults,
    aliases such as stage3_prefetch_bucket_size, and overlap_comm's stage-dependent default)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    return DeepSpeedZeroConfig(**config.get("zero_optimization", {}))


def not_modelled(settings: TrainSettings, stage: int) -> list[str]:
    """What in the run's DeepSpeed config (the user's, filled and overridden as the run will use
    it) the step model of `stage` does not model, as "key: value"; empty without a config of the
    user's own. Gradient accumulation is modelled at every stage (DeepSpeedStepModel.accumulating;
    ZeRO-3: DeepSpeedStage3StepModel, whose micro-batches each reduce into the gradient partitions)."""
    if not (settings.user_ds_config or settings.ds_override):
        return []
    if importlib.util.find_spec("deepspeed") is None:  # reading the config takes DeepSpeed's own parser
        return ["a DeepSpeed config (reading it needs DeepSpeed installed)"]
    from zerolens.compat import installed_version
    plain = dataclasses.replace(settings, user_ds_config={}, ds_override={})
    ours, theirs = DeepSpeedZero(plain, stage=stage).ds_config(), DeepSpeedZero(settings, stage=stage).ds_config()
    out = []
    for key, value in theirs.items():
        if key in ALLOCATES_NOTHING or key == "zero_optimization" or value == ours.get(key):
            continue
        if key == "optimizer":
            params = value.get("params", {})
            if str(value.get("type", "")).lower() not in ("adam", "adamw"):
                out.append(f"optimizer.type: {value.get('type')}")
            if params.get("torch_adam") is not True:
                out.append("optimizer.params.torch_adam: not true (DeepSpeed's own FusedAdam)")
            if bool(params.get("fused", False)) != settings.fused_adam:
                out.append(f"optimizer.params.fused: {params.get('fused')} (the run's --fused-adam is "
                           f"{settings.fused_adam})")
        elif key in ("fp16", "bf16") and isinstance(value, dict):
            out += [f"{key}.{k}: {v}" for k, v in value.items() if k not in LOSS_SCALING]
        elif key == "communication_data_type" and value == {"fp16": "fp16", "bf16": "bf16"}.get(settings.precision,
                                                                                                 "fp32"):
            continue
        elif (key, value) in (("prescale_gradients", False), ("gradient_predivide_factor", 1.0)):
            continue
        else:
            out.append(f"{key}: {json.dumps(value)}")
    if stage in (1, 2) and unnamed_loss_scaling_kept_gradients(theirs, installed_version("deepspeed")):
        out.append("fp16 without a loss-scaling setting under DeepSpeed before 0.17.1 (ZeRO-1/2 then start at a "
                   "loss scale of 2**32 and keep the gradients of the first step that overflows; "
                   '"initial_scale_power": 16 starts them as later releases do)')
    read = ZERO_FIELDS_READ[stage]
    if read is not None:
        mine, yours = (without_offload_to_none(zero_config(c).model_dump()) for c in (ours, theirs))
        ignored = read | ZERO_FIELDS_INERT | (set() if stage == 3 else ZERO_FIELDS_OF_STAGE3)
        out += [f"zero_optimization.{k}: {json.dumps(brief(yours[k]), default=str)}" for k in yours
                if k not in ignored and yours[k] != mine.get(k)]
    return out


def unnamed_loss_scaling_kept_gradients(config: dict, version: str | None) -> bool:
    """Whether DeepSpeed `version`'s ZeRO-1/2 start the fp16 loss scale at 2**32 under `config` (an fp16
    section naming none of FP16_LOSS_SCALING's keys, a release before LOSS_SCALING_ALWAYS_GIVEN), so that
    their first steps overflow and the first one's gradients stay allocated (docs/versions.md)."""
    from zerolens.compat import patch_release
    section = config.get("fp16")
    return (version is not None and patch_release(version) < LOSS_SCALING_ALWAYS_GIVEN and isinstance(section, dict)
            and section.get("enabled") is True and not set(section) & set(FP16_LOSS_SCALING))


# Where DeepSpeed's ZeRO-1/2 gradient overflow check changed, read from each release's stage_1_and_2.py,
# engine.py and precision_config.py: from 0.17.1 bf16 runs check as bf16.check_grad_overflow says (before,
# fp16 runs only: `if self.dtype == torch.float16`); from 0.19.3 it defaults to true (DeepSpeed PR 8035);
# from 0.19.6 each gradient is reduced to scalars (runtime/utils.py has_inf_or_nan) instead of masked.
BF16_CHECK_READ = (0, 17, 1)
BF16_CHECK_ON_BY_DEFAULT = (0, 19, 3)
CHECK_BY_SCALARS = (0, 19, 6)


def zero12_overflow_check(settings: TrainSettings, version: str | None) -> str | None:
    """How ZeRO-1/2's step checks the gradients of the rank's slice for inf and NaN under DeepSpeed
    `version` (the installed one; the newest modelled where it is none): None where it checks nothing;
    "masks" (before 0.19.6, _has_inf_or_nan: an fp32 copy of each gradient in turn, its isnan, isinf and
    logical_or masks and a float copy of that, up to 11 bytes per element of the largest); "scalars"
    (0.19.6 on: amax and amin, each tested with isfinite). fp16 runs always check, fp32 runs never, bf16
    runs as BF16_CHECK_READ and BF16_CHECK_ON_BY_DEFAULT say (engine._configure_zero_optimizer)."""
    from zerolens.compat import patch_release
    release = patch_release(version) if version else CHECK_BY_SCALARS
    if settings.precision == "fp32" or (settings.precision == "bf16" and release < BF16_CHECK_READ):
        return None
    if settings.precision == "bf16":
        config = DeepSpeedZero(settings, stage=1).ds_config()
        section = config.get("bf16") or config.get("bfloat16") or {}
        value = section.get("check_grad_overflow") if isinstance(section, dict) else None
        if not (value if isinstance(value, bool) else release >= BF16_CHECK_ON_BY_DEFAULT):  # "auto", unset
            return None
    return "masks" if release < CHECK_BY_SCALARS else "scalars"


def has_inf_or_nan(grad: torch.Tensor, check: str) -> torch.Tensor:
    """DeepSpeedZeroOptimizer._has_inf_or_nan of one gradient, allocating as the release does (`check`:
    zero12_overflow_check's "masks" or "scalars")."""
    if check == "scalars":  # runtime/utils.py has_inf_or_nan
        return torch.isfinite(grad.amax()).logical_and(torch.isfinite(grad.amin())).logical_not()
    float_x = grad.float()
    nan = float_x.isnan()
    inf = float_x.isinf()
    inf_or_nan = nan.logical_or(inf)
    return inf_or_nan.float().max()


def torch_adamw(params, settings: TrainSettings, cuda: bool) -> torch.optim.Optimizer:
    """torch's AdamW as DeepSpeed builds it with torch_adam, for the step models: foreach on CUDA
    (torch's default there, which the CPU would not pick when a CUDA run is traced on it), unless
    fused."""
    fused = settings.fused_adam
    return torch.optim.AdamW(params, lr=settings.lr, fused=fused or None, **({} if fused else {"foreach": cuda}))


class DeepSpeedStepModel(Strategy):
    """What DeepSpeed at ZeRO stage 0, 1 or 2 allocates on one rank, without a process group, for
    the peak prediction (predict/peak.py). Read from DeepSpeed 0.19's source:

    - stage 0, 16-bit (FP16_UnfusedOptimizer, runtime/fp16/unfused_optimizer.py): 16-bit weights,
      an fp32 master per parameter; backward leaves 16-bit gradients and ends by all-reducing them
      through flat copies of about 5e8 elements at a time (_allreduce_in_buckets); the step makes
      an fp32 copy of every gradient, clips, steps AdamW on the masters, drops the copies, writes
      the weights. fp32: the torch optimizer on the weights themselves.
    - stage 1/2 (DeepSpeedZeroOptimizer, runtime/zero/stage_1_and_2.py): 16-bit weights as views of
      one flat buffer padded to the partition layout (layout.zero_partition_layout), an fp32 master
      of the rank's slice. At the first gradient backward allocates the reduce bucket (setup_buckets:
      reduce_bucket_size elements). Stage 2 copies each gradient into it as it is made, stage 1
      every gradient at backward's end in the parameters' order, dropping each gradient copied
      (one larger than the bucket is reduced where it is); a full bucket is reduced through a flat
      copy and the rank's share copied to its gradient buffer (the gradients of the parameters that
      overlap the slice, allocated at the first reduction holding one of them). The bucket is
      released by backward's end. The step checks the slice's gradients for inf and NaN where the
      release and precision do (zero12_overflow_check: an fp32 copy and masks of one gradient at a
      time, or scalars), takes the norm (an fp64 copy of
      one gradient at a time), flattens the slice's gradients (16-bit) and converts them to fp32,
      frees the gradient buffer, steps AdamW on the fp32 slice, drops its gradient, and writes the
      16-bit slice (the all-gather writes into the flat buffer in place).

    Under gradient accumulation (`accumulating`), in the micro-batches before the boundary: stage 0
    leaves the 16-bit gradients in p.grad, where autograd adds up the next ones, and reduces nothing
    (engine.allreduce_gradients: only at the boundary). Stage 1 reduces nothing either, but the
    bucket its first gradient set up (setup_buckets) stays until the boundary's backward has
    reduced into it (_release_ipg_buffers runs only in independent_gradient_partition_epilogue).
    Stage 2 reduces every micro-batch; at backward's end (independent_gradient_partition_epilogue)
    the first micro-batch's gradient buffer is kept as the sum (all_grad_tensors: views of it), and
    each later micro-batch allocates a new one, adds it into the sum in place and drops it. The
    step's gradients are the sum's views (averaged_gradients). engine.step() before the boundary
    only counts.

    Under ZeRO-1/2 ranks differ only in their gradient buffer (its size, and the reduction that
    makes it), the norm's fp64 copies of their slice's pieces and the last rank's padding. The
    trace of one rank stands for all (predict/peak.py, spliced_ranks): those allocations are made
    inside `rank_own` brackets, which `mark` records in the allocation sequence, and `rank_requests`
    says what any rank allocates and frees in each.
    """

    mark = None  # set by a trace that records brackets: mark(action, label, payload)

    def __init__(self, settings: TrainSettings, *, rank: int, cuda: bool, stage: int):
        if stage not in (0, 1, 2):
            raise ValueError(f"no step model for ZeRO-{stage}")
        from zerolens.compat import installed_version
        self.settings, self.rank, self.cuda, self.stage = settings, rank, cuda, stage
        self.dtype = DTYPES[settings.precision]
        self.overflow_check = zero12_overflow_check(settings, installed_version("deepspeed")) if stage else None
        # The bytes of each flat copy a collective reduces, in order (a gloo run's thread may free one
        # late: predict/peak.py, checks.py).
        self.collective_buffer_sizes: list[int] = []

    def setup(self, model, device):
        from zerolens.strategies.layout import flat_offsets, zero_rank_partition
        self.device = device
        with torch.no_grad():
            # The engine casts the whole model; the optimizer has the parameters that train (a frozen
            # one, a LoRA base, has no gradient, master or partition: it stays a 16-bit tensor of its
            # own). Below, ZeRO-1/2 make the trained ones views of their flat buffer.
            params = [p for p in model.parameters() if p.requires_grad]
            for p in model.parameters():
                if self.stage == 0 or not p.requires_grad:
                    p.data = p.data.to(self.dtype)
            if self.stage == 0:
                self.params = params
                self.masters = [p.detach().float() for p in params] if self.dtype != torch.float32 else params
                self.opt = torch_adamw(self.masters, self.settings, self.cuda)
            else:
                numels = [p.numel() for p in params]
                part = zero_rank_partition(numels, self.settings.world_size, self.rank)
                self.partition = part
                flat = torch.empty(part.partition_elements * self.settings.world_size, dtype=self.dtype, device=device)
                offset = 0
                for p, n in zip(params, numels):
                    p.data = flat[offset:offset + n].view(p.shape)
                    offset += n
                self.flat, self.params = flat, params
                # .clone().float(), as DeepSpeed makes it: a copy even in fp32.
                self.master = flat[part.start:part.start + part.partition_elements].clone().float()
                self.opt = torch_adamw([self.master], self.settings, self.cuda)
                self.numels = numels
                self.offsets = offsets = flat_offsets(tuple(numels))  # each parameter's place in the flat buffer
                self.param_index = {id(p): i for i, p in enumerate(params)}
                self.in_partition = [params[i] for i in part.overlapping_params]
                self.in_partition_ids = {id(p) for p in self.in_partition}
                self.first_param_offset = offsets[part.overlapping_params[0]] if part.overlapping_params else 0
        self.module = model
        self.grads_in_partition = None  # this backward's gradient buffer (copy_grads_in_partition)
        self.summed_grads = None  # the rank's gradients summed over the step's micro-batches so far
        self.bucket = None
        self.boundary = True  # whether this micro-batch ends the step's accumulation (`accumulating`)

    def forward_loss(self, tokens, labels):
        return self.loss(self.module(engine_inputs(tokens, self.device, self.dtype)), labels.to(self.device))

    @contextlib.contextmanager
    def accumulating(self, sync):
        """A micro-batch, the boundary where `sync` (engine.is_gradient_accumulation_boundary). engine.step()
        after a micro-batch before the boundary allocates nothing (it only counts), so it is not modelled."""
        self.boundary = sync
        try:
            yield
        finally:
            self.boundary = True

    def backward(self, loss):
        if self.stage == 0:
            loss.backward()
            if self.boundary:  # engine.allreduce_gradients: only at the boundary
                self._allreduce_in_buckets()
            return
        self.bucket_used = 0
        self.pending: list[torch.Tensor] = []
        # Stage 2 reduces each gradient as it is made. Stage 1 (overlap_comm off, DeepSpeed's default
        # below stage 3) only sets the bucket up at the first gradient (process_gradients ->
        # setup_buckets) and keeps every gradient until backward's end, where reduce_gradients
        # reduces them in the parameters' order, at the boundary only (engine.allreduce_gradients):
        # before it the gradients stay, and autograd adds the next micro-batch's into them.
        hook = self._into_bucket if self.stage == 2 else self._bucket_at_first_gradient
        hooks = [p.register_post_accumulate_grad_hook(hook) for p in self.params]
        loss.backward()
        for h in hooks:
            h.remove()
        if self.stage == 1 and not self.boundary:
            return  # the bucket stays (_release_ipg_buffers runs in the epilogue, at the boundary)
        if self.stage == 1:
            for p in self.params:
                if p.grad is not None:
                    self._into_bucket(p)
        self._reduce_bucket()
        self._gradient_partition_epilogue()

    def _gradient_partition_epilogue(self) -> None:
        """independent_gradient_partition_epilogue, after its last reduction: the first backward of a
        step keeps its gradient buffer as the sum (all_grad_tensors, views of it; averaged_gradients at
        the boundary); a later one adds its buffer into the sum in place (accumulated_grad.add_).
        _release_ipg_buffers then frees the bucket; a later backward's buffer goes after it, with its
        last views (avg_new, p.grad) as the function returns."""
        self.bucket = None
        with self.rank_own("grad-buffer-epilogue"):
            if self.summed_grads is None:
                self.summed_grads = self.grads_in_partition
            elif self.grads_in_partition is not None:
                self.summed_grads.add_(self.grads_in_partition)
            self.grads_in_partition = None

    @classmethod
    def not_modelled(cls, settings: TrainSettings, *, stage: int) -> list[str]:
        return not_modelled(settings, stage)

    @classmethod
    def release_not_modelled(cls, settings: TrainSettings, *, stage: int) -> str | None:
        """Stage 0 in bf16 under DeepSpeed 0.16 goes through its BF16_Optimizer (layout.DeepSpeedLayout),
        whose step this model, of 0.17 to 0.19's FP16_UnfusedOptimizer, does not follow: under 0.16.9 on
        CPU the step's predicted peak was 22% above the measured one. Measured as modelled on the CPU: 0.16.9
        (ZeRO-1, 2 and 3), 0.17.6 and 0.18.9 (every stage; docs/results/deepspeed-compat/issue22/), and 0.19.8."""
        from zerolens.compat import installed_version
        from zerolens.strategies.layout import deepspeed_layout
        version = installed_version("deepspeed")
        if (stage == 0 and settings.precision == "bf16" and version
                and deepspeed_layout(version).stage0_bf16_wrapper == "BF16_Optimizer"):
            return (f"DeepSpeed {version} trains bf16 without ZeRO through its BF16_Optimizer, whose step the step "
                    "model (DeepSpeed 0.17 to 0.19's) does not follow")
        return None

    def _bucket_at_first_gradient(self, p) -> None:
        """setup_buckets, at the first gradient: the reduce bucket of reduce_bucket_size elements (a
        user's DeepSpeed config's, where it sets one: config.deepspeed_zero_setting)."""
        if self.bucket is None:
            self.bucket = torch.empty(self.settings.reduce_bucket_size, dtype=self.dtype, device=self.device)

    def _allreduce_in_buckets(self) -> None:
        """Stage 0 after backward (engine._backward_epilogue -> allreduce_gradients ->
        buffered_allreduce_fallback, runtime/engine.py): the gradients in the module's parameter
        order, in buckets each closed once it holds more than MEMORY_OPT_ALLREDUCE_SIZE elements,
        each flattened into a new tensor (the communication dtype is the gradients' own), all-reduced
        in place, copied back into the gradients and dropped."""
        with torch.no_grad():
            bucket, elements = [], 0
            for p in self.params:
                if p.grad is None:  # _get_gradients_for_reduction: zeros, so every rank reduces alike
                    p.grad = torch.zeros_like(p)
                bucket.append(p.grad)
                elements += p.grad.numel()
                if elements > DEEPSPEED_ALLREDUCE_ELEMENTS:
                    self._allreduce_and_copy(bucket)
                    bucket, elements = [], 0
            if bucket:
                self._allreduce_and_copy(bucket)

    def _allreduce_and_copy(self, bucket: list[torch.Tensor]) -> None:
        flat = _flatten_dense_tensors(bucket)
        self.collective_buffer_sizes.append(flat.nbytes)
        for grad, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            grad.copy_(synced)

    def _into_bucket(self, p) -> None:
        with torch.no_grad():
            self._bucket_at_first_gradient(p)
            if self.bucket_used + p.numel() > self.bucket.numel():
                self._reduce_bucket()
            self.pending.append(p)
            if p.numel() > self.bucket.numel():
                # A gradient larger than the bucket stays where it is (extra_large_param_to_reduce), reduced
                # by the next reduce_ipg_grads: the next gradient's hook (its count fills the bucket) or backward's end.
                self.bucket_used += p.numel()
                return
            self.bucket[self.bucket_used:self.bucket_used + p.numel()].copy_(p.grad.reshape(-1))
            self.bucket_used += p.numel()
            p.grad = None

    def _reduce_bucket(self) -> None:
        """reduce_ipg_grads: average_tensor cuts the bucket's gradients into slices, one per rank's
        stretch (consecutive pieces for the same rank merged), and all-reduces them in groups
        (use_multi_rank_bucket_allreduce -> allreduce_and_scatter: a group closes once it holds more
        than reduce_bucket_size elements), each through a flat copy (allreduce_bucket: self.flatten, a
        new tensor, dropped once the reduced values are copied back), but a group of one slice, which
        _flatten_dense_tensors returns as a view of it (a bucket whose gradients all belong to one
        rank's stretch, or one larger than the bucket: no copy); then the gradients of the parameters
        in the rank's partition go into its gradient buffer (copy_grads_in_partition, which makes the
        buffer at its first call: at the first reduction holding such a parameter)."""
        slices = self._slices_per_rank()
        group: list[int] = []
        for i, elements in enumerate(slices):
            group.append(elements)
            if sum(group) > self.settings.reduce_bucket_size or i == len(slices) - 1:
                if len(group) > 1:
                    flat = torch.empty(sum(group), dtype=self.dtype, device=self.device)
                    self.collective_buffer_sizes.append(flat.nbytes)
                    del flat
                else:  # gloo's thread holds the view, so the storage under it, which it may free late
                    large = len(self.pending) == 1 and self.pending[0].numel() > self.bucket.numel()
                    self.collective_buffer_sizes.append(self.pending[0].grad.nbytes if large else self.bucket.nbytes)
                group = []
        self.collective_buffer_sizes += [n * self.dtype.itemsize for n in slices]  # gloo's copies of the slices
        with self.rank_own("grad-buffer", tuple(self.param_index[id(p)] for p in self.pending)):
            if self.grads_in_partition is None and any(id(p) in self.in_partition_ids for p in self.pending):
                self.grads_in_partition = torch.empty(self.partition.grad_buffer_elements, dtype=self.dtype,
                                                      device=self.device)
        for p in self.pending:  # an extra-large gradient: copied into the buffer (copy_grads_in_partition) or cleared
            p.grad = None
        self.bucket_used, self.pending = 0, []

    def _slices_per_rank(self) -> list[int]:
        """The elements of each stretch of the bucket that one rank's partition receives, the bucket's
        gradients in the order they came (average_tensor's rank_and_offsets, consecutive pieces for
        the same rank merged): a gloo reduce holds a copy of each, which gloo's thread may free late."""
        size = self.partition.partition_elements
        runs: list[list[int]] = []  # [rank, elements]
        for p in self.pending:
            start = self.offsets[self.param_index[id(p)]]  # its place in the flat buffer
            for rank in range(start // size, (start + p.numel() - 1) // size + 1):
                piece = min(start + p.numel(), (rank + 1) * size) - max(start, rank * size)
                if runs and runs[-1][0] == rank:
                    runs[-1][1] += piece
                else:
                    runs.append([rank, piece])
        return [elements for _, elements in runs]

    def step(self):
        with torch.no_grad():
            if self.stage == 0:
                grads = [p.grad for p in self.params]
                for g in grads:  # the norm, one fp32 copy at a time
                    torch.linalg.vector_norm(g.float())
                if self.masters is not self.params:
                    for m, g in zip(self.masters, grads):
                        m.grad = g.to(torch.float32)
                for m in self.masters:
                    m.grad.mul_(1.0)  # unscale and clip, in place
                self.opt.step()
                for m, p in zip(self.masters, self.params):
                    m.grad = None
                    if m is not p:
                        p.copy_(m)
                for p in self.params:
                    p.grad = None
                return True
            part = self.partition
            # The slice's gradients (averaged_gradients): views of the buffer, trimmed to the slice
            # (the buffer holds the parameters that straddle its ends whole), the last rank's padded.
            lead = part.start - self.first_param_offset
            inside = part.partition_elements - part.padding_elements
            views, offset = [], 0
            for p in self.in_partition:
                start, end = max(offset, lead), min(offset + p.numel(), lead + inside)
                views.append(self.summed_grads[start:end])
                offset += p.numel()
            if self.overflow_check:  # check_overflow -> has_overflow -> has_overflow_partitioned_grads_serial
                invalid_grad_count = torch.zeros([1], dtype=torch.float, device=self.device)
                with self.rank_own("overflow-check"):
                    for view in views:
                        invalid_grad_count += has_inf_or_nan(view, self.overflow_check)
                    view = None
                overflow = invalid_grad_count.bool()
                del invalid_grad_count
                overflow_gpu = overflow.byte()  # then all-reduced in place (MAX) and read: .item()
                del overflow, overflow_gpu
            with self.rank_own("norms"):
                # get_grad_norm_direct: each piece's norm from an fp64 copy (get_norm_dtype: fp64 wherever
                # the device has it; 0.16 to 0.18: .double()), one at a time, the norms kept (all_norms)
                # and combined; the list goes as the function returns.
                all_norms = []
                for view in views:
                    all_norms.append(torch.linalg.vector_norm(view.to(torch.float64)))
                view = None  # the loop's last view would keep the gradient buffer alive
                total_norm = torch.stack(all_norms).pow(2).sum().float()
                del all_norms, total_norm
            with self.rank_own("padding"):
                padding = [torch.zeros(part.padding_elements, dtype=self.dtype, device=self.device)] \
                    if part.padding_elements else []
            flat16 = torch.cat(views + padding)  # flatten_dense_tensors_aligned: a new tensor
            grad32 = flat16.to(torch.float32)
            del flat16
            with self.rank_own("padding-free"):
                del views, padding
            with self.rank_own("grad-buffer-free"):
                self.summed_grads = None
            self.master.grad = grad32
            grad32.mul_(1.0)  # unscale and clip, in place
            del grad32
            self.opt.step()
            self.master.grad = None
            self.flat[part.start:part.start + part.partition_elements].copy_(self.master)
        return True

    def holdings(self):
        return Holdings()

    def teardown(self):
        pass

    @contextlib.contextmanager
    def rank_own(self, label: str, payload=None):
        """Allocations that differ between ranks, bracketed for a trace that records them (`mark`)."""
        if self.mark:
            self.mark("begin", label, payload)
        yield
        if self.mark:
            self.mark("end", label, None)

    def rank_requests(self, rank: int):
        """What rank `rank` allocates and frees inside each `rank_own` bracket, as a function of the
        bracket's label and payload and a dict it keeps between brackets: a list of (action, name, bytes),
        a name alive once at a time. The same statements as the brackets' own, sized for that rank. The
        function's `alike` is what they follow from: ranks whose functions have equal ones make the same
        requests (at thousands of ranks most slices lie inside one parameter, alike but for where:
        peak.spliced_ranks walks the brackets once for them)."""
        from zerolens.strategies.layout import zero_rank_partition
        part = zero_rank_partition(self.numels, self.settings.world_size, rank)
        size = self.dtype.itemsize
        overlapping = set(part.overlapping_params)
        first = part.overlapping_params[0] if part.overlapping_params else 0
        lead = part.start - self.offsets[first]
        inside = part.partition_elements - part.padding_elements
        pieces, offset = [], 0
        for i in part.overlapping_params:
            n = self.numels[i]
            pieces.append(min(offset + n, lead + inside) - max(offset, lead))
            offset += n
        copies = self.dtype != torch.float32  # .to(torch.float32) of an fp32 view is the view itself

        def isfinite_of(reduced: str) -> list[tuple[str, str, int]]:
            """A scalar reduction and torch.isfinite of it, which torch makes of (x == x) * (x.abs() != inf)."""
            return [("alloc", reduced, size), ("alloc", f"{reduced}-abs", size), ("alloc", f"{reduced}-ne", 1),
                    ("alloc", f"{reduced}-eq", 1), ("alloc", f"{reduced}-finite", 1), ("free", f"{reduced}-eq", 0),
                    ("free", f"{reduced}-ne", 0), ("free", f"{reduced}-abs", 0), ("free", reduced, 0)]

        def requests(label: str, payload, state: dict) -> list[tuple[str, str, int]]:
            # A backward's gradient buffer, at its first reduction holding a parameter of the slice: the
            # step's first is kept as the sum ("grad-buffer"), a later one's is added into it and dropped
            # at backward's end ("added-grad-buffer", stage 2 under gradient accumulation).
            if label == "grad-buffer":
                if state.get("this-backward") or overlapping.isdisjoint(payload):
                    return []
                state["this-backward"] = True
                name = "added-grad-buffer" if state.get("grad-buffer") else "grad-buffer"
                state[name] = True
                return [("alloc", name, part.grad_buffer_elements * size)]
            if label == "grad-buffer-epilogue":
                state.pop("this-backward", None)
                return [("free", "added-grad-buffer", 0)] if state.pop("added-grad-buffer", False) else []
            if label == "overflow-check":  # has_inf_or_nan of each piece, as the step model's own
                out = []
                for n in pieces:
                    if self.overflow_check == "scalars":
                        out += isfinite_of("amax") + isfinite_of("amin") + [
                            ("alloc", "and", 1), ("free", "amax-finite", 0), ("free", "amin-finite", 0),
                            ("alloc", "not", 1), ("free", "and", 0), ("free", "not", 0)]
                        continue
                    out += ([("alloc", "float-copy", n * 4)] if copies else []) + [
                        ("alloc", "isnan", n), ("alloc", "isinf", n), ("alloc", "or", n), ("alloc", "or-float", n * 4),
                        ("alloc", "max", 4), ("free", "or-float", 0)]
                    out += ([("free", "float-copy", 0)] if copies else []) + [
                        ("free", "isnan", 0), ("free", "isinf", 0), ("free", "or", 0), ("free", "max", 0)]
                return out
            if label == "norms":
                out = []
                for i, n in enumerate(pieces):
                    out += [("alloc", "norm-copy", n * 8), ("alloc", f"norm-{i}", 8), ("free", "norm-copy", 0)]
                k = len(pieces)
                out += [("alloc", "stack", 8 * k), ("alloc", "squares", 8 * k), ("free", "stack", 0),
                        ("alloc", "sum", 8), ("free", "squares", 0), ("alloc", "total", 4), ("free", "sum", 0)]
                # the list freed from its end (list_dealloc), then the total
                return out + [("free", f"norm-{i}", 0) for i in reversed(range(k))] + [("free", "total", 0)]
            if label in ("padding", "padding-free"):
                if not part.padding_elements:
                    return []
                return [("alloc", "padding", part.padding_elements * size)] if label == "padding" else [
                    ("free", "padding", 0)]
            if label == "grad-buffer-free":
                return [("free", "grad-buffer", 0)] if state.pop("grad-buffer", False) else []
            raise ValueError(f"no bracket {label!r}")
        requests.alike = (tuple(part.overlapping_params), tuple(pieces), part.grad_buffer_elements,
                          part.padding_elements)
        return requests
