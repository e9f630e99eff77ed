"""The points at which the training loop calls its instruments (PyTorch Lightning's callback names).

::

    setup(run)                    the strategy is built (the header is printed here)
    on_eval(run, step, loss)      a validation loss (the first, before step ``run.start``, and every --eval-every)
    on_train_start(run)           just before the first step (peaks reset, tracer installed, clock started)
    on_step_start(run, step)      before the step's forward (faults fire, the memory window opens)
    on_step_end(run, step, rec)   after the update and the loss all-reduce; ``rec`` is the :class:`StepRecord`
    on_train_end(run)             after the last step, before the final validation (the trace is written)
    teardown(run)                 after the final validation (hooks removed)

``run`` is the loop's :class:`~minizero.loop.Run` (config, communicator, strategy, scaler, pruner,
applied steps, the :class:`~minizero.loop.TrainResult` being filled). Every method is a no-op here.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StepRecord:
    """One optimizer step as the loop saw it: mean loss over the data group, learning rate, loss scale
    (1.0 without FP16), unscaled gradient norm (nan when skipped), skipped steps so far, and ``notes``
    (text a callback adds to the progress line, e.g. the memory monitor's)."""
    loss: float
    lr: float
    scale: float
    norm: float
    skipped: int
    notes: str = ""


class Callback:
    """Override the points you need."""

    def setup(self, run) -> None: ...

    def on_eval(self, run, step: int, loss: float) -> None: ...

    def on_train_start(self, run) -> None: ...

    def on_step_start(self, run, step: int) -> None: ...

    def on_step_end(self, run, step: int, record: StepRecord) -> None: ...

    def on_train_end(self, run) -> None: ...

    def teardown(self, run) -> None: ...


class CallbackList(Callback):
    """Calls each point on every callback, in list order."""

    def __init__(self, callbacks):
        self.callbacks = list(callbacks)

    def setup(self, run):
        for cb in self.callbacks:
            cb.setup(run)

    def on_eval(self, run, step, loss):
        for cb in self.callbacks:
            cb.on_eval(run, step, loss)

    def on_train_start(self, run):
        for cb in self.callbacks:
            cb.on_train_start(run)

    def on_step_start(self, run, step):
        for cb in self.callbacks:
            cb.on_step_start(run, step)

    def on_step_end(self, run, step, record):
        for cb in self.callbacks:
            cb.on_step_end(run, step, record)

    def on_train_end(self, run):
        for cb in self.callbacks:
            cb.on_train_end(run)

    def teardown(self, run):
        for cb in self.callbacks:
            cb.teardown(run)
