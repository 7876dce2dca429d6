"""Callbacks and early stopping (training/callbacks.py) on controlled inputs."""

import math

import pytest

from dlpipe.training.callbacks import CallbackError, Callbacks, EarlyStopping


class FakeTrainer:
    """What a callback sees of the Trainer: its history and request_stop (the real one is tested
    end to end in tests/test_tasks_cli.py)."""

    def __init__(self, history=()):
        self.history, self.stopped = list(history), None

    def request_stop(self, reason: str) -> None:
        self.stopped = reason


def run_epochs(stopper: EarlyStopping, values: list[float], history=()) -> int | None:
    """Feed one monitored value per epoch; the epoch at which a stop was requested, or None."""
    trainer = FakeTrainer(history)
    stopper.on_train_start(trainer)
    for epoch, value in enumerate(values, start=len(trainer.history) + 1):
        stopper.on_epoch_end(trainer, epoch, {"val_loss": value, "val_r2": value})
        if trainer.stopped:
            return epoch
    return None


def test_patience_counts_epochs_without_an_improvement_beyond_min_delta():
    assert run_epochs(EarlyStopping("val_loss", "min", patience=2), [1.0, 0.9, 0.8, 0.7]) is None
    assert run_epochs(EarlyStopping("val_loss", "min", patience=2), [1.0, 0.9, 0.95, 0.91, 0.5]) == 4
    assert run_epochs(EarlyStopping("val_loss", "min", patience=2, min_delta=0.05), [1.0, 0.97, 0.96]) == 3
    assert run_epochs(EarlyStopping("val_r2", "max", patience=1), [0.5, 0.7, 0.9]) is None
    assert run_epochs(EarlyStopping("val_r2", "max", patience=1), [0.5, 0.4]) == 2  # r2 went down


def test_a_diverged_or_missing_metric_is_no_improvement():
    assert run_epochs(EarlyStopping("val_loss", "min", patience=2), [1.0, math.nan, math.nan]) == 3
    stopper, trainer = EarlyStopping("val_accuracy", "max", patience=1), FakeTrainer()
    stopper.on_train_start(trainer)
    stopper.on_epoch_end(trainer, 1, {"val_loss": 0.5})
    assert "val_accuracy did not improve" in trainer.stopped


def test_a_resumed_run_counts_the_epochs_before_the_interruption():
    history = [{"val_loss": 1.0}, {"val_loss": 1.1}]
    assert run_epochs(EarlyStopping("val_loss", "min", patience=2), [1.2], history=history) == 3
    trainer = FakeTrainer([{"val_loss": 1.0}, {"val_loss": 1.1}, {"val_loss": 1.2}])  # it had stopped already
    EarlyStopping("val_loss", "min", patience=2).on_train_start(trainer)
    assert trainer.stopped.startswith("early stopping: val_loss")


def test_a_failing_callback_names_itself_and_its_hook():
    class Broken:
        def on_step_end(self, trainer, step):
            raise ZeroDivisionError("division by zero")

    callbacks = Callbacks({"mine": Broken(), "quiet": object()})
    callbacks.call("on_train_start", FakeTrainer())  # hooks a callback lacks are skipped
    with pytest.raises(CallbackError, match=r"callbacks.mine.on_step_end: ZeroDivisionError: division by zero"):
        callbacks.call("on_step_end", FakeTrainer(), 3)
