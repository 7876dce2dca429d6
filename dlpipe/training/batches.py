"""What the training loop does with one batch: move it to the device and score it; and how to tell
that the loader's workers died under it."""

import torch
import torch.nn.functional as F


def to_device(batch, device: torch.device, non_blocking: bool):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device, non_blocking) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    return batch


def non_blocking_copies(device: torch.device, loader) -> bool:
    """Copies may be asynchronous only from pinned memory to a CUDA device."""
    return device.type == "cuda" and getattr(loader, "pin_memory", False)


def _flat(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.dim() == 3:  # [B, T, V] logits are token-level
        return logits.reshape(-1, logits.size(-1)), target.reshape(-1)
    return logits, target


def training_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; no accuracy: its argmax would cost every step for a number nobody logs."""
    return F.cross_entropy(*_flat(logits, target))


def loss_and_correct(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy and the count of correct predictions (validation)."""
    logits, target = _flat(logits, target)
    return F.cross_entropy(logits, target), (logits.argmax(dim=-1) == target).sum()


def workers_died(error: RuntimeError) -> bool:
    """Whether `error` is the DataLoader's report of a worker process that exited or was killed."""
    text = str(error)
    return "DataLoader worker" in text and ("exited unexpectedly" in text or "killed by signal" in text)
