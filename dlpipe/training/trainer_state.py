"""A Trainer's checkpointable state (Trainer.state_dict / load_state_dict), as plain containers and
tensors that load with torch.load(weights_only=True).

Resuming must log the very numbers an uninterrupted run logs, so besides the weights, optimizer,
scaler, schedule and RNGs the state carries the sums that logged numbers are made of: the step
log's loss and samples since the last train_loss_step (always: they run across epochs), the
interrupted epoch's loss sum and sample count (train_loss of that epoch), and the steps skipped
for a non-finite loss. Only timings (epoch_time_s, samples_per_s, data waits, step times, the
resource sampler's figures) are the resumed attempt's own.
"""

import torch

from dlpipe.training import rng
from dlpipe.training.schedule import restore as restore_schedule


def capture(trainer, loader_generator: torch.Generator | None = None) -> dict:
    """After the last finished epoch, or, after a stop request, after the last optimizer step of the
    interrupted epoch."""
    mid_epoch = trainer.stop.interrupted_epoch
    return {
        "model": trainer.model.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scaler": trainer.scaler.state_dict(),
        "step": trainer.step,
        "epoch": len(trainer.history),  # finished epochs
        "batches_done": trainer.stop.at_batch or 0,  # of the next epoch; always at an optimizer step
        "history": [dict(r) for r in trainer.history],
        "scheduler": trainer.schedule.state_dict() if trainer.schedule is not None else None,
        "rng": rng.capture(),
        # The shuffling order and worker seeds of an epoch come from this generator: after a
        # stop, its state from the start of the interrupted epoch, so resuming replays it.
        "loader_generator": (
            trainer.epoch_start_generator if mid_epoch
            else loader_generator.get_state() if loader_generator is not None else None
        ),
        "step_log": trainer.step_log.pending.state_dict(),
        "epoch_loss": trainer.epoch_loss.state_dict() if mid_epoch else None,
        "nonfinite": trainer.guard.state_dict(),
    }


def restore(trainer, state: dict, loader_generator: torch.Generator | None = None) -> None:
    """Load a capture(); fit() then continues with the epoch after state["epoch"] (checkpoints from
    before a key existed lack it: those parts start empty)."""
    trainer.model.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scaler.load_state_dict(state["scaler"])
    trainer.step = int(state["step"])
    trainer.history = [dict(r) for r in state["history"]]
    restore_schedule(trainer.schedule, state.get("scheduler"))
    rng.restore(state["rng"])
    if loader_generator is not None and state["loader_generator"] is not None:
        loader_generator.set_state(state["loader_generator"])
    if state.get("step_log") is not None:
        trainer.step_log.pending.load_state_dict(state["step_log"])
    trainer.guard.load_state_dict(state.get("nonfinite"))
    if state.get("batches_done", 0):
        # train_epoch replays the interrupted epoch's first batches without training on them,
        # then puts these RNG states back (fetching those batches may have drawn from them),
        # and goes on adding to the epoch's loss sums.
        trainer.pending_resume = (int(state["batches_done"]), state["rng"], state.get("epoch_loss"))
