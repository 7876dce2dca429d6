"""Seeded train/validation split of any map-style dataset."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, Subset, random_split

from dlpipe.errors import DataError


def train_val_split(dataset: Dataset, val_fraction: float, seed: int) -> tuple[Dataset, Subset | None]:
    """Split ``dataset`` into (train, val) Subsets; ``val_fraction == 0`` returns (dataset, None).

    The validation part gets ``max(1, round(len * val_fraction))`` items and the training part
    keeps the rest, which must be at least one item. The same seed gives the same split, whatever
    the global torch RNG state (the split uses its own generator).
    """
    if not 0.0 <= val_fraction < 1.0:  # also rejects NaN
        raise DataError(f"trainer.val_fraction={val_fraction}: must be >= 0 and < 1")
    if val_fraction == 0:
        return dataset, None
    n = len(dataset)
    n_val = max(1, round(n * val_fraction))
    if n - n_val < 1:
        raise DataError(
            f"trainer.val_fraction={val_fraction}: leaves no training items from a dataset of {n} item(s); "
            "use 0 (no validation) or a larger dataset"
        )
    train, val = random_split(dataset, [n - n_val, n_val], generator=torch.Generator().manual_seed(seed))
    return train, val
