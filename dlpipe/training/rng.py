"""Random state: seeding a run, and capturing/restoring every generator for an exact resume."""

import random

import numpy as np
import torch


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed Python, NumPy and torch (all devices); optionally force deterministic kernels."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    # Set both ways: jobs of a basic-launcher sweep share this process, and one job's
    # deterministic=true must not leak into the next. Only when it changes: torch 2.13 imports
    # torch._inductor on every call, 1.3 s of every launch on 2 CPUs.
    if torch.are_deterministic_algorithms_enabled() != deterministic:
        torch.use_deterministic_algorithms(deterministic)


def capture() -> dict:
    """torch (CPU and CUDA), NumPy and Python generator states as plain containers and tensors."""
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        # NumPy's state holds an ndarray, which weights_only loading refuses: store a tensor
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "python": random.getstate(),
    }


def restore(state: dict) -> None:
    """Put back what capture() returned."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
