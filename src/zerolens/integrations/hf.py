"""zerolens.track inside a Hugging Face Trainer, whether it runs DDP, DeepSpeed or FSDP:

    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    trainer.add_callback(ZerolensCallback(trainer, out="runs/myjob", every=50))
    trainer.train()

The callback needs the Trainer itself: a TrainerCallback is handed the unwrapped model, and zerolens
must see what the Trainer trains (`trainer.model_wrapped`: the DeepSpeed engine, the DDP or FSDP
model) and the optimizer accelerate wraps. Tracking starts at on_train_begin, when both are built,
and ends at on_train_end; a Trainer that raises calls no callback, and then the run folder keeps the
report of the last sampled step, marked UNFINISHED.
"""
from __future__ import annotations

from transformers import TrainerCallback

from zerolens.tracking.track import EVERY, Tracker


class ZerolensCallback(TrainerCallback):
    def __init__(self, trainer, *, out=None, every: int = EVERY, overwrite: bool = False):
        self.trainer, self.out, self.every, self.overwrite = trainer, out, every, overwrite
        self.tracker: Tracker | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's AcceleratedOptimizer
        self.tracker = Tracker(trainer.model_wrapped, optimizer, out=self.out, every=self.every,
                               overwrite=self.overwrite)

    def on_train_end(self, args, state, control, **kwargs):
        if self.tracker is not None:
            self.tracker.close(None)
            self.tracker = None
