"""Code of the user's own that runs at fixed points of training, and early stopping, which is one.

A callback is any object with some of these methods (subclass `Callback` to get no-op defaults):

    on_train_start(trainer)                     before the first epoch (after a resume: the next one)
    on_step_end(trainer, step)                  after every optimizer step; `step` counts them all
    on_epoch_end(trainer, epoch, metrics)       after an epoch's metrics are logged (and checkpointed)
    on_train_end(trainer, history)              after the last epoch, or an early stop

Any of them may call `trainer.request_stop(reason)`: training ends at the next optimizer step
boundary (the epoch's metrics are still computed, logged and checkpointed) and the run ends FINISHED
with the reason in its `dlpipe.stopped_early` tag. An exception in a callback fails the run with
its message, naming the callback.
"""

import math

from dlpipe.errors import DlpipeError, first_line

HOOKS = ("on_train_start", "on_step_end", "on_epoch_end", "on_train_end")


class CallbackError(DlpipeError):
    """A user callback raised: the run fails with its message."""


class Callback:
    """No-op hooks to subclass (a callback need not: any object with some of them will do)."""

    def on_train_start(self, trainer) -> None: ...

    def on_step_end(self, trainer, step: int) -> None: ...

    def on_epoch_end(self, trainer, epoch: int, metrics: dict[str, float]) -> None: ...

    def on_train_end(self, trainer, history: list[dict[str, float]]) -> None: ...


class Callbacks:
    """The job's callbacks by name, called in order; a hook a callback lacks is skipped."""

    def __init__(self, callbacks: dict[str, object] | None = None):
        self.callbacks = dict(callbacks or {})
        # Resolved once: on_step_end runs every optimizer step, a getattr per callback would not be free.
        self._hooks = {hook: [(name, getattr(cb, hook)) for name, cb in self.callbacks.items() if hasattr(cb, hook)]
                       for hook in HOOKS}

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    @property
    def per_step(self) -> bool:
        """Whether any callback has on_step_end (else the loop need not check for a stop every step)."""
        return bool(self._hooks["on_step_end"])

    def call(self, hook: str, *args) -> None:
        for name, fn in self._hooks[hook]:
            try:
                fn(*args)
            except DlpipeError:
                raise
            except Exception as e:
                raise CallbackError(f"callbacks.{name}.{hook}: {type(e).__name__}: {first_line(e)}") from e


class EarlyStopping(Callback):
    """Stop when `monitor` has not improved by more than `min_delta` for `patience` epochs.

    `mode` is min or max (the job resolves trainer.early_stopping.mode=auto from the metric). A
    missing or NaN value counts as no improvement, so a diverged run stops too.
    """

    def __init__(self, monitor: str, mode: str = "min", patience: int = 3, min_delta: float = 0.0):
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, min_delta
        self.best: float | None = None
        self.bad_epochs = 0

    def _improved(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        return value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta

    def on_train_start(self, trainer) -> None:
        # A resumed run re-reads its history, so patience counts the epochs before the interruption too.
        self.best, self.bad_epochs = None, 0
        for row in trainer.history:
            self._update(row)
        if self.bad_epochs >= self.patience:
            self._stop(trainer)  # it had already run out of patience: no epoch more

    def on_epoch_end(self, trainer, epoch: int, metrics: dict[str, float]) -> None:
        if self._update(metrics):
            self._stop(trainer)

    def _stop(self, trainer) -> None:
        best = "none logged" if self.best is None else f"{self.best:.6g}"
        trainer.request_stop(f"early stopping: {self.monitor} did not improve by more than {self.min_delta:g} "
                             f"for {self.patience} epochs (best {best})")

    def _update(self, metrics: dict[str, float]) -> bool:
        value = float(metrics.get(self.monitor, math.nan))
        if self._improved(value):
            self.best, self.bad_epochs = value, 0
        else:
            self.bad_epochs += 1
        return self.bad_epochs >= self.patience
