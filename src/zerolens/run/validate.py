"""The checks of a run's settings that cost something, made once, before any worker starts: the
GPUs, the releases zerolens knows, each DeepSpeed config, a user's model and batch on the meta
device, and a layout every strategy can predict. Each failure is a UserError of one line."""
from __future__ import annotations

import contextlib
import difflib
import importlib.util
import io
import logging
import math
import os

import torch

from zerolens.compat import check_supported
from zerolens.errors import UserError, one_line_error, users_code
from zerolens.models.data import make_batch
from zerolens.models.model import (
    MIXED_WEIGHTS,
    ModelConfig,
    check_weights_and_precision,
    parameter_shapes,
    trainable_flags,
    user_model,
    weight_bytes,
)
from zerolens.run.config import RunConfig
from zerolens.run.faults import fault_from_environment
from zerolens.strategies import DTYPES, loss_of, registry


def check_config(config: RunConfig, gpus_visible: int | None = None, *, running: bool = True) -> None:
    """The checks that cost something, made once, before any worker starts: the GPUs are there
    (`gpus_visible`: none when a launcher placed the ranks), the releases zerolens knows, each
    DeepSpeed config through DeepSpeed's own config model, a user's model and batch run on the meta
    device, and a layout every strategy can predict. Not `running` (a plan without --check): only
    predicted, so DeepSpeed need not be installed."""
    if config.device == "cuda" and gpus_visible is not None and gpus_visible < config.nproc:
        fix = f"use --nproc {gpus_visible} or --device cpu" if gpus_visible else "use --device cpu"
        raise UserError(f"--device cuda with {config.nproc} process{'es' * (config.nproc != 1)} needs {config.nproc} "
                        f"GPU{'s' * (config.nproc != 1)}, but "
                        f"{gpus_visible} are visible; {fix}")
    try:
        fault_from_environment()  # ZEROLENS_FAULT, for tests of failures
    except ValueError as e:
        raise UserError(str(e)) from None
    check_supported("torch", torch.__version__)
    if (config.ds_config or config.ds_override) and not registry.needing_deepspeed(config.strategies):
        given = " and ".join(flag for flag, value in (("--ds-config", config.ds_config),
                                                      ("--ds-override", config.ds_override)) if value)
        raise UserError(f"{given}: unused, as none of {', '.join(config.strategies)} runs DeepSpeed (add a zero "
                        "strategy or drop it)")
    if running and registry.needing_deepspeed(config.strategies):
        if importlib.util.find_spec("deepspeed") is None:
            raise UserError("DeepSpeed is not installed: pip install deepspeed (or use --strategies "
                            f"{','.join(registry.without_deepspeed())})")
        check_supported("deepspeed")
        check_deepspeed_configs(config)
    if config.model.kind == "user":
        check_user_model(config.model, config.micro_batch * config.nproc, config.seed)
    check_running_statistics(config.model, config.strategies, config.precision,
                             deepspeed_buffer_dtype(config.ds_config, config.ds_override))
    # A model a strategy's layout cannot describe (FSDP2 cannot shard a 0-dimensional parameter) is
    # refused here, not after the others trained.
    shapes = [tuple(shape) for shape in parameter_shapes(config.model)]
    weights, trainable = weight_bytes(config.model), trainable_flags(config.model)
    if weights is None:
        raise UserError(MIXED_WEIGHTS.format(model=config.model.factory))
    check_weights_and_precision(weights, config.precision, config.model.factory)
    refused: dict[str, list[str]] = {}  # why -> the strategies it holds for (both FSDP2s, say)
    for name in config.strategies:
        try:
            registry.predict_retained(name, [math.prod(s) for s in shapes], config.nproc, 0, config.precision,
                                      reduce_bucket_size=config.reduce_bucket_size, param_shapes=shapes,
                                      param_persistence_threshold=config.param_persistence_threshold,
                                      weight_bytes=weights, trainable=trainable)
        except ValueError as e:
            refused.setdefault(str(e), []).append(name)
    if refused:
        why, names = next(iter(refused.items()))
        raise UserError(f"--strategies {','.join(names)}: {why}")


