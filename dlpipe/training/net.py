"""What runs the training forward pass, and in which precision: the bare model, wrapped in
DistributedDataParallel across ranks, compiled with torch.compile on request, under autocast for
trainer.amp. The Trainer keeps the bare module as `model`, so checkpoints have the same keys
whichever wrappers ran."""

from contextlib import nullcontext
from functools import partial

import torch
from torch.nn.parallel import DistributedDataParallel

from dlpipe.errors import ConfigError, first_line

# Imported inside functions: torch._dynamo (over 2 s), only to read an error of a job that compiles; a torch
# without dynamo has no such error.


def training_net(model: torch.nn.Module, device: torch.device, distributed: bool, compile: bool):
    net = model
    if distributed:
        # Broadcasts rank 0's parameters: every rank starts from the same weights.
        device_ids = [device.index] if device.type == "cuda" else None
        net = DistributedDataParallel(model, device_ids=device_ids)
    if compile:
        # Compiled around DDP, as PyTorch advises, so DDP's bucketing sees the compiled graph's gradients.
        try:
            net = torch.compile(net)
        except Exception as e:  # e.g. a Python version this torch cannot compile for
            raise ConfigError([f"trainer.compile=true: torch.compile cannot run here ({type(e).__name__}: "
                               f"{first_line(e)}); use trainer.compile=false"]) from e
    return net


AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_for(device: torch.device, amp: str):
    """A context-manager factory for the forward passes: autocast to trainer.amp's dtype, or nothing."""
    dtype = AMP_DTYPES.get(amp)
    if dtype is None:
        return nullcontext
    return partial(torch.autocast, device.type, dtype=dtype)


def compile_failure(error: BaseException) -> str | None:
    """One line for an error torch.compile raised at the first compiled step, or None for any other."""
    try:
        from torch._dynamo.exc import TorchDynamoException
    except ImportError:  # a torch without dynamo: nothing of it can have failed
        return None
    if not isinstance(error, TorchDynamoException):
        return None
    return (f"trainer.compile=true: torch.compile failed ({type(error).__name__}: {first_line(error)[:300]}); "
            "use trainer.compile=false")
