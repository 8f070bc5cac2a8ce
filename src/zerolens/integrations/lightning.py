"""zerolens.track inside a Lightning Trainer, whatever its strategy (DDP, DeepSpeed, FSDP2 through
ModelParallelStrategy):

    trainer = L.Trainer(devices=2, callbacks=[ZerolensCallback(out="runs/myjob", every=50)])

Tracking starts at on_train_start, when the strategy has wrapped the model (`trainer.strategy.model`:
the DDP model, the DeepSpeed engine, the sharded module) and built the optimizer, and ends at
on_train_end; an exception in training ends it with a report that says which rank failed and how.
Lightning steps its optimizers with a closure that runs forward and backward inside `step`; track
finds the phases all the same.
"""
from __future__ import annotations

from lightning.pytorch.callbacks import Callback

from zerolens.tracking.track import EVERY, Tracker


class ZerolensCallback(Callback):
    def __init__(self, *, out=None, every: int = EVERY, overwrite: bool = False):
        self.out, self.every, self.overwrite = out, every, overwrite
        self.tracker: Tracker | None = None

    def on_train_start(self, trainer, pl_module):
        optimizer = trainer.optimizers[0] if len(trainer.optimizers) == 1 else None
        self.tracker = Tracker(trainer.strategy.model, optimizer, out=self.out, every=self.every,
                               overwrite=self.overwrite)

    def on_train_end(self, trainer, pl_module):
        self._close(None)

    def on_exception(self, trainer, pl_module, exception):
        self._close(exception)

    def _close(self, error) -> None:
        if self.tracker is not None:
            tracker, self.tracker = self.tracker, None
            tracker.close(error)
