"""zerolens.track inside a Hugging Face Trainer, whether it runs DDP, DeepSpeed or FSDP:

    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    trainer.add_callback(ZerolensCallback(trainer, out="runs/myjob", every=50))
    trainer.train()

The callback needs the Trainer itself: a TrainerCallback is handed the unwrapped model, and zerolens
must see what the Trainer trains (`trainer.model_wrapped`: the DeepSpeed engine, the DDP or FSDP
model) and the optimizer accelerate wraps. Tracking starts at on_train_begin, when both are built,
and ends at on_train_end; a Trainer that raises calls no callback, and then the run folder keeps the
report of the last sampled step, marked UNFINISHED.

Where the Trainer reports to TensorBoard, W&B or any other integration (`report_to`), rank 0's figures
of each sampled step go there too, through `Trainer.log` (under "train/zerolens/...", beside its loss;
they join its log_history and its printed logs as well);
`log=False` keeps them in the run folder only.
"""
from __future__ import annotations

from transformers import TrainerCallback

from zerolens.tracking.track import EVERY, Tracker


class ZerolensCallback(TrainerCallback):
    def __init__(self, trainer, *, out=None, every: int = EVERY, overwrite: bool = False, log: bool = True):
        self.trainer, self.out, self.every, self.overwrite, self.log = trainer, out, every, overwrite, log
        self.tracker: Tracker | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's AcceleratedOptimizer
        reports = [to for to in (args.report_to or []) if to != "none"]
        log_to = (lambda figures, step: trainer.log(dict(figures))) if self.log and reports else None
        self.tracker = Tracker(trainer.model_wrapped, optimizer, out=self.out, every=self.every,
                               overwrite=self.overwrite, log_to=log_to)

    def on_train_end(self, args, state, control, **kwargs):
        if self.tracker is not None:
            self.tracker.close(None)
            self.tracker = None
