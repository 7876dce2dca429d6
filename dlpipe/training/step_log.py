"""What the loop logs every trainer.log_every optimizer steps, on the optimizer-step axis: the mean
training loss since the last log (`train_loss_step`), the learning rate (`lr`, or `lr/group_N`), the
total gradient norm (`grad_norm`) and the epoch the step is in (`epoch`, as Lightning logs it)."""

import math

import torch

from dlpipe.training.protocols import MetricSink, Peers
from dlpipe.training.schedule import current_lrs, lr_metrics


def gradient_norm(model: torch.nn.Module, clip: float) -> torch.Tensor:
    """The total L2 norm of the gradients, clipped to `clip` when it is > 0. clip_grad_norm_
    returns the norm before clipping; with max_norm=inf it only measures (the scale it applies is 1).
    A tensor on the device: reading it is a CPU-GPU sync, so only logged steps read it."""
    return torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else math.inf)


class LossSum:
    """A loss summed over samples, kept on the device: adding to it costs no sync."""

    def __init__(self, device: torch.device):
        self.total = torch.zeros((), device=device)
        self.samples = 0

    def add(self, loss: torch.Tensor, n: int) -> None:
        self.total.add_(loss, alpha=n)  # in place, one op: this runs every micro-step
        self.samples += n

    def merge(self, other: "LossSum") -> None:
        self.total.add_(other.total)
        self.samples += other.samples

    def mean(self) -> float:
        """The mean over the samples (a CPU-GPU sync point); nan when none were added."""
        return (self.total / self.samples).item() if self.samples else math.nan

    def reset(self) -> None:
        self.total.zero_()
        self.samples = 0

    def state_dict(self) -> dict:
        """Plain numbers for a checkpoint (a sync). float32 -> Python float -> float32 is exact, so a
        restored sum goes on adding to the very same value."""
        return {"loss_sum": self.total.item(), "samples": self.samples}

    def load_state_dict(self, state: dict) -> None:
        self.total.fill_(state["loss_sum"])
        self.samples = int(state["samples"])


class StepLog:
    """The loss summed since the last log (`pending`), kept on the device."""

    def __init__(self, every: int, device: torch.device):
        self.every = every
        self.pending = LossSum(device)

    def due(self, step: int) -> bool:
        """Whether optimizer step `step` (counted from 1) is logged."""
        return step % self.every == 0

    def record(self, step: int, epoch: int, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor | None,
               metrics: MetricSink, peers: Peers | None = None) -> None:
        """Log the step's metrics; call it after the optimizer step and before the schedule moves
        the lr, so `lr` is the one this step used."""
        # .item() is a CPU-GPU sync point: only once every log_every steps.
        loss_sum, samples = self.pending.total.item(), self.pending.samples
        if peers is not None:
            loss_sum, samples = peers.sum([loss_sum, samples])
        values = {"epoch": float(epoch), **lr_metrics(current_lrs(optimizer))}
        if samples:  # none when trainer.on_nonfinite=skip_step skipped every step since the last log
            values["train_loss_step"] = loss_sum / samples
        if grad_norm is not None:
            # Every rank holds the same, all-reduced gradients, so rank 0's norm is the job's.
            values["grad_norm"] = grad_norm.item()
        metrics.log_metrics(values, step=step)
        self.pending.reset()