def deepspeed_buffer_dtype(ds_config: dict | None, ds_override: dict | None) -> torch.dtype | None:
    """The dtype a DeepSpeed config casts the module's buffers to (data_types.buffer_dtype, DeepSpeed
    0.19: --ds-override over --ds-config), None where it leaves them as they are (its default)."""
    names = {"fp16": torch.float16, "float16": torch.float16, "half": torch.float16, "bf16": torch.bfloat16,
             "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}
    for source in (ds_override, ds_config):
        value = ((source or {}).get("data_types") or {}).get("buffer_dtype")
        if value is not None:
            return names.get(str(value).lower().removeprefix("torch."))
    return None


def check_running_statistics(model: ModelConfig, strategies, precision: str,
                             deepspeed_buffers: torch.dtype | None = None) -> None:
    """A model whose normalisation layers keep running statistics in a dtype other than the run's
    16-bit one (BatchNorm built in fp32) under strategies that run the weights in that dtype themselves
    (StrategySpec.casts_weights): the statistics stay as they are, and the forward fails ("expected
    scalar type BFloat16 but found Float"; DeepSpeed on its own too). DDP autocasts, which runs batch
    norm in fp32. `deepspeed_buffers`: the dtype a DeepSpeed config casts the buffers to
    (deepspeed_buffer_dtype); DeepSpeed's strategies run where it is the run's."""
    casting = [name for name in strategies if registry.spec(name).casts_weights
               and not (registry.spec(name).needs_deepspeed and deepspeed_buffers == DTYPES.get(precision))]
    if precision == "fp32" or not casting or model.kind != "user":  # the presets and causal LMs have none
        return
    from torch.nn.modules.batchnorm import _NormBase
    with users_code("--model"):
        with torch.device("meta"):
            module = user_model(model)
    norms = [(name, m) for name, m in module.named_modules() if isinstance(m, _NormBase)
             and m.running_mean is not None and m.running_mean.dtype != DTYPES[precision]]
    if norms:
        name, first = norms[0]
        others = [s for s in strategies if s not in casting]
        raise UserError(f"--model {model.factory}: {type(first).__name__} {name!r}"
                        + (f" and {len(norms) - 1} more" if len(norms) > 1 else "")
                        + f" keep{'s' if len(norms) == 1 else ''} running statistics in "
                        f"{str(first.running_mean.dtype).removeprefix('torch.')}, which {', '.join(casting)} "
                        f"leave{'s' if len(casting) == 1 else ''} as they are while running the weights in {precision}: "
                        f"{'its' if len(casting) == 1 else 'their'} forward fails on the two dtypes; run --precision fp32"
                        + (f", or --strategies {','.join(others)} alone" if others else ""))


def check_user_model(model: ModelConfig, global_batch: int, seed: int) -> None:
    """check_model_contract, where whatever the user's code raises is theirs to fix, said in one line."""
    with users_code("--model/--batch"):
        check_model_contract(model, global_batch, seed)


def check_model_contract(model: ModelConfig, global_batch: int, seed: int) -> None:
    """What zerolens needs of a user's model and batch function (README, "Your own model"): a batch
    of `global_batch` rows (inputs, integer targets), and logits as one tensor that cross-entropy
    can compare with the targets. Run on the meta device; a model whose forward needs real values
    there (data-dependent shapes, .item()) is left to the workers."""
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
                        "its logits as one tensor (..., classes): return them alone (e.g. `[0]` of a tuple, in a "
                        "small wrapper module; a transformers model may be returned as it is)")
    try:
        loss = loss_of(output, targets.to("meta"))
    except Exception as e:
        raise UserError(f"--model/--batch: the model's output {tuple(output.shape)} and the batch's targets "
                        f"{tuple(targets.shape)} do not fit cross-entropy ({one_line_error(e)}); zerolens compares "
                        "logits (..., classes) with integer targets (...) of the same leading shape, for a global "
                        f"batch of {global_batch} rows") from None
    # The values of the targets, which the meta device cannot check (each rank's cross-entropy raised it)
    classes, counted = output.shape[-1], targets[targets != -100]
    if counted.numel() and not 0 <= int(counted.min()) <= int(counted.max()) < classes:
        raise UserError(f"--batch {model.batch}: targets from {int(counted.min())} to {int(counted.max())}, but the "
                        f"model's logits have {classes} classes: targets must lie in 0..{classes - 1} (-100: ignored)")
    try:
        loss.backward()
    except Exception:
        return  # a backward the meta device cannot run: the workers will run it for real
    unused = [name for name, p in module.named_parameters() if p.requires_grad and p.grad is None]
    if unused:
        raise UserError(f"--model {model.factory}: its forward never uses {len(unused)} of its trained parameters "
                        f"({', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''}), which get no gradient: DDP "
                        "stops at its first step (it would need find_unused_parameters) and DeepSpeed keeps their "
                        "gradients otherwise than zerolens predicts; remove them, or freeze them (requires_grad=False)")


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
        read = KeysRead(ds_config)
        try:
            DeepSpeedConfig(read)
        except Exception as e:  # pydantic's ValidationError, DeepSpeed's own asserts and ValueErrors
            raise UserError(f"{name}: DeepSpeed rejects its config: {one_line_error(e)}") from None
        # DeepSpeed passes over a top-level key it does not know: a misspelt section would leave the run
        # on zerolens's defaults, silently. A key of the user's that DeepSpeed never looked up is refused.
        for key in [*config.ds_config, *config.ds_override]:
            if key not in read.looked_up:
                close = difflib.get_close_matches(key, sorted(read.looked_up), n=1)
                source = "--ds-override" if key in config.ds_override else "--ds-config"
                raise UserError(f"{source}: DeepSpeed has no key {key!r}"
                                + (f" (did you mean {close[0]!r}?)" if close else ""))


class KeysRead(dict):
    """A DeepSpeed config that remembers which of its top-level keys DeepSpeed's parser looked up
    (get, [], in): the keys it knows, by its own code rather than a list of ours."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.looked_up: set[str] = set()

    def get(self, key, default=None):
        self.looked_up.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.looked_up.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.looked_up.add(key)
        return super().__contains__(key)
