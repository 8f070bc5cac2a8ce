"""zerolens.track inside a Lightning Trainer, whatever its strategy (DDP, DeepSpeed, FSDP2 through
ModelParallelStrategy):

    trainer = L.Trainer(devices=2, callbacks=[ZerolensCallback(out="runs/myjob", every=50)])

Tracking starts at on_train_start, when the strategy has wrapped the model (`trainer.strategy.model`:
the DDP model, the DeepSpeed engine, the sharded module) and built the optimizer, and ends at
on_train_end; an exception in training ends it with a report that says which rank failed and how.
Lightning steps its optimizers with a closure that runs forward and backward inside `step`; track
finds the phases all the same. A wrapper's forward runs the LightningModule's training_step; where
the strategy leaves the LightningModule unwrapped (one device, ModelParallelStrategy), Lightning calls
training_step itself, which need not call the module's own forward (`self.net(x)`), so a forward is
taken to run from on_train_batch_start to on_before_backward.

Rank 0's figures of each sampled step also go to the Trainer's loggers (TensorBoard, W&B, CSV, ...)
at its global step; `log=False` keeps them in the run folder only.
"""
from __future__ import annotations

from lightning.pytorch.callbacks import Callback

from zerolens.tracking.track import EVERY, Tracker


class ZerolensCallback(Callback):
    def __init__(self, *, out=None, every: int = EVERY, overwrite: bool = False, log: bool = True):
        self.out, self.every, self.overwrite, self.log = out, every, overwrite, log
        self.tracker: Tracker | None = None
        self.unwrapped = False  # the strategy left the LightningModule unwrapped: its forward may never run

    def on_train_start(self, trainer, pl_module):
        optimizers = list(trainer.optimizers)  # several under manual optimization: track takes them all

        def to_loggers(figures, step):
            for logger in trainer.loggers:
                logger.log_metrics(figures, step=trainer.global_step)
        self.unwrapped = trainer.strategy.model is pl_module
        self.tracker = Tracker(trainer.strategy.model, optimizers or None, out=self.out, every=self.every,
                               overwrite=self.overwrite, log_to=to_loggers if self.log and trainer.loggers else None,
                               forward_hooks=not self.unwrapped)
        if str(trainer.precision).endswith("-mixed"):  # autocast, which a forward hook sees only when wrapped
            self.tracker.mixed_precision = f"Lightning's {trainer.precision} (autocast)"

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.tracker is not None and self.unwrapped:
            self.tracker.forward_begins()

    def on_before_backward(self, trainer, pl_module, loss):
        if self.tracker is not None and self.unwrapped:
            self.tracker.forward_ends()

    def on_train_end(self, trainer, pl_module):
        self._close(None)

    def on_exception(self, trainer, pl_module, exception):
        self._close(exception)

    def _close(self, error) -> None:
        if self.tracker is not None:
            tracker, self.tracker = self.tracker, None
            tracker.close(error)
