"""ZeRO-3's step model (strategies/deepspeed_stage3.py) against DeepSpeed ZeRO-3 itself, per step and phase.

Both are traced on fake tensors as one rank under a fake process group.

python3 scripts/zero3_against_deepspeed.py [--preset gpt-tiny] [--nproc 2] [--rank 0] [--precision bf16]
    [--micro-batch 8] [--reduce-bucket-size 5e7] [--width W] [--activation-checkpointing] [--cuda]
    [--grad-accum K]

Under gradient accumulation (--grad-accum K) each micro-batch's forward and backward is compared, and
what DeepSpeed's engine.step() after a micro-batch before the boundary allocates ("between": it should
only count; the step model runs nothing there), with what each holds after it.

The step model restates DeepSpeed 0.19.8's source; this shows where another release (or CUDA, with
--cuda on a machine with a GPU) allocates otherwise. DeepSpeed itself cannot be traced as it is:
two of its functions read tensor values, which fake tensors do not have, and are replaced for the
trace (the step's check of the gradient norm, the coordinator's check that the ranks recorded the
same trace); and its move of the model to its device is skipped (fake parameters refuse it; the
model is there already). fp16 also reads the overflow flag: not supported.
"""
import argparse
import contextlib
import dataclasses
import io
import json
import os
import types
import warnings

import torch

from zerolens.measure.tracker import reset_tracker_peak, tracker_total
from zerolens.models.data import make_batch
from zerolens.models.model import PRESETS, meta_model
from zerolens.predict.peak import fake_process_group, totals_tracker
from zerolens.strategies import TrainSettings, registry
from zerolens.strategies.deepspeed import DeepSpeedZero

parser = argparse.ArgumentParser()
parser.add_argument("--preset", default="gpt-tiny", choices=sorted(PRESETS))
parser.add_argument("--nproc", type=int, default=2)
parser.add_argument("--rank", type=int, default=0)
parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
parser.add_argument("--micro-batch", type=int, default=8)
parser.add_argument("--reduce-bucket-size", type=float, default=5e7)
parser.add_argument("--width", type=int, help="d_model (the MLP 4x as wide)")
parser.add_argument("--activation-checkpointing", action="store_true")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (gradient_accumulation_steps)")
parser.add_argument("--cuda", action="store_true", help="trace on fake CUDA tensors (needs a visible GPU)")
args = parser.parse_args()

model_config = PRESETS[args.preset]
if args.width:
    model_config = dataclasses.replace(model_config, d_model=args.width, ffn_dim=4 * args.width)
if args.activation_checkpointing:
    model_config = dataclasses.replace(model_config, activation_checkpointing=True)
settings = TrainSettings(precision=args.precision, world_size=args.nproc, micro_batch=args.micro_batch,
                         reduce_bucket_size=int(args.reduce_bucket_size), grad_accum=args.grad_accum)
device = torch.device("cuda", 0) if args.cuda else torch.device("cpu")


def with_deepspeed_read_values_replaced():
    """DeepSpeed's functions that read tensor values, replaced for the trace."""
    stack = contextlib.ExitStack()
    with contextlib.redirect_stdout(io.StringIO()):
        import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator
        import deepspeed.runtime.zero.stage3 as stage3
    for module, name, replacement in ((stage3, "is_invalid_grad_norm", lambda norm: False),
                                      (coordinator, "assert_ints_same_as_other_ranks", lambda ints: None)):
        stack.callback(setattr, module, name, getattr(module, name))
        setattr(module, name, replacement)
    return stack


def traced(strategy) -> list[dict]:
    """Each step's peak per phase of `strategy` (set up on a fake model) as predict_peak counts it; under
    gradient accumulation forward and backward per micro-batch ("forward 0", ...), and what is held
    after each micro-batch before the last ("held 0", ...) and its peak in engine.step() before the boundary
    ("between 0", ...)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    tokens, labels = make_batch(model_config, 0, seed=0, batch_size=args.micro_batch, signal=0.0)
    model = meta_model(model_config)
    tracker, steps = totals_tracker(device_type=device.type), []
    os.environ.update(RANK=str(args.rank), WORLD_SIZE=str(args.nproc), LOCAL_RANK="0")
    with warnings.catch_warnings(), fake_process_group(args.rank, args.nproc), \
            FakeTensorMode(allow_non_fake_inputs=True) as mode, tracker, with_deepspeed_read_values_replaced():
        warnings.simplefilter("ignore")
        model = model.to_empty(device=device)
        for module in model.modules():  # already where it goes: DeepSpeed's module.to would swap fake tensors
            module.to = types.MethodType(lambda self, *a, **k: self, module)
        strategy.setup(model, device)
        tokens, labels = mode.from_tensor(tokens), mode.from_tensor(labels)
        for _ in range(args.steps):
            peaks = {}
            for micro in range(args.grad_accum):
                tracker.reset_mod_stats()
                batch = (tokens.clone(), labels.clone())
                name = "" if args.grad_accum == 1 else f" {micro}"
                with strategy.accumulating(sync=micro == args.grad_accum - 1):
                    reset_tracker_peak(tracker)
                    loss = strategy.forward_loss(*batch)
                    peaks["forward" + name] = tracker_total(tracker, "peak")
                    reset_tracker_peak(tracker)
                    strategy.backward(loss)
                    del loss, batch
                    peaks["backward" + name] = tracker_total(tracker, "peak")
                    reset_tracker_peak(tracker)  # DeepSpeedZero.accumulating's engine.step() before the boundary
                if micro < args.grad_accum - 1:
                    peaks["between" + name] = tracker_total(tracker, "peak")
                    peaks["held" + name] = tracker_total(tracker, "current")
            reset_tracker_peak(tracker)
            strategy.step()
            peaks["step"] = tracker_total(tracker, "peak")
            peaks["held after step"] = tracker_total(tracker, "current")
            steps.append(peaks)
    return steps


deepspeed_steps = traced(DeepSpeedZero(settings, stage=3))
model_steps = traced(registry.spec("zero3").build_step_model(settings, rank=args.rank, cuda=args.cuda))
print(json.dumps({"deepspeed": deepspeed_steps, "step_model": model_steps}))
for i, (ds, ours) in enumerate(zip(deepspeed_steps, model_steps)):
    print(f"step {i}: " + "  ".join(f"{phase} {ds[phase] / 2**20:.2f} MiB, step model {ours[phase] - ds[phase]:+d} bytes"
                                     for phase in ds))
worst = max(abs(ours[phase] - ds[phase]) for ds, ours in zip(deepspeed_steps, model_steps) for phase in ds)
print(f"worst: {worst} bytes")
