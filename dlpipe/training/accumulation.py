"""Gradient accumulation: the micro-batches of one optimizer step (a window), and the scaling that
makes their summed gradients the mean over the window's samples, however many it got, and the trade of
micro-batch for accumulation offered when a step runs out of memory."""

import math

import torch


def epoch_batches(loader, limit_train_batches: int) -> int | None:
    """Micro-batches a training epoch takes: the loader's length (None without one), capped by
    trainer.limit_train_batches."""
    try:
        total = len(loader)
    except TypeError:  # no length: a loader over a stream (PyTorch's asks the dataset, which has none)
        total = None
    if limit_train_batches > 0:
        total = min(total, limit_train_batches) if total is not None else limit_train_batches
    return total


def optimizer_steps(batches: int | None, accumulate: int) -> int | None:
    """Optimizer steps an epoch of `batches` micro-batches takes: its last, partial window steps too."""
    return None if batches is None else math.ceil(batches / accumulate)


class Window:
    """The micro-batches of one optimizer step. The loss of each is scaled by its share of the
    nominal window, so the gradients sum to a mean over samples (see `mean_over_samples`)."""

    def __init__(self, accumulate: int, batch_size: int | None):
        self.accumulate = accumulate
        self.batch_size = batch_size  # None with a custom batch_sampler
        self.micro = self.samples = self.nominal = 0

    def add(self, n: int) -> float:
        """Count in a micro-batch of `n` samples; return the factor its mean loss is scaled by."""
        if self.micro == 0:
            # samples a full window holds; from the first micro-batch when a sampler makes batches
            self.nominal = self.accumulate * (self.batch_size or n)
        self.micro += 1
        self.samples += n
        return n / self.nominal

    @property
    def full(self) -> bool:
        return self.micro == self.accumulate

    def mean_over_samples(self, optimizer: torch.optim.Optimizer, job: tuple[int, int] | None = None) -> None:
        """Make the accumulated gradients the mean over the samples this window got; `job`: (its
        samples on all ranks, the ranks), where DDP averaged gradients of windows that may differ
        (training.stream_ranks): then every rank scales by the same factor."""
        samples, nominal = (self.samples, self.nominal) if job is None else (job[0], self.nominal * job[1])
        if samples != nominal:
            # Partial window (end of epoch, short last batch): the per-micro-batch shares summed to
            # samples / nominal; rescale so the update is the mean over the samples seen.
            # (Scaling the still loss-scaled fp16 gradients is fine: the scaler divides later.)
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(nominal / samples)

    def clear(self) -> None:
        """The optimizer stepped: the next micro-batch starts a new window."""
        self.micro = self.samples = 0


def out_of_memory_advice(batch: int, accumulate: int, error: BaseException) -> str:
    """One line for a CUDA OOM: halve the micro-batch and double accumulation, same effective batch."""
    first = str(error).splitlines()[0] if str(error) else "CUDA out of memory"
    if batch <= 1:
        return f"{first}: loader.batch_size is already 1; use a smaller model or trainer.amp=bf16"
    return (
        f"{first}: with loader.batch_size={batch} trainer.accumulate={accumulate}, try "
        f"loader.batch_size={batch // 2} trainer.accumulate={accumulate * 2} to keep the effective batch "
        f"of {(batch // 2) * accumulate * 2} samples per optimizer step"
        + ("" if batch % 2 == 0 else f" (was {batch * accumulate})")
    )
