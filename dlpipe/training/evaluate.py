"""Scoring a model on a split: the mean loss over its samples and the validation metrics. The
trainer's validation uses it after every epoch; it takes built objects only."""

from collections.abc import Callable
from contextlib import nullcontext

import torch

from dlpipe.training.batches import non_blocking_copies, to_device
from dlpipe.training.objective import Objective
from dlpipe.training.protocols import Peers


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, objective: Objective, metrics: dict, *, device: torch.device,
             limit_batches: int = -1, autocast: Callable = nullcontext, peers: Peers | None = None) -> dict[str, float]:
    """{"val_loss": mean over samples, "val_<name>": each metric} over `loader` (the first
    `limit_batches` batches when > 0). With `peers` each rank scored its own share: the loss sums
    are added up and torchmetrics gathers the metric states in compute(). The model's mode is
    the caller's (eval for validation)."""
    loss_sum = torch.zeros((), device=device)
    samples = 0
    non_blocking = non_blocking_copies(device, loader)
    for i, batch in enumerate(loader):
        if 0 < limit_batches <= i:
            break
        batch = to_device(batch, device, non_blocking)
        n = objective.samples(batch)
        with autocast():
            output, target = objective.forward(model, batch)
            loss = objective.loss(output, target)
        loss_sum += loss.float() * n
        samples += n
        for metric in metrics.values():
            metric.update(*objective.metric_inputs(output, target))
    loss_total = loss_sum.item()
    if peers is not None:
        loss_total, samples = peers.sum([loss_total, samples])
    if samples == 0:
        return {}
    row = {"val_loss": loss_total / samples}
    for name, metric in metrics.items():
        row[f"val_{name}"] = float(metric.compute())
        metric.reset()
    return row
