"""What the training loop does with a batch's tensors: move them to the device (asynchronously where
that is safe); and how to tell that the loader's workers died under it."""

import torch


def to_device(batch, device: torch.device, non_blocking: bool):
    if isinstance(batch, torch.Tensor):
        if batch.is_cpu and device.type == "cpu":
            return batch  # what .to() would return, without its dispatch (a few us a tensor, every step)
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device, non_blocking) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    return batch


def batch_samples(batch) -> int:
    """Samples in a collated batch: the length of its first tensor, depth first. Every collated field
    leads with the batch dimension: a padding collate's (inputs, targets, lengths) and a dict with an
    attention_mask count the same; a leading field of strings (a list) is skipped, not counted as 1."""
    tensor = _first_tensor(batch)
    if tensor is None:
        return 1
    return tensor.shape[0] if tensor.dim() else 1


def _first_tensor(batch) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    return next((t for t in map(_first_tensor, values) if t is not None), None)


def non_blocking_copies(device: torch.device, loader) -> bool:
    """Copies may be asynchronous only from pinned memory to a CUDA device."""
    return device.type == "cuda" and getattr(loader, "pin_memory", False)


def workers_died(error: RuntimeError) -> bool:
    """Whether `error` is the DataLoader's report of a worker process that exited or was killed."""
    text = str(error)
    return "DataLoader worker" in text and ("exited unexpectedly" in text or "killed by signal" in text)
