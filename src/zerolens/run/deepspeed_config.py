"""The DeepSpeed side of a run's settings: a user's DeepSpeed JSON (--ds-config) and overrides
(--ds-override) read and checked against the run, and the ZeRO settings zerolens predicts with taken
from them (validate.py puts each DeepSpeed config through DeepSpeed's own config model)."""
from __future__ import annotations

import json
import math

from zerolens.errors import UserError


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


def check_user_ds_config(user: dict, path: str | None, *, micro_batch: int, world_size: int, precision: str,
                         grad_accum: int = 1) -> None:
    """The batch arithmetic and precision of a user's DeepSpeed config must agree with the run's:
    zerolens feeds every rank `micro_batch` samples per micro-batch, `grad_accum` micro-batches per step."""
    def explicit(key, section=None):
        value = (user.get(section) or {}).get(key) if section else user.get(key)
        return None if value in (None, "auto") else value

    accumulation = explicit("gradient_accumulation_steps") or grad_accum
    micro = explicit("train_micro_batch_size_per_gpu") or micro_batch
    total = explicit("train_batch_size")
    if accumulation != grad_accum:
        raise UserError(f"--ds-config {path}: gradient_accumulation_steps {accumulation}, but the run accumulates "
                        f"{grad_accum} micro-batches per step: pass --grad-accum {accumulation} or set it to \"auto\"")
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


# What DeepSpeed uses where a config leaves a setting out (deepspeed/runtime/zero/config.py, 0.16-0.19).
DEEPSPEED_DEFAULTS = {"reduce_bucket_size": 500_000_000, "stage3_param_persistence_threshold": 100_000}


def deepspeed_zero_setting(ds_config: dict, ds_override: dict, key: str, default) -> int:
    """zero_optimization.`key` (or its name without "stage3_") as the run's DeepSpeed config sets
    it, --ds-override over --ds-config, in elements; `default` where neither sets it or it is "auto"
    (zerolens fills an "auto" with its own), except that a --ds-config which leaves it out gets
    DeepSpeed's own default (DEEPSPEED_DEFAULTS): what DeepSpeed will use, so that what zerolens
    predicts of it agrees (strategies/layout.py, predict/peak.py)."""
    for source, where in ((ds_override, "--ds-override"), (ds_config, "--ds-config")):
        section = source.get("zero_optimization") or {}
        for name in (key, key.removeprefix("stage3_")):
            value = section.get(name)
            if value in (None, "auto"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise UserError(f"{where}: zero_optimization.{name} must be a number of elements, got {value!r}")
            return int(value)
    named = (ds_config.get("zero_optimization") or {}).keys() & {key, key.removeprefix("stage3_")}
    if ds_config and not named:
        return DEEPSPEED_DEFAULTS[key]
    if not math.isfinite(default):
        raise UserError(f"--reduce-bucket-size must be a number of elements, got {default}")
    return int(default)
