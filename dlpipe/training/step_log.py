"""What the loop logs every trainer.log_every optimizer steps, on the optimizer-step axis: the mean
training loss since the last log (`train_loss_step`), the learning rate (`lr`, or `lr/group_N`) and
the total gradient norm (`grad_norm`)."""

import math

import torch

from dlpipe.training.protocols import MetricSink, Peers
from dlpipe.training.schedule import current_lrs, lr_metrics


def gradient_norm(model: torch.nn.Module, clip: float) -> torch.Tensor:
    """The total L2 norm of the gradients, clipped to `clip` when it is > 0. clip_grad_norm_
    returns the norm before clipping; with max_norm=inf it only measures (the scale it applies is 1).
    A tensor on the device: reading it is a CPU-GPU sync, so only logged steps read it."""
    return torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else math.inf)


class StepLog:
    """The loss summed since the last log, kept on the device (adding to it costs no sync)."""

    def __init__(self, every: int, device: torch.device):
        self.every = every
        self.loss = torch.zeros((), device=device)
        self.samples = 0

    def add(self, loss: torch.Tensor, n: int) -> None:
        self.loss.add_(loss, alpha=n)  # in place, one op: this runs every micro-step
        self.samples += n

    def due(self, step: int) -> bool:
        """Whether optimizer step `step` (counted from 1) is logged."""
        return step % self.every == 0

    def record(self, step: int, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor | None,
               metrics: MetricSink, peers: Peers | None = None) -> None:
        """Log the step's metrics; call it after the optimizer step and before the schedule moves
        the lr, so `lr` is the one this step used."""
        # .item() is a CPU-GPU sync point: only once every log_every steps.
        loss_sum, samples = self.loss.item(), self.samples
        if peers is not None:
            loss_sum, samples = peers.sum([loss_sum, samples])
        values = {"train_loss_step": loss_sum / max(samples, 1), **lr_metrics(current_lrs(optimizer))}
        if grad_norm is not None:
            # Every rank holds the same, all-reduced gradients, so rank 0's norm is the job's.
            values["grad_norm"] = grad_norm.item()
        metrics.log_metrics(values, step=step)
        self.loss.zero_()
        self.samples = 0
